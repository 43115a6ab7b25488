package pgwal_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// The reader's own statements (its lease, renewed every StandbyInterval,
// the publication, the slot's status) do not reach the application's GORM
// log (Info level, every statement "slow"); the application's statements,
// the plugin's emit in its transaction included, still do.
func TestReaderStatementsLogOnlyFailures(t *testing.T) {
	var buf dbtest.LogBuffer
	gl := dbtest.LogEverything(&buf)
	base := dbtest.OpenWAL(t)
	db, err := dbtest.OpenGorm(dbtest.Postgres, base.DSN, &gorm.Config{Logger: gl})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlDB.Close() })
	p, err := outbox.NewPlugin(outbox.Config{Name: dbtest.Name("q_"), Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, db.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), db))
	var published atomic.Int64
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		published.Add(int64(len(msgs)))
		return len(msgs), nil
	})
	e := &env{db: &dbtest.DB{DB: db}}
	var logs dbtest.LogBuffer
	cfg := ownedConfig(t, "quiet")
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil)) // Info
	r, err := pgwal.New(db, p, pub, cfg)
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(context.Background()))
	e.dropSlotAtEnd(t, r)
	buf.Take()

	require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
	}))
	user := buf.Take()
	require.Contains(t, user, "pg_logical_emit_message", "the plugin's emit, in the application's transaction, logs")

	stop := run(r)
	require.Eventually(t, func() bool { return published.Load() == 1 }, 30*time.Second, 20*time.Millisecond)
	// Two renewals of the lease, read through a connection that does not
	// log.
	expires := func() int64 {
		var l pgwal.SlotLease
		require.NoError(t, base.DB.Table(r.Config().LeaseTable).Where("slot = ?", r.Config().Slot).Take(&l).Error)
		return l.ExpiresAtMs
	}
	for range 2 {
		before := expires()
		require.Eventually(t, func() bool { return expires() > before }, 30*time.Second, 20*time.Millisecond)
	}
	require.NoError(t, stop())
	require.Empty(t, buf.Take(), "the reader logs none of its statements")
	// The reader's own log names its term; the relay engine's lease
	// records, the same term again, are debug.
	require.Contains(t, logs.String(), "pgwal: reading the slot")
	require.NotContains(t, logs.String(), "relay: leases changed")
	require.NotContains(t, logs.String(), "relay: released leases")
}
