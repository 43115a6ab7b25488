package gormrelay_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

const churnWarning = "closed connections at its idle limit"

// A relay on a pool whose idle limit the application explicitly left at
// database/sql's default (2), its 8 drainers kept busy by a writer, closes
// a connection after many of its statements, and the store says so. On a
// pool the application never touched, the store raised the idle limit
// itself (logged at Debug, not at Info): the pool closes no connection at its idle
// limit and the store stays quiet, as with an idle limit of 16 set by the
// application.
func TestPoolChurnWarning(t *testing.T) {
	t.Parallel()
	for _, dialect := range []string{dbtest.Postgres, dbtest.MySQL} {
		for _, idle := range []int{-1, 2, 16} { // -1: never set
			name := fmt.Sprintf("%s/idle-%d", dialect, idle)
			if idle < 0 {
				name = dialect + "/untouched"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				db := dbtest.Open(t, dialect)
				sqlDB, err := db.DB.DB()
				require.NoError(t, err)
				if idle > 0 {
					sqlDB.SetMaxIdleConns(idle)
				}
				var logs dbtest.LogBuffer
				b := newStoreBundle(t, db, outbox.Config{
					Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
				})
				if idle < 0 {
					require.Contains(t, logs.String(), `level=DEBUG msg="outbox: raised the connection pool's idle limit`)
					require.NotContains(t, logs.String(), `level=INFO msg="outbox: raised the connection pool's idle limit`)
					require.Contains(t, logs.String(), "max_idle_conns=16")
				} else {
					require.NotContains(t, logs.String(), "raised the connection pool's idle limit", "a limit the application set is kept")
				}
				var acked atomic.Int64
				cfg := fastConfig(t, "a")
				cfg.Parallelism = 8
				cfg.BatchSize = 5
				startRelay(t, b.store, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
					acked.Add(int64(len(msgs)))
					return len(msgs), nil
				}), cfg)
				stop := keepWriting(t, b, &acked)
				defer stop()

				if idle == 2 {
					require.EventuallyWithT(t, func(c *assert.CollectT) {
						assert.Contains(c, logs.String(), churnWarning)
					}, deliverWithin, 10*time.Millisecond)
					stop()
					require.Positive(t, sqlDB.Stats().MaxIdleClosed)
					require.Equal(t, 1, strings.Count(logs.String(), churnWarning), "one warning an hour at most")
					return
				}
				// The pool is read at each lease maintenance; wait for
				// readings that span at least two of the store's windows
				// and 2,000 published messages.
				passes := gormrelay.PoolReadings(b.store)
				start := time.Now()
				require.EventuallyWithT(t, func(c *assert.CollectT) {
					assert.GreaterOrEqual(c, acked.Load(), int64(2000))
					assert.GreaterOrEqual(c, gormrelay.PoolReadings(b.store), passes+2)
					assert.Greater(c, time.Since(start), 2*gormrelay.ChurnWindow)
				}, deliverWithin, 10*time.Millisecond)
				stop()
				require.Zero(t, sqlDB.Stats().MaxIdleClosed)
				require.NotContains(t, logs.String(), churnWarning)
			})
		}
	}
}

// The store reads the pool's idle limit: a Go release that renames
// database/sql's field would silently turn the tuning off.
func TestPoolIdleLimitReadable(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	sqlDB, err := db.DB.DB()
	require.NoError(t, err)
	set, known := gormrelay.IdleLimitSet(sqlDB)
	require.True(t, known, "database/sql's maxIdleCount field is readable")
	_ = set // dbtest may tune SQLite's pool
	fresh := &sql.DB{}
	set, known = gormrelay.IdleLimitSet(fresh)
	require.True(t, known)
	require.False(t, set)
	fresh.SetMaxIdleConns(2)
	set, _ = gormrelay.IdleLimitSet(fresh)
	require.True(t, set, "an explicit default is a setting")
}

// A relay wired by hand (NewStore, relay.New) with a Parallelism above the
// default gets an idle limit for it at its first lease acquisition, on a
// pool the store tuned; never on one the application set.
func TestPoolTunedForParallelism(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	b := newStoreBundle(t, db, outbox.Config{})
	require.Equal(t, gormrelay.PoolIdleFor(relay.ParallelismDefault), gormrelay.TunedIdle(b.store))
	b.insert(t, keyed(keysN(40), 1)...)
	cfg := fastConfig(t, "wide")
	cfg.Parallelism = 32
	rec := newRecorder()
	startRelay(t, b.store, rec.publisher("wide", nil), cfg)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, b.count(c)) }, deliverWithin, 10*time.Millisecond)
	require.Equal(t, gormrelay.PoolIdleFor(32), gormrelay.TunedIdle(b.store))
	require.Equal(t, 40, gormrelay.PoolIdleFor(32))

	// The application's own setting is kept.
	set := dbtest.Open(t, dbtest.Postgres)
	sqlDB, err := set.DB.DB()
	require.NoError(t, err)
	sqlDB.SetMaxIdleConns(3)
	kept := newStoreBundle(t, set, outbox.Config{})
	kr := startRelay(t, kept.store, rec.publisher("kept", nil), cfg)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.NotEmpty(c, kr.Leases()) }, deliverWithin, 10*time.Millisecond)
	require.Zero(t, gormrelay.TunedIdle(kept.store))
}

// keepWriting inserts rows across the buckets, 64 at a time, keeping at
// most 1,000 of them unpublished, until the returned stop is called (stop
// waits for the writer to end; calling it again does nothing).
func keepWriting(t *testing.T, b *storeBundle, acked *atomic.Int64) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		keys := keysN(64)
		inserted := int64(0)
		for n := 0; ; n++ {
			select {
			case <-quit:
				return
			default:
			}
			if inserted-acked.Load() > 1000 {
				time.Sleep(time.Millisecond) // poll: the relay is behind
				continue
			}
			rows := keyed(keys, 1)
			for i := range rows {
				rows[i].MessageID = fmt.Sprintf("w-%d-%d", n, i)
			}
			b.fill(rows)
			if err := b.messages().CreateInBatches(rows, 500).Error; err != nil {
				t.Errorf("insert: %v", err)
				return
			}
			inserted += int64(len(rows))
		}
	}()
	var once atomic.Bool
	return func() {
		if once.CompareAndSwap(false, true) {
			close(quit)
		}
		<-done
	}
}
