package outbox

import (
	"fmt"
	"log/slog"
	"regexp"

	"github.com/gorm-outbox/outbox/wire"
)

// Defaults applied by Config.WithDefaults.
const (
	// BucketCountDefault is the number of ordering buckets. It bounds how
	// many relays can drain one table in parallel.
	BucketCountDefault = 8
	// BucketCountMax is the largest accepted BucketCount.
	BucketCountMax = 4096
	// MaxMessageBytesDefault is the largest message accepted at enqueue,
	// counted by Message.Size as the Kafka producer counts a record: the
	// default of the Kafka publisher (publisher.MaxMessageBytesDefault,
	// 1,000,000), so nothing the default publisher would refuse commits.
	MaxMessageBytesDefault = wire.KafkaMaxMessageBytesDefault

	// MaxRowsPerWriteDefault is how many rows one update or delete by
	// condition may change for rules that run once per row.
	MaxRowsPerWriteDefault = 10_000
	// MaxRowsPerWriteMax is the largest accepted MaxRowsPerWrite and
	// MaxRows: the keys of the rows read are bound as parameters of the
	// statement, and SQLite takes at most 32,766 of them. For a primary
	// key of k columns the bound is MaxRowsPerWriteMax/k.
	MaxRowsPerWriteMax = 30_000

	MessagesTableDefault    = "outbox_messages"
	LeasesTableDefault      = "outbox_leases"
	RelaysTableDefault      = "outbox_relays"
	DeadLettersTableDefault = "outbox_dead_letters"
)

// Tables names the outbox tables. Every name must be a plain SQL
// identifier: a letter or underscore, then letters, digits or
// underscores, at most 63 characters. Anything else is refused with a
// *ConfigError, so no table name ever reaches SQL unvalidated.
type Tables struct {
	// Schema qualifies every table (PostgreSQL schema, MySQL database).
	// Empty (the default) uses the connection's current schema.
	Schema string
	// Messages holds pending messages. Default "outbox_messages".
	Messages string
	// Leases holds one row per bucket. Default "outbox_leases".
	Leases string
	// Relays holds relay heartbeats. Default "outbox_relays".
	Relays string
	// DeadLetters holds messages that exhausted the failure policy.
	// Default "outbox_dead_letters".
	DeadLetters string
}

// WithPrefix returns the default table names with prefix in front, e.g.
// WithPrefix("billing_") gives "billing_outbox_messages" and so on.
func WithPrefix(prefix string) Tables {
	return Tables{
		Messages:    prefix + MessagesTableDefault,
		Leases:      prefix + LeasesTableDefault,
		Relays:      prefix + RelaysTableDefault,
		DeadLetters: prefix + DeadLettersTableDefault,
	}
}

