package gormrelay_test

import (
	"context"
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

// A relay on a pool with database/sql's default idle limit (2), its 8
// drainers kept busy by a writer, closes a connection after many of its
// statements, and the store says so; with an idle limit above what the
// relay and the writer use at once, the pool closes none and the store
// stays quiet.
func TestPoolChurnWarning(t *testing.T) {
	t.Parallel()
	for _, dialect := range []string{dbtest.Postgres, dbtest.MySQL} {
		for _, idle := range []int{0, 16} { // 0: database/sql's default
			name := dialect + "/default-idle"
			if idle > 0 {
				name = dialect + "/idle-16"
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
					Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
				})
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

				if idle == 0 {
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
