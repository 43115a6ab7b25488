package outbox_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/walenv"
)

// TestWALModeRefusedWhereUnsupported: db.Use fails with a
// *WALUnsupportedError on MySQL, SQLite and a PostgreSQL without
// wal_level = logical, and the plugin is not registered.
func TestWALModeRefusedWhereUnsupported(t *testing.T) {
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		if db.Dialect == dbtest.Postgres {
			var level string
			require.NoError(t, db.Raw("SHOW wal_level").Scan(&level).Error)
			if level == "logical" {
				t.Skip("the shared server has wal_level = logical: covered by TestWALModeEmits")
			}
		}
		p, err := outbox.NewPlugin(outbox.Config{Mode: outbox.ModeWAL})
		require.NoError(t, err)
		err = db.Use(p)
		var we *outbox.WALUnsupportedError
		require.ErrorAs(t, err, &we)
		require.ErrorIs(t, err, outbox.ErrWALUnsupported)
		_, err = outbox.Lookup(db.DB, p.Config().Name)
		require.Error(t, err, "the plugin must not be registered")
	})
}

func TestWALModeConfigValidated(t *testing.T) {
	_, err := outbox.NewPlugin(outbox.Config{Mode: outbox.Mode(7)})
	var ce *outbox.ConfigError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "Mode", ce.Field)
}

// walWriter opens a WAL mode plugin with orderRules on the WAL server,
// and a slot that sees what it writes.
func walWriter(t *testing.T) (*wbundle, *dbtest.WALSlot, string) {
	t.Helper()
	slot := dbtest.NewWALSlot(t)
	dbt := dbtest.OpenWAL(t)
	b := setupWrite(t, dbt, outbox.Config{Name: dbtest.Name("o_"), Mode: outbox.ModeWAL, Rules: orderRules()})
	return b, slot, b.plugin.Config().WALPrefix()
}

func decodeAll(t *testing.T, msgs []dbtest.WALMessage) []*walenv.Envelope {
	t.Helper()
	out := make([]*walenv.Envelope, len(msgs))
	for i, m := range msgs {
		require.True(t, m.Transactional, "messages are emitted transactionally")
		e, err := walenv.Decode(m.Content)
		require.NoError(t, err)
		out[i] = e
	}
	return out
}

// TestWALModeEmitsCommittedMessages: rules and explicit Enqueue write
// each message into the WAL in the write's transaction, with every field,
// and no row into the messages table; a rolled-back transaction emits
// nothing; commits wake the notifier as in table mode.
func TestWALModeEmitsCommittedMessages(t *testing.T) {
	b, slot, prefix := walWriter(t)
	ctx := context.Background()
	p := int32(2)
	require.NoError(t, b.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&Order{ID: 1, Status: "new"}).Error; err != nil {
			return err
		}
		return outbox.Enqueue(tx, &outbox.Message{Topic: "audit", Key: []byte{}, Value: nil, Partition: &p,
			Headers: []outbox.Header{{Key: "h", Value: []byte("v")}, {Key: "h", Value: nil}}, ID: "explicit-1"})
	}))
	got, _ := b.taken()
	require.Contains(t, got, bucketOf(key(1)), "the commit hints the order's bucket")

	errRollback := errors.New("roll back")
	require.ErrorIs(t, b.db.Transaction(func(tx *gorm.DB) error {
		require.NoError(t, tx.Create(&Order{ID: 2, Status: "new"}).Error)
		require.NoError(t, outbox.Enqueue(tx, &outbox.Message{Topic: "audit", Value: []byte("lost")}))
		return errRollback
	}), errRollback)
	require.NoError(t, b.db.Create(&Order{ID: 3, Status: "new"}).Error) // implicit transaction

	envs := decodeAll(t, slot.Messages(t, prefix))
	require.Len(t, envs, 3)
	require.Equal(t, "orders", envs[0].Topic)
	require.Equal(t, key(1), envs[0].Key)
	require.Equal(t, []byte("placed:1"), envs[0].Value)
	require.Equal(t, bucketOf(key(1)), envs[0].Bucket)
	require.Nil(t, envs[0].Partition)
	require.NotEmpty(t, envs[0].ID)
	require.NotZero(t, envs[0].CreatedAtMs)

	require.Equal(t, "explicit-1", envs[1].ID)
	require.Equal(t, "audit", envs[1].Topic)
	require.NotNil(t, envs[1].Key)
	require.Empty(t, envs[1].Key)
	require.Nil(t, envs[1].Value)
	require.Equal(t, &p, envs[1].Partition)
	require.Equal(t, 2, envs[1].Bucket)
	hs, err := outbox.DecodeHeaders(envs[1].Headers)
	require.NoError(t, err)
	require.Equal(t, []outbox.Header{{Key: "h", Value: []byte("v")}, {Key: "h", Value: nil}}, hs)

	require.Equal(t, []byte("placed:3"), envs[2].Value)
	require.Empty(t, b.rows(t), "WAL mode writes no row")
}

