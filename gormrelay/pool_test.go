package gormrelay_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

const churnWarning = "closed connections at its idle limit"

// A relay on a pool with database/sql's default idle limit (2) closes a
// connection after most statements while its drainers work, and the store
// says so; with an idle limit above what the relay uses at once it closes
// none, and the store stays quiet.
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
				rows := b.insert(t, keyed(keysN(64), 200)...)
				rec := newRecorder()
				cfg := fastConfig(t, "a")
				cfg.Parallelism = 8
				cfg.BatchSize = 5
				startRelay(t, b.store, rec.publisher("a", nil), cfg)
				requireAllDelivered(t, b, rec, rows)

				if idle == 0 {
					t.Logf("closed %d readings %d", sqlDB.Stats().MaxIdleClosed, gormrelay.PoolReadings(b.store))
					require.Positive(t, sqlDB.Stats().MaxIdleClosed, "the drainers outnumbered the idle slots")
					require.EventuallyWithT(t, func(c *assert.CollectT) {
						assert.Contains(c, logs.String(), churnWarning)
					}, deliverWithin, 10*time.Millisecond)
					require.Equal(t, 1, strings.Count(logs.String(), churnWarning), "one warning per hour at most")
					return
				}
				// Two lease maintenance passes after the drain read the
				// pool again; no connection was closed at the limit.
				passes := gormrelay.PoolReadings(b.store)
				require.EventuallyWithT(t, func(c *assert.CollectT) {
					assert.GreaterOrEqual(c, gormrelay.PoolReadings(b.store), passes+2)
				}, deliverWithin, 10*time.Millisecond)
				require.Zero(t, sqlDB.Stats().MaxIdleClosed)
				require.NotContains(t, logs.String(), churnWarning)
			})
		}
	}
}
