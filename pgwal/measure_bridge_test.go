package pgwal_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// writeBacklog commits n messages of 16 keys, 100 per transaction.
func writeBacklog(t *testing.T, db *gorm.DB, n int) {
	t.Helper()
	for i := 0; i < n; i += 100 {
		require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
			msgs := make([]*outbox.Message, 0, 100)
			for j := i; j < min(i+100, n); j++ {
				msgs = append(msgs, &outbox.Message{Topic: "drain", Key: []byte(strconv.Itoa(j % 16)), Value: []byte("value-" + strconv.Itoa(j))})
			}
			return outbox.Enqueue(tx, msgs...)
		}))
	}
}

// TestMeasureBridgeDrain measures, on the WAL mode server, the drain of
// a backlog of OUTBOX_MEASURE_BRIDGE rows written in table mode (16 keys,
// 100 per transaction) through a publisher that acknowledges at once: by
// a table relay (gormrelay.DrainOnce) and by a bridging reader
// (pgwal.Config.Bridge: decoded from the slot, each row read and deleted
// by the reader), interleaved A B A B A B, medians of 3. Run only when
// the variable is set:
//
//	OUTBOX_MEASURE_BRIDGE=20000 go test -count=1 -run TestMeasureBridgeDrain -v ./pgwal/
func TestMeasureBridgeDrain(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_MEASURE_BRIDGE"))
	if n <= 0 {
		t.Skip("set OUTBOX_MEASURE_BRIDGE to the backlog size")
	}
	table := func() time.Duration {
		db := dbtest.OpenWAL(t)
		p, err := outbox.NewPlugin(outbox.Config{Name: dbtest.Name("m_")})
		require.NoError(t, err)
		require.NoError(t, db.DB.Use(p))
		require.NoError(t, p.AutoMigrate(context.Background(), db.DB))
		writeBacklog(t, db.DB, n)
		ack := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
		began := time.Now()
		got, err := gormrelay.DrainOnce(context.Background(), db.DB, p.Config(), ack, relay.Config{})
		require.NoError(t, err)
		require.Equal(t, n, got)
		return time.Since(began)
	}
	bridge := func() time.Duration {
		e := &env{db: dbtest.OpenWAL(t)}
		var err error
		e.plugin, err = outbox.NewPlugin(outbox.Config{Name: dbtest.Name("m_"), Mode: outbox.ModeWAL})
		require.NoError(t, err)
		require.NoError(t, e.db.DB.Use(e.plugin))
		require.NoError(t, e.plugin.AutoMigrate(context.Background(), e.db.DB))
		tableDB, _ := e.tableSide(t)
		var published atomic.Int64
		count := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
			published.Add(int64(len(msgs)))
			return len(msgs), nil
		})
		r := e.reader(t, count, "m", func(c *pgwal.Config) {
			c.Bridge = true
			c.BatchSize = 100
			c.StandbyInterval = time.Second
			c.LeaseDuration = 10 * time.Second
		})
		writeBacklog(t, tableDB, n)
		began := time.Now()
		stop := run(r)
		// Drained: every row published and deleted.
		require.Eventually(t, func() bool {
			var left int64
			return published.Load() >= int64(n) && e.db.Table(e.plugin.Config().Tables.Messages).Count(&left).Error == nil && left == 0
		}, 10*time.Minute, time.Millisecond)
		took := time.Since(began)
		require.NoError(t, stop())
		return took
	}
	var ts, bs []time.Duration
	for range 3 {
		ts = append(ts, table())
		bs = append(bs, bridge())
	}
	slices.Sort(ts)
	slices.Sort(bs)
	t.Logf("drain of %d table-mode rows, medians of 3 (interleaved): table relay %v (%.0f msg/s), bridging reader %v (%.0f msg/s), bridge/table time %.2f; all: table %v, bridge %v",
		n, ts[1].Round(time.Millisecond), float64(n)/ts[1].Seconds(), bs[1].Round(time.Millisecond), float64(n)/bs[1].Seconds(),
		bs[1].Seconds()/ts[1].Seconds(), ts, bs)
}
