package outbox

import (
	"context"
	"fmt"

	"gorm.io/gorm"
)

// MessageRow is a pending message: one row per message, deleted once the
// sink acknowledged it, so the table is the publish backlog.
//
// Column names avoid words reserved in MySQL (key, partition, value).
// Times are Unix milliseconds in 64-bit integers: comparisons stay on the
// server and mean the same on every database.
type MessageRow struct {
	// ID orders rows within a bucket: submission order.
	ID        int64  `gorm:"column:id;primaryKey;autoIncrement;index:,composite:bucket_id,priority:2"`
	MessageID string `gorm:"column:message_id;type:varchar(64);not null"`
	Bucket    int32  `gorm:"column:bucket;not null;index:,composite:bucket_id,priority:1"`
	Topic     string `gorm:"column:topic;type:varchar(249);not null"`
	// Key is NULL for a keyless message.
	Key []byte `gorm:"column:msg_key"`
	// Value is NULL for a tombstone.
	Value []byte `gorm:"column:msg_value"`
	// Headers in the EncodeHeaders format; NULL for none.
	Headers     []byte `gorm:"column:headers"`
	Partition   *int32 `gorm:"column:msg_partition"`
	CreatedAtMs int64  `gorm:"column:created_at_ms;not null"`
	// Attempts, NextAttemptAtMs and LastError belong to the failure policy.
	Attempts        int32   `gorm:"column:attempts;not null;default:0"`
	NextAttemptAtMs int64   `gorm:"column:next_attempt_at_ms;not null;default:0"`
	LastError       *string `gorm:"column:last_error;type:text"`
}

// TableName is the default table name; Plugin.AutoMigrate uses the
// configured one.
func (MessageRow) TableName() string { return MessagesTableDefault }

// LeaseRow is one bucket's lease: who owns it, until when, and under
// which term. Term grows on every acquisition.
type LeaseRow struct {
	Bucket      int32   `gorm:"column:bucket;primaryKey;autoIncrement:false"`
	Owner       *string `gorm:"column:owner;type:varchar(128)"`
	Term        int64   `gorm:"column:term;not null;default:0"`
	ExpiresAtMs int64   `gorm:"column:expires_at_ms;not null;default:0"`
	Paused      bool    `gorm:"column:paused;not null;default:false"`
}

// TableName is the default table name.
func (LeaseRow) TableName() string { return LeasesTableDefault }

// RelayRow is a relay's heartbeat, used to divide buckets fairly among
// the live relays.
type RelayRow struct {
	RelayID     string `gorm:"column:relay_id;type:varchar(128);primaryKey"`
	LastSeenMs  int64  `gorm:"column:last_seen_ms;not null"`
	StartedAtMs int64  `gorm:"column:started_at_ms;not null"`
}

// TableName is the default table name.
func (RelayRow) TableName() string { return RelaysTableDefault }

// DeadLetterRow is a message taken out of the backlog by the failure
// policy, kept for an operator to inspect and requeue.
type DeadLetterRow struct {
	// ID is the message's row id in the messages table when it died.
	ID          int64   `gorm:"column:id;primaryKey;autoIncrement:false;index:,composite:bucket_id,priority:2"`
	MessageID   string  `gorm:"column:message_id;type:varchar(64);not null"`
	Bucket      int32   `gorm:"column:bucket;not null;index:,composite:bucket_id,priority:1"`
	Topic       string  `gorm:"column:topic;type:varchar(249);not null"`
	Key         []byte  `gorm:"column:msg_key"`
	Value       []byte  `gorm:"column:msg_value"`
	Headers     []byte  `gorm:"column:headers"`
	Partition   *int32  `gorm:"column:msg_partition"`
	CreatedAtMs int64   `gorm:"column:created_at_ms;not null"`
	Attempts    int32   `gorm:"column:attempts;not null;default:0"`
	LastError   *string `gorm:"column:last_error;type:text"`
	DeadAtMs    int64   `gorm:"column:dead_at_ms;not null;index"`
	// State is "failed" for the message that exhausted the policy and
	// "parked" for a later message of the same key held behind it.
	State string `gorm:"column:state;type:varchar(16);not null"`
}

// TableName is the default table name.
func (DeadLetterRow) TableName() string { return DeadLettersTableDefault }

// Models returns the outbox models with their default table names, for
// db.AutoMigrate(outbox.Models()...). With custom table names use
// Plugin.AutoMigrate, which creates the tables under the configured names.
func Models() []any {
	return []any{&MessageRow{}, &LeaseRow{}, &RelayRow{}, &DeadLetterRow{}}
}

// AutoMigrate creates or updates the outbox tables under the configured
// names; empty names take their defaults. Running it again changes
// nothing. The names are validated first (see Validate): nothing runs for
// a name that is not a plain identifier.
func (t Tables) AutoMigrate(ctx context.Context, db *gorm.DB) error {
	t = Config{Tables: t}.WithDefaults().Tables
	if err := t.Validate(); err != nil {
		return err
	}
	db = db.Session(&gorm.Session{NewDB: true, Context: ctx})
	for _, m := range []struct {
		table string
		model any
	}{
		{t.MessagesTable(), &MessageRow{}},
		{t.LeasesTable(), &LeaseRow{}},
		{t.RelaysTable(), &RelayRow{}},
		{t.DeadLettersTable(), &DeadLetterRow{}},
	} {
		if err := db.Table(m.table).AutoMigrate(m.model); err != nil {
			return fmt.Errorf("outbox: migrate table %s: %w", m.table, err)
		}
	}
	return nil
}
