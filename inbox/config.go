package inbox

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/wire"
)

// Defaults applied by Config.WithDefaults.
const (
	// TableDefault is the inbox table's default name.
	TableDefault = "outbox_inbox"
	// MessageIDHeaderDefault is the record header that carries the message
	// id: the header the outbox's Kafka publisher stamps on every record
	// (publisher.DefaultMessageIDHeader).
	MessageIDHeaderDefault = wire.KafkaMessageIDHeaderDefault
	// MessageIDMaxLen is the longest accepted message id, in bytes: the
	// width of the message_id column. The outbox's ids are 36-byte UUIDs.
	MessageIDMaxLen = 64
	// RetentionDefault is how long a processed id is kept: seven days,
	// Kafka's default log retention (log.retention.hours=168), so a
	// consumer group re-reading a topic from its oldest record still
	// finds every id it processed.
	RetentionDefault = 7 * 24 * time.Hour
	// PurgeIntervalDefault is the wait between two purges of RunPurge.
	PurgeIntervalDefault = time.Hour
	// PurgeBatchDefault is how many ids one purge statement deletes.
	PurgeBatchDefault = 1000
	// RetryMinDefault and RetryMaxDefault bound the backoff of Handle
	// (and so of the consumer-group adapter) between two attempts at a
	// record whose handler or transaction failed.
	RetryMinDefault = 100 * time.Millisecond
	RetryMaxDefault = 30 * time.Second
)

// Config configures an Inbox. The zero value is usable: table
// outbox_inbox in the connection's schema, ids from the
// x-outbox-message-id header, records without it refused, seven days of
// retention.
type Config struct {
	// Name identifies the inbox in logs and in the metrics' inbox label.
	// Default: the table name.
	Name string
	// Table is the inbox table's name, a plain SQL identifier as for the
	// outbox tables (a letter or underscore, then letters, digits or
	// underscores, at most 63 characters). Default TableDefault.
	Table string
	// Schema qualifies the table (PostgreSQL schema, MySQL database).
	// Empty (the default) uses the connection's current schema.
	Schema string
	// MessageIDHeader is the record header that carries the message id.
	// Default MessageIDHeaderDefault. Set it to the Kafka publisher's
	// KafkaConfig.MessageIDHeader when that was changed.
	MessageIDHeader string
	// AllowMissingID makes Process run the handler of a record without a
	// usable message id (no header, an empty one, or one longer than
	// MessageIDMaxLen) in a transaction that records nothing, reporting
	// Unrecorded: such a record is not deduplicated, a redelivery runs the
	// handler again. Default false: Process refuses the record with a
	// *MessageIDError and runs nothing.
	AllowMissingID bool
	// Retention is how long a processed id is kept before Purge deletes
	// it. A redelivery that arrives later than Retention after the first
	// processing is processed again, so keep it above the longest
	// redelivery you expect: the topic's retention if consumers may
	// re-read a topic from its start. Default RetentionDefault (7 days).
	// Negative keeps ids forever (Purge deletes nothing).
	Retention time.Duration
	// PurgeInterval is the wait between two purges of RunPurge. Default
	// PurgeIntervalDefault (1 hour).
	PurgeInterval time.Duration
	// PurgeBatch bounds the rows one purge statement deletes, so a purge
	// never holds locks on the whole table. Default PurgeBatchDefault
	// (1000).
	PurgeBatch int
	// RetryMin and RetryMax bound the exponential backoff, with jitter,
	// of Handle between attempts at a failing record. Defaults
	// RetryMinDefault (100ms) and RetryMaxDefault (30s).
	RetryMin, RetryMax time.Duration
	// Observer receives every outcome, for metrics
	// (metrics.NewInbox returns one). Default: none.
	Observer Observer
	// Logger receives the inbox's logs. Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its
// default.
func (c Config) WithDefaults() Config {
	if c.Table == "" {
		c.Table = TableDefault
	}
	if c.Name == "" {
		c.Name = c.Table
	}
	if c.MessageIDHeader == "" {
		c.MessageIDHeader = MessageIDHeaderDefault
	}
	if c.Retention == 0 {
		c.Retention = RetentionDefault
	}
	if c.PurgeInterval == 0 {
		c.PurgeInterval = PurgeIntervalDefault
	}
	if c.PurgeBatch == 0 {
		c.PurgeBatch = PurgeBatchDefault
	}
	if c.RetryMin == 0 {
		c.RetryMin = RetryMinDefault
	}
	if c.RetryMax == 0 {
		c.RetryMax = RetryMaxDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks a configuration that WithDefaults has filled in. Errors
// are *outbox.ConfigError, matching errors.Is(err, outbox.ErrInvalidConfig).
func (c Config) Validate() error {
	if err := outbox.ValidateIdentifier("Table", c.Table); err != nil {
		return err
	}
	if c.Schema != "" {
		if err := outbox.ValidateIdentifier("Schema", c.Schema); err != nil {
			return err
		}
	}
	bad := func(field string, v any, reason string) error {
		return &outbox.ConfigError{Field: field, Value: v, Reason: reason}
	}
	switch {
	case c.MessageIDHeader == "":
		return bad("MessageIDHeader", `""`, "must not be empty")
	case c.PurgeInterval < 0:
		return bad("PurgeInterval", c.PurgeInterval, "must be positive")
	case c.PurgeBatch < 1:
		return bad("PurgeBatch", c.PurgeBatch, "must be at least 1")
	case c.RetryMin < 0:
		return bad("RetryMin", c.RetryMin, "must be positive")
	case c.RetryMax < c.RetryMin:
		return bad("RetryMax", c.RetryMax, fmt.Sprintf("must be at least RetryMin (%s)", c.RetryMin))
	}
	return nil
}

// qualified is the table name with the schema in front, unquoted; GORM's
// quoting turns "s.t" into a quoted schema and table.
func (c Config) qualified() string {
	if c.Schema == "" {
		return c.Table
	}
	return c.Schema + "." + c.Table
}
