package wire

// The outbox row's columns. The messages table and the dead-letters table
// share the message columns (ColMessageID to ColAttempts) in this order;
// the column lists of the module's SQL statements and the outbox schema
// are built from these constants, and the struct tags of
// outbox.MessageRow and outbox.DeadLetterRow, which cannot use them, are
// checked against them by TestRowModelsSpellTheWireColumns.
const (
	ColID          = "id"
	ColMessageID   = "message_id"
	ColBucket      = "bucket"
	ColTopic       = "topic"
	ColKey         = "msg_key"
	ColValue       = "msg_value"
	ColHeaders     = "headers"
	ColPartition   = "msg_partition"
	ColCreatedAtMs = "created_at_ms"
	ColAttempts    = "attempts"

	// Messages table only.
	ColNextAttemptAtMs = "next_attempt_at_ms"
	// Messages and dead-letters tables.
	ColLastError = "last_error"
	// Dead-letters table only.
	ColDeadAtMs = "dead_at_ms"
	ColState    = "state"
)

// Column lists, comma-separated, for SELECT and INSERT statements.
const (
	// InsertColumns are the columns a new message row is written with;
	// the id and the failure columns take their defaults.
	InsertColumns = ColMessageID + ", " + ColBucket + ", " + ColTopic + ", " + ColKey + ", " +
		ColValue + ", " + ColHeaders + ", " + ColPartition + ", " + ColCreatedAtMs
	// InsertArgs is the number of columns in InsertColumns.
	InsertArgs = 8

	// MessageColumns are the id followed by every message column, as a
	// dead letter keeps them.
	MessageColumns = ColID + ", " + InsertColumns + ", " + ColAttempts
)
