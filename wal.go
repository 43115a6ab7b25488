package outbox

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
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

// emitChunk bounds the messages of one emitting statement (and so its
// placeholders); statementBytes bounds its payload.
const emitChunk = 500

// emitManySQL returns the statement that writes n > 1 messages, $2 to
// $n+1, in one round trip: the aggregate consumes the VALUES rows one by
// one, in the order listed, so the messages enter the log in that order.
// The texts are built once per n and kept, so the statement cache of the
// driver sees the same text again.
func emitManySQL(n int) string {
	if n < len(emitManyCache) {
		if q := emitManyCache[n].Load(); q != nil {
			return *q
		}
	}
	var b strings.Builder
	b.WriteString("SELECT count(pg_logical_emit_message(true, $1, m)) FROM (VALUES ")
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("($")
		b.WriteString(strconv.Itoa(i + 2))
		if i == 0 {
			b.WriteString("::bytea")
		}
		b.WriteString(")")
	}
	b.WriteString(") AS v(m)")
	q := b.String()
	if n < len(emitManyCache) {
		emitManyCache[n].Store(&q)
	}
	return q
}

var emitManyCache [emitChunk + 1]atomic.Pointer[string]

// emit writes validated msgs into the WAL in tx, in the order given: one
// statement for up to emitChunk messages, so a write costs one round
// trip whatever number of messages its rules build.
func (p *Plugin) emit(tx *gorm.DB, msgs []*Message) error {
	now := time.Now().UnixMilli()
	conn := p.findTx(tx.Statement.ConnPool)
	var exec gorm.ConnPool = tx.Statement.ConnPool
	if conn != nil {
		exec = conn
	}
	ctx := tx.Statement.Context
	if conn != nil {
		if wt := conn.walTx(); wt != nil {
			// Held, encoded, until COMMIT carries them (walconn.go).
			envs := make([][]byte, len(msgs))
			for i, m := range msgs {
				env, bucket, err := p.envelope(m, now)
				if err != nil {
					return err
				}
				envs[i] = env
				conn.record(bucket)
			}
			return wt.hold(ctx, tx.Logger, p.cfg.WALPrefix(), envs)
		}
	}
	args := make([]any, 1, 1+min(len(msgs), emitChunk))
	args[0] = p.cfg.WALPrefix()
	for start := 0; start < len(msgs); {
		args = args[:1]
		bytes := 0
		end := start
		for end < len(msgs) && end-start < emitChunk {
			m := msgs[end]
			size := m.Size() + rowOverhead
			if end > start && bytes+size > statementBytes {
				break
			}
			bytes += size
			env, bucket, err := p.envelope(m, now)
			if err != nil {
				return err
			}
			args = append(args, env)
			if conn != nil {
				conn.record(bucket)
			}
			end++
		}
		q := emitSQL
		if n := end - start; n > 1 {
			q = emitManySQL(n)
		}
		begin := time.Now()
		_, err := exec.ExecContext(ctx, q, args...)
		tx.Logger.Trace(ctx, begin, func() (string, int64) { return q, int64(end - start) }, err)
		if err != nil {
			if end-start == 1 {
				return fmt.Errorf("outbox: write message %s to the WAL: %w", msgs[start].ID, err)
			}
			return fmt.Errorf("outbox: write %d messages to the WAL: %w", end-start, err)
		}
		start = end
	}
	return nil
}

// envelope identifies m and encodes it as the content of its logical
// decoding message; it returns m's bucket too.
func (p *Plugin) envelope(m *Message, nowMs int64) ([]byte, int, error) {
	bucket, err := p.identify(m)
	if err != nil {
		return nil, 0, err
	}
	env := walenv.Envelope{ID: m.ID, Bucket: bucket, Topic: m.Topic, Key: m.Key, Value: m.Value,
		Partition: m.Partition, CreatedAtMs: nowMs, Headers: EncodeHeaders(m.Headers)}
	return walenv.Encode(make([]byte, 0, walenv.Size(&env)), &env), bucket, nil
}
