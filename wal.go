package outbox

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/walenv"
)

// Mode is where the plugin writes messages.
type Mode int

const (
	// ModeTable (the default) inserts every message as a row of the
	// messages table, which relays poll. It works on every dialect.
	ModeTable Mode = iota
	// ModeWAL writes every message into PostgreSQL's write-ahead log with
	// pg_logical_emit_message, in the write's transaction, and inserts no
	// row. A WAL reader (package pgwal) reads them from a logical
	// replication slot in commit order. PostgreSQL 14 or later with
	// wal_level = logical only; see docs/wal-mode.md.
	ModeWAL
)

func (m Mode) String() string {
	switch m {
	case ModeTable:
		return "table"
	case ModeWAL:
		return "wal"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

// WALPrefixBase starts the logical decoding message prefix of every
// outbox in WAL mode; Config.WALPrefix appends the outbox name.
const WALPrefixBase = "gorm-outbox:"

// WALPrefix is the prefix of the logical decoding messages this outbox
// writes in WAL mode, WALPrefixBase followed by Name: readers decode only
// the messages carrying it. Call it on a configuration that WithDefaults
// has filled in.
func (c Config) WALPrefix() string { return WALPrefixBase + c.Name }

// walMinVersion is the oldest PostgreSQL server_version_num WAL mode
// accepts: 14 (pgoutput's messages option).
const walMinVersion = 140000

// ErrWALUnsupported is wrapped by every *WALUnsupportedError.
var ErrWALUnsupported = errors.New("outbox: WAL mode is not available on this database")

// WALUnsupportedError says why a plugin configured with ModeWAL cannot be
// used on a database: not PostgreSQL, older than 14, or wal_level not
// logical. db.Use returns it and the plugin is not registered.
type WALUnsupportedError struct {
	// Dialect is GORM's dialect name.
	Dialect string
	// Reason says what is missing and what to change.
	Reason string
}

func (e *WALUnsupportedError) Error() string {
	return fmt.Sprintf("outbox: WAL mode on %s: %s", e.Dialect, e.Reason)
}

// Unwrap returns ErrWALUnsupported.
func (e *WALUnsupportedError) Unwrap() error { return ErrWALUnsupported }

// checkWAL verifies, once at db.Use, that db can take WAL mode writes.
func (p *Plugin) checkWAL(db *gorm.DB) error {
	dialect := db.Dialector.Name()
	if dialect != "postgres" {
		return &WALUnsupportedError{Dialect: dialect, Reason: "WAL mode needs PostgreSQL 14 or later; use ModeTable"}
	}
	var level string
	var version int
	row := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).
		Raw("SELECT current_setting('wal_level'), current_setting('server_version_num')::int").Row()
	if err := row.Scan(&level, &version); err != nil {
		return fmt.Errorf("outbox: WAL mode: read wal_level: %w", err)
	}
	if version < walMinVersion {
		return &WALUnsupportedError{Dialect: dialect, Reason: fmt.Sprintf("server_version_num is %d, WAL mode needs PostgreSQL 14 or later", version)}
	}
	if level != "logical" {
		return &WALUnsupportedError{Dialect: dialect, Reason: fmt.Sprintf("wal_level is %q; set wal_level = logical and restart PostgreSQL", level)}
	}
	return nil
}

// emitSQL writes one message into the WAL as a transactional logical
// decoding message: it is decoded at its transaction's commit, in commit
// order, and never if the transaction rolls back.
const emitSQL = "SELECT pg_logical_emit_message(true, $1, $2::bytea)"

// emit writes validated msgs into the WAL in tx, one statement per
// message so their order in the log is the order given.
func (p *Plugin) emit(tx *gorm.DB, msgs []*Message) error {
	now := time.Now().UnixMilli()
	conn := p.findTx(tx.Statement.ConnPool)
	var exec gorm.ConnPool = tx.Statement.ConnPool
	if conn != nil {
		exec = conn
	}
	prefix := p.cfg.WALPrefix()
	ctx := tx.Statement.Context
	var buf []byte
	for _, m := range msgs {
		bucket, err := p.identify(m)
		if err != nil {
			return err
		}
		env := walenv.Envelope{ID: m.ID, Bucket: bucket, Topic: m.Topic, Key: m.Key, Value: m.Value,
			Partition: m.Partition, CreatedAtMs: now, Headers: EncodeHeaders(m.Headers)}
		buf = walenv.Encode(buf[:0], &env)
		begin := time.Now()
		_, err = exec.ExecContext(ctx, emitSQL, prefix, buf)
		tx.Logger.Trace(ctx, begin, func() (string, int64) { return emitSQL, 1 }, err)
		if err != nil {
			return fmt.Errorf("outbox: write message %s to the WAL: %w", m.ID, err)
		}
		if conn != nil {
			conn.record(bucket)
		}
	}
	return nil
}
