package outbox

import (
	"errors"
	"fmt"

	"github.com/gorm-outbox/outbox/wire"
)

// Sentinel errors. Each is returned wrapped; test with errors.Is.
var (
	// ErrNoTransaction is returned by Enqueue when the *gorm.DB it was given
	// is not inside a transaction. The message is not written: writing it as
	// a separate statement would be the dual write the outbox exists to
	// avoid. Call Enqueue inside db.Transaction (or between Begin and Commit)
	// together with the business write.
	ErrNoTransaction = errors.New("outbox: enqueue needs a transaction: call it inside db.Transaction with the business write")

	// ErrNoPlugin is returned when no outbox plugin is registered on the
	// *gorm.DB, and ErrAmbiguousPlugin when more than one is and the caller
	// did not say which.
	ErrNoPlugin        = errors.New("outbox: no outbox plugin registered on this *gorm.DB (db.Use(outbox.NewPlugin(...)))")
	ErrAmbiguousPlugin = errors.New("outbox: several outbox plugins are registered on this *gorm.DB: call Enqueue on the *Plugin")

	// ErrInvalidMessage is wrapped by every *MessageError.
	ErrInvalidMessage = errors.New("outbox: invalid message")

	// ErrUnsupportedWrite is returned, and the write rolled back, when a
	// table with publish rules is written in a way the rules cannot
	// describe faithfully: an update or delete by condition over more rows
	// than the limit (*TooManyRowsError), a create through a map or
	// Table(name) whose key cannot be known, an upsert from maps or whose
	// outcome (which rows were inserted, which updated) did not check out.
	ErrUnsupportedWrite = errors.New("outbox: write not supported for a model with publish rules")

	// ErrInvalidConfig is wrapped by every *ConfigError. It is
	// wire.ErrInvalidConfig, as is relay.ErrInvalidConfig.
	ErrInvalidConfig = wire.ErrInvalidConfig
)

// ConfigError reports a configuration field that failed validation. It is
// wire.ConfigError (as is relay.ConfigError), the one shape every package
// of the module reports configuration errors with; this package's have
// Package "outbox".
type ConfigError = wire.ConfigError

// MessageError reports a message that was refused before anything was
// written. When it comes from a publish rule or Enqueue inside a write, the
// whole transaction is rolled back.
type MessageError struct {
	Field  string // "Topic", "Value", "Partition", "Headers", ...
	Topic  string
	Reason string
}

func (e *MessageError) Error() string {
	if e.Topic != "" {
		return fmt.Sprintf("outbox: invalid message for topic %q: %s: %s", e.Topic, e.Field, e.Reason)
	}
	return fmt.Sprintf("outbox: invalid message: %s: %s", e.Field, e.Reason)
}

// Unwrap lets errors.Is(err, ErrInvalidMessage) match.
func (e *MessageError) Unwrap() error { return ErrInvalidMessage }

// TooLargeError is returned when a message exceeds Config.MaxMessageBytes,
// or, on MySQL/MariaDB, the server's max_allowed_packet (a larger value
// would make the server drop the connection mid-statement). It wraps
// ErrInvalidMessage.
type TooLargeError struct {
	Topic string
	Size  int // bytes counted by Message.Size, as the Kafka producer counts them
	Limit int
	// Setting names the limit: "MaxMessageBytes" or "max_allowed_packet".
	Setting string
}

func (e *TooLargeError) Error() string {
	setting := e.Setting
	if setting == "" {
		setting = "MaxMessageBytes"
	}
	return fmt.Sprintf("outbox: message for topic %q is %d bytes, over %s %d", e.Topic, e.Size, setting, e.Limit)
}

// Unwrap lets errors.Is(err, ErrInvalidMessage) match.
func (e *TooLargeError) Unwrap() error { return ErrInvalidMessage }

// TooManyRowsError is returned when an update or delete by condition, or
// of entities read by key for a ReadRow rule, matches more rows than the
// rules that run once per row allow (Config.MaxRowsPerWrite, MaxRows).
// The rows are counted before the statement runs: nothing was changed,
// also inside a transaction of the caller's. It wraps
// ErrUnsupportedWrite.
type TooManyRowsError struct {
	Model     string // the rules' model type, e.g. "main.Order"
	Table     string
	Operation Operation
	Limit     int
}

func (e *TooManyRowsError) Error() string {
	return fmt.Sprintf("outbox: %s of %s (table %s) matches more than %d rows, the limit of its publish rules that run once per row: nothing was changed; change fewer rows per write, raise MaxRows or Config.MaxRowsPerWrite, or (for a write by condition) build the rules with AllowBulk",
		e.Operation, e.Model, e.Table, e.Limit)
}

// Unwrap lets errors.Is(err, ErrUnsupportedWrite) match.
func (e *TooManyRowsError) Unwrap() error { return ErrUnsupportedWrite }

// RawWriteError is returned, with Config.GuardRawSQL, for raw SQL
// (db.Exec, db.Raw) that writes to a table with publish rules. Nothing
// ran. It wraps ErrUnsupportedWrite.
type RawWriteError struct {
	Table string
	SQL   string // the statement, at most 200 characters
}

func (e *RawWriteError) Error() string {
	return fmt.Sprintf("outbox: raw SQL writes to table %s, which has publish rules, and would publish nothing (Config.GuardRawSQL): write through GORM's API or enqueue the messages: %s", e.Table, e.SQL)
}

// Unwrap lets errors.Is(err, ErrUnsupportedWrite) match.
func (e *RawWriteError) Unwrap() error { return ErrUnsupportedWrite }

// RuleError wraps an error returned by a publish rule, or the refusal of
// the message it returned (a *MessageError, such as an invalid topic, or
// a *TooLargeError: errors.As finds them through Unwrap). The write that
// triggered the rule is rolled back.
type RuleError struct {
	Model     string    // the model type, e.g. "main.Order"
	Operation Operation // what the write did
	// Rule names the rule: its type parameter and operations, e.g.
	// "rule(*main.Order on update)". Empty for a rule that panicked.
	Rule string
	Err  error
}

func (e *RuleError) Error() string {
	if e.Rule != "" {
		return fmt.Sprintf("outbox: publish %s for model %s on %s: %v", e.Rule, e.Model, e.Operation, e.Err)
	}
	return fmt.Sprintf("outbox: publish rule for %s on %s: %v", e.Model, e.Operation, e.Err)
}

// Unwrap returns the rule's error.
func (e *RuleError) Unwrap() error { return e.Err }