// TestWALModeValidatesAsTableMode: a bad message fails in the
// transaction with the same typed errors and emits nothing.
func TestWALModeValidatesAsTableMode(t *testing.T) {
	b, slot, prefix := walWriter(t)
	big := make([]byte, outbox.MaxMessageBytesDefault+1)
	for _, m := range []*outbox.Message{{Topic: "bad topic"}, {Topic: "t", Value: big}} {
		err := b.db.Transaction(func(tx *gorm.DB) error {
			require.NoError(t, outbox.Enqueue(tx, &outbox.Message{Topic: "ok", Value: []byte("before")}))
			return outbox.Enqueue(tx, m)
		})
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
	}
	require.Empty(t, slot.Messages(t, prefix))
}

// emitCounter counts the statements that emit messages.
type emitCounter struct {
	logger.Interface
	statements, messages atomic.Int64
}

func (c *emitCounter) Trace(ctx context.Context, begin time.Time, fc func() (string, int64), err error) {
	if q, n := fc(); strings.Contains(q, "pg_logical_emit_message") {
		c.statements.Add(1)
		c.messages.Add(n)
	}
}

// TestWALModeEmitsAWriteInOneStatement: the messages of a transaction go
// into the WAL in as few statements as fit, up to 500 per statement, in
// the order given; a rolled-back savepoint drops its own.
func TestWALModeEmitsAWriteInOneStatement(t *testing.T) {
	b, slot, prefix := walWriter(t)
	count := &emitCounter{Interface: logger.Discard}
	db := b.db.Session(&gorm.Session{Logger: count})
	msgs := func(from, n int) []*outbox.Message {
		out := make([]*outbox.Message, n)
		for i := range out {
			out[i] = &outbox.Message{Topic: "seq", Key: []byte(strconv.Itoa((from + i) % 7)), Value: []byte(strconv.Itoa(from + i))}
		}
		return out
	}
	require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
		if err := outbox.Enqueue(tx, msgs(0, 3)...); err != nil {
			return err
		}
		require.Error(t, tx.Transaction(func(tx *gorm.DB) error {
			require.NoError(t, outbox.Enqueue(tx, msgs(-100, 2)...))
			return errors.New("roll back the savepoint")
		}))
		return outbox.Enqueue(tx, msgs(3, 700)...)
	}))
	// The messages are held: the 3 go with the SAVEPOINT (before it), the
	// 2 of the rolled-back savepoint are dropped unsent, and the 700 are
	// sent as 500 and 200 when they arrive, more than one statement's
	// worth; nothing is left for COMMIT.
	require.Equal(t, int64(3), count.statements.Load(), "3, then 700 as 500 and 200")
	require.Equal(t, int64(703), count.messages.Load())
	envs := decodeAll(t, slot.Messages(t, prefix))
	require.Len(t, envs, 703)
	for i, e := range envs {
		require.Equal(t, strconv.Itoa(i), string(e.Value), "message %d out of order", i)
		require.Equal(t, []byte(strconv.Itoa(i%7)), e.Key)
	}
}
