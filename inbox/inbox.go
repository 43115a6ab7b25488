package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
	"unicode/utf8"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// Handler applies one record inside tx, the transaction that also records
// its message id. Every write of the handler must go through tx (or a
// session derived from it) to commit or roll back with the id; the
// outbox works on it as usual (outbox.Enqueue, publish rules), so a
// handler that reacts by publishing commits its events with the rest.
// Returning an error rolls everything back. ctx is the context given to
// Process, also set on tx.
type Handler func(ctx context.Context, tx *gorm.DB, rec Record) error

// Outcome says what Process did with a record.
type Outcome int

const (
	// Processed: the handler ran and its writes committed together with
	// the message id.
	Processed Outcome = iota + 1
	// Duplicate: the message id was already recorded, by an earlier
	// delivery or by a concurrent one that committed first. The handler
	// did not run, or its transaction was rolled back: nothing of this
	// delivery was committed.
	Duplicate
	// Unrecorded: the record had no usable message id and
	// Config.AllowMissingID is set: the handler's writes committed, no id
	// was recorded, a redelivery runs the handler again.
	Unrecorded
)

func (o Outcome) String() string {
	switch o {
	case Processed:
		return "processed"
	case Duplicate:
		return "duplicate"
	case Unrecorded:
		return "unrecorded"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result is what Process did with one record.
type Result struct {
	// MessageID is the record's message id; "" when it had none.
	MessageID string
	Outcome   Outcome
}

// Observer receives the inbox's events, for metrics. metrics.NewInbox
// returns a Prometheus implementation. Methods are called synchronously
// on the processing goroutine and must be quick and safe for concurrent
// use.
type Observer interface {
	// Processed is called after a handler's transaction committed
	// (Processed and Unrecorded outcomes).
	Processed(topic string)
	// DuplicateSkipped is called for a Duplicate outcome.
	DuplicateSkipped(topic string)
	// Failed is called for an attempt that committed nothing: handler is
	// true when the handler returned an error, false when the database
	// failed (beginning, recording, committing). Attempts ended by the
	// context's cancellation are not failures.
	Failed(topic string, handler bool)
	// Purged is called after Purge deleted n expired ids.
	Purged(n int64)
}

// Inbox records processed message ids in the consumer's database, in the
// transaction of the handler that applies them. It is safe for
// concurrent use; one Inbox serves every partition and goroutine.
type Inbox struct {
	db        *gorm.DB
	cfg       Config
	log       *slog.Logger
	table     string // quoted, schema-qualified
	insertSQL string
}

// New returns an inbox on db for cfg, completed with WithDefaults and
// validated (an *outbox.ConfigError otherwise). It does not create the
// table: see AutoMigrate and the migration files.
func New(db *gorm.DB, cfg Config) (*Inbox, error) {
	if db == nil {
		return nil, errors.New("inbox: nil *gorm.DB")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	db = db.Session(&gorm.Session{NewDB: true})
	table := db.Statement.Quote(cfg.qualified())
	return &Inbox{
		db:    db,
		cfg:   cfg,
		log:   cfg.Logger.With(slog.String("inbox", cfg.Name)),
		table: table,
		insertSQL: "INSERT INTO " + table + " (" + db.Statement.Quote("message_id") + ", " + db.Statement.Quote("topic") + ", " +
			db.Statement.Quote("msg_partition") + ", " + db.Statement.Quote("msg_offset") + ", " + db.Statement.Quote("processed_at_ms") +
			") VALUES (?, ?, ?, ?, ?)",
	}, nil
}

// Config returns the configuration with defaults filled in.
func (i *Inbox) Config() Config { return i.cfg }

// TableName returns the schema-qualified table name, ready for db.Table.
func (i *Inbox) TableName() string { return i.cfg.qualified() }

// MessageID returns the record's message id from the configured header,
// or a *MessageIDError when it has none that fits the table.
func (i *Inbox) MessageID(rec Record) (string, error) {
	v, ok := rec.Header(i.cfg.MessageIDHeader)
	reason := ""
	switch {
	case !ok:
		reason = "missing"
	case len(v) == 0:
		reason = "empty"
	case len(v) > MessageIDMaxLen:
		reason = fmt.Sprintf("longer than %d bytes", MessageIDMaxLen)
	case !utf8.Valid(v):
		reason = "not valid UTF-8"
	default:
		return string(v), nil
	}
	return "", &MessageIDError{Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, Header: i.cfg.MessageIDHeader, Reason: reason}
}

// errDuplicate ends the transaction of a delivery whose id is recorded.
var errDuplicate = errors.New("inbox: message id already recorded")

// Process runs h for rec once per message id: in one transaction it
// records the id and runs h, so either both commit or neither does.
//
//   - The id is recorded first, by an INSERT on the table's primary key.
//     When it is already recorded, or when a concurrent transaction
//     records it and commits first (PostgreSQL and MySQL make the INSERT
//     wait for that transaction; SQLite lets one writer in at a time),
//     the INSERT fails with the database's unique violation, the
//     transaction is rolled back, h is not called and Process returns
//     Outcome Duplicate with a nil error. When the concurrent transaction
//     rolls back instead, this one proceeds and processes the record.
//   - When h returns an error, the transaction is rolled back (the id is
//     not recorded, none of h's writes stay) and Process returns a
//     *HandlerError wrapping it. A redelivery runs h again.
//   - A database failure (begin, insert, commit) is returned as is; a
//     commit that failed leaves nothing recorded.
//   - A record without a usable id is refused with a *MessageIDError
//     before anything runs, unless Config.AllowMissingID is set (Outcome
//     Unrecorded).
//
// Process makes one attempt; Handle retries. It opens its own
// transaction on the inbox's *gorm.DB: do not call it inside another.
func (i *Inbox) Process(ctx context.Context, rec Record, h Handler) (Result, error) {
	id, err := i.MessageID(rec)
	if err != nil && !i.cfg.AllowMissingID {
		return Result{}, err
	}
	res := Result{MessageID: id, Outcome: Processed}
	if id == "" {
		res.Outcome = Unrecorded
	}
	err = i.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if id != "" {
			// Without the statement logger: a duplicate is an expected
			// outcome, not an error to log.
			ins := tx.Session(&gorm.Session{Logger: logger.Discard}).
				Exec(i.insertSQL, id, rec.Topic, rec.Partition, rec.Offset, time.Now().UnixMilli())
			if ins.Error != nil {
				if isUniqueViolation(tx, ins.Error) {
					return errDuplicate
				}
				return fmt.Errorf("inbox: record message %s in %s: %w", id, i.cfg.qualified(), ins.Error)
			}
		}
		if err := h(ctx, tx, rec); err != nil {
			return &HandlerError{MessageID: id, Err: err}
		}
		return nil
	})
	obs := i.cfg.Observer
	switch {
	case err == nil:
		if obs != nil {
			obs.Processed(rec.Topic)
		}
		return res, nil
	case errors.Is(err, errDuplicate):
		if obs != nil {
			obs.DuplicateSkipped(rec.Topic)
		}
		i.log.Debug("inbox skipped a duplicate", slog.String("message_id", id), slog.String("topic", rec.Topic),
			slog.Int("partition", int(rec.Partition)), slog.Int64("offset", rec.Offset))
		return Result{MessageID: id, Outcome: Duplicate}, nil
	}
	if obs != nil && ctx.Err() == nil {
		var he *HandlerError
		obs.Failed(rec.Topic, errors.As(err, &he))
	}
	return Result{MessageID: id}, err
}

// isUniqueViolation reports whether err is the database's unique-key
// violation: gorm.ErrDuplicatedKey when the *gorm.DB translates errors,
// else the driver's own error as the dialector translates it (SQLSTATE
// 23505 on PostgreSQL, error 1062 on MySQL/MariaDB, extended code 1555
// SQLITE_CONSTRAINT_PRIMARYKEY on SQLite). Wrapped errors are unwrapped
// first, since dialectors only recognize the driver's error itself.
func isUniqueViolation(db *gorm.DB, err error) bool {
	if errors.Is(err, gorm.ErrDuplicatedKey) {
		return true
	}
	tr, ok := db.Dialector.(gorm.ErrorTranslator)
	if !ok {
		return false
	}
	for e := err; e != nil; e = errors.Unwrap(e) {
		if errors.Is(tr.Translate(e), gorm.ErrDuplicatedKey) {
			return true
		}
	}
	return false
}

// Handle is Process with retries: after a failed attempt (handler error
// or database failure) it waits an exponential backoff with jitter,
// between Config.RetryMin and Config.RetryMax, and tries again, until an
// attempt commits or finds a duplicate (nil error), the record has no
// usable id (*MessageIDError: retrying cannot help), or ctx ends (its
// cause is returned, wrapped). Each failure is logged at Warn. A record
// that can never succeed is retried until ctx ends: a handler that meets
// a poison record should store it (e.g. in a dead-letter table, in tx)
// and return nil, so its id is recorded and consumption moves on.
func (i *Inbox) Handle(ctx context.Context, rec Record, h Handler) (Result, error) {
	backoff := i.cfg.RetryMin
	for attempt := 1; ; attempt++ {
		res, err := i.Process(ctx, rec, h)
		if err == nil || errors.Is(err, ErrNoMessageID) {
			return res, err
		}
		if ctx.Err() != nil {
			return res, fmt.Errorf("inbox: message %s not processed: %w", res.MessageID, context.Cause(ctx))
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		i.log.Warn("inbox: processing failed, retrying", slog.String("message_id", res.MessageID),
			slog.String("topic", rec.Topic), slog.Int("partition", int(rec.Partition)), slog.Int64("offset", rec.Offset),
			slog.Int("attempt", attempt), slog.Duration("retry_in", wait), slog.Any("error", err))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return res, fmt.Errorf("inbox: message %s not processed: %w", res.MessageID, context.Cause(ctx))
		case <-t.C:
		}
		backoff = min(backoff*2, i.cfg.RetryMax)
	}
}