// Config configures one outbox: its tables, its buckets and its publish
// rules. The zero value is usable: default table names, 8 buckets,
// messages up to MaxMessageBytesDefault, no rules.
type Config struct {
	// Name identifies the outbox in the plugin name, logs and metrics.
	// Default: the messages table name.
	Name string
	// Tables names the outbox tables. Zero fields take their defaults.
	Tables Tables
	// BucketCount is the number of ordering buckets, 1 to 4096. Default 8.
	// Every writer and every relay sharing the tables must use the same
	// value: a writer with a larger count writes rows into buckets no relay
	// owns, which the relay reports as a misconfiguration and stops. The
	// first relay records the count in the lease table (one row per
	// bucket); a relay with another count is refused. Changing it requires
	// stopping the relays, draining the table and deleting the lease rows
	// (docs/operations.md, "Changing BucketCount").
	BucketCount int
	// MaxMessageBytes is the largest message, counted by Limits.Size (by
	// default Message.Size, as the Kafka producer counts the record it
	// becomes), that Enqueue and publish rules accept. Default MaxMessageBytesDefault (1,000,000),
	// the Kafka publisher's own default. Keep it at or below the
	// publisher's MaxMessageBytes and the broker's message.max.bytes for
	// the topic. A negative value disables the check.
	MaxMessageBytes int
	// Limits are the sink's rules for a message: which topic names it
	// accepts and how it counts a message's size against MaxMessageBytes.
	// Enqueue and publish rules refuse a message that breaks them, in the
	// writer's transaction. Default KafkaLimits{}; a relay publishing to
	// another sink supplies that sink's rules here.
	Limits Limits
	// MaxRowsPerWrite bounds how many rows one update or delete by
	// condition (one that names no entity with a primary key, or entities
	// with a key when a rule of the model has ReadRow) may change on a
	// table whose rules run once per row: the plugin reads and locks the
	// matching rows first and refuses a write that matches more with a
	// *TooManyRowsError, before anything changes. Default
	// MaxRowsPerWriteDefault (10,000); at most MaxRowsPerWriteMax. A rule
	// can lower or raise it with MaxRows; rules built with AllowBulk are
	// not bounded, except in a write of entities read by key for a
	// ReadRow rule, where every rule runs once per row.
	MaxRowsPerWrite int
	// GuardRawSQL refuses raw SQL (db.Exec, db.Raw) that writes to a
	// table with publish rules (INSERT INTO, UPDATE, DELETE FROM,
	// REPLACE INTO, MERGE INTO or TRUNCATE naming it) with a
	// *RawWriteError, before it runs. Raw SQL is outside the rules: without
	// the guard such a statement changes rows and publishes nothing. The
	// check reads the statement's text, so a string literal that looks like
	// such a write is refused too. Off by default.
	GuardRawSQL bool
	// Rules are the declarative publish rules, built with OnCreate,
	// OnUpdate, OnDelete or On. More can be added with Plugin.AddRule
	// before the first write.
	Rules []Rule
	// Mode is where messages are written: ModeTable (the default), rows
	// of the messages table, or ModeWAL, PostgreSQL's write-ahead log
	// (PostgreSQL 14+ with wal_level = logical; db.Use fails with a
	// *WALUnsupportedError otherwise). See docs/wal-mode.md.
	Mode Mode
	// Logger receives the plugin's logs. Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its
// default.
func (c Config) WithDefaults() Config {
	if c.Tables.Messages == "" {
		c.Tables.Messages = MessagesTableDefault
	}
	if c.Tables.Leases == "" {
		c.Tables.Leases = LeasesTableDefault
	}
	if c.Tables.Relays == "" {
		c.Tables.Relays = RelaysTableDefault
	}
	if c.Tables.DeadLetters == "" {
		c.Tables.DeadLetters = DeadLettersTableDefault
	}
	if c.Name == "" {
		c.Name = c.Tables.Messages
	}
	if c.BucketCount == 0 {
		c.BucketCount = BucketCountDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.Limits == nil {
		c.Limits = KafkaLimits{}
	}
	if c.MaxRowsPerWrite == 0 {
		c.MaxRowsPerWrite = MaxRowsPerWriteDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// ValidateIdentifier reports whether name can be used as a table or schema
// name: a letter or underscore followed by letters, digits or underscores,
// at most 63 characters in all. field names the setting in the error.
func ValidateIdentifier(field, name string) error {
	if !identifierRE.MatchString(name) {
		return &ConfigError{Package: "outbox", Field: field, Value: fmt.Sprintf("%q", name), Reason: "must match [A-Za-z_][A-Za-z0-9_]* and be at most 63 characters"}
	}
	return nil
}

// Validate checks a configuration that WithDefaults has filled in.
func (c Config) Validate() error {
	if err := c.Tables.Validate(); err != nil {
		return err
	}
	if c.BucketCount < 1 || c.BucketCount > BucketCountMax {
		return &ConfigError{Package: "outbox", Field: "BucketCount", Value: c.BucketCount, Reason: fmt.Sprintf("must be between 1 and %d", BucketCountMax)}
	}
	if c.Mode != ModeTable && c.Mode != ModeWAL {
		return &ConfigError{Package: "outbox", Field: "Mode", Value: c.Mode, Reason: "must be ModeTable or ModeWAL"}
	}
	if c.MaxRowsPerWrite < 1 || c.MaxRowsPerWrite > MaxRowsPerWriteMax {
		return &ConfigError{Package: "outbox", Field: "MaxRowsPerWrite", Value: c.MaxRowsPerWrite, Reason: fmt.Sprintf("must be between 1 and %d", MaxRowsPerWriteMax)}
	}
	for i, r := range c.Rules {
		if r == nil {
			return &ConfigError{Package: "outbox", Field: fmt.Sprintf("Rules[%d]", i), Value: nil, Reason: "nil rule"}
		}
	}
	return nil
}

// Validate checks that every name is a plain identifier and that the four
// tables are distinct. Empty names are refused: fill them in with
// Config.WithDefaults or WithPrefix first.
func (t Tables) Validate() error {
	if t.Schema != "" {
		if err := ValidateIdentifier("Tables.Schema", t.Schema); err != nil {
			return err
		}
	}
	names := map[string]string{}
	for _, n := range []struct{ field, name string }{
		{"Tables.Messages", t.Messages},
		{"Tables.Leases", t.Leases},
		{"Tables.Relays", t.Relays},
		{"Tables.DeadLetters", t.DeadLetters},
	} {
		if err := ValidateIdentifier(n.field, n.name); err != nil {
			return err
		}
		if other, dup := names[n.name]; dup {
			return &ConfigError{Package: "outbox", Field: n.field, Value: n.name, Reason: "same table name as " + other}
		}
		names[n.name] = n.field
	}
	return nil
}

// qualified returns the table name with the schema in front, unquoted;
// GORM's quoting turns "s.t" into a quoted schema and table.
func (t Tables) qualified(name string) string {
	if t.Schema == "" {
		return name
	}
	return t.Schema + "." + name
}

// MessagesTable, LeasesTable, RelaysTable and DeadLettersTable return the
// schema-qualified names, ready for db.Table.
func (t Tables) MessagesTable() string    { return t.qualified(t.Messages) }
func (t Tables) LeasesTable() string      { return t.qualified(t.Leases) }
func (t Tables) RelaysTable() string      { return t.qualified(t.Relays) }
func (t Tables) DeadLettersTable() string { return t.qualified(t.DeadLetters) }
