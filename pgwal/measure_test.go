package pgwal_test

import (
	"context"
	"os"
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

// TestMeasureDrain measures, on the WAL mode server, the drain of a
// backlog of OUTBOX_MEASURE_DRAIN messages (16 keys, 100 per transaction)
// through a publisher that acknowledges at once: table mode
// (gormrelay.DrainOnce) beside WAL mode (pgwal.Reader), so the figures
// compare the sources, not Kafka. Run only when the variable is set:
//
//	OUTBOX_MEASURE_DRAIN=100000 go test -count=1 -run TestMeasureDrain -v ./pgwal/
func TestMeasureDrain(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_MEASURE_DRAIN"))
	if n <= 0 {
		t.Skip("set OUTBOX_MEASURE_DRAIN to the backlog size")
	}
	ack := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })

	// Table mode.
	tdb := dbtest.OpenWAL(t)
	tp, err := outbox.NewPlugin(outbox.Config{Name: dbtest.Name("m_")})
	require.NoError(t, err)
	require.NoError(t, tdb.DB.Use(tp))
	require.NoError(t, tp.AutoMigrate(context.Background(), tdb.DB))
	writeBacklog(t, tdb.DB, n)
	began := time.Now()
	got, err := gormrelay.DrainOnce(context.Background(), tdb.DB, tp.Config(), ack, relay.Config{})
	require.NoError(t, err)
	require.Equal(t, n, got)
	tableTook := time.Since(began)

	// WAL mode.
	e := &env{db: dbtest.OpenWAL(t)}
	e.plugin, err = outbox.NewPlugin(outbox.Config{Name: dbtest.Name("m_"), Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, e.db.DB.Use(e.plugin))
	require.NoError(t, e.plugin.AutoMigrate(context.Background(), e.db.DB))
	var published atomic.Int64
	count := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		published.Add(int64(len(msgs)))
		return len(msgs), nil
	})
	r := e.reader(t, count, "m", func(c *pgwal.Config) {
		c.BatchSize = 100
		c.StandbyInterval = time.Second
		c.LeaseDuration = 10 * time.Second
	})
	writeBacklog(t, e.db.DB, n)
	began = time.Now()
	stop := run(r)
	require.Eventually(t, func() bool { return published.Load() >= int64(n) }, 10*time.Minute, time.Millisecond)
	walTook := time.Since(began)
	require.NoError(t, stop())
	t.Logf("drain of %d messages: table mode %v (%.0f msg/s), WAL mode %v (%.0f msg/s), ratio WAL/table %.2f",
		n, tableTook.Round(time.Millisecond), float64(n)/tableTook.Seconds(), walTook.Round(time.Millisecond), float64(n)/walTook.Seconds(),
		tableTook.Seconds()/walTook.Seconds())
}

type measureRow struct {
	ID    uint64 `gorm:"primaryKey"`
	Value string
}

// TestMeasureWrite measures the cost of the outbox on the write: the
// same OUTBOX_MEASURE_WRITE transactions, each inserting one row and
// (with a plugin) enqueueing one message, without the plugin, in table
// mode and in WAL mode, on the WAL mode server:
//
//	OUTBOX_MEASURE_WRITE=3000 go test -count=1 -run TestMeasureWrite -v ./pgwal/
func TestMeasureWrite(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_MEASURE_WRITE"))
	if n <= 0 {
		t.Skip("set OUTBOX_MEASURE_WRITE to the number of transactions")
	}
	measure := func(mode *outbox.Mode) time.Duration {
		db := dbtest.OpenWAL(t)
		if mode != nil {
			p, err := outbox.NewPlugin(outbox.Config{Name: dbtest.Name("w_"), Mode: *mode})
			require.NoError(t, err)
			require.NoError(t, db.DB.Use(p))
			require.NoError(t, p.AutoMigrate(context.Background(), db.DB))
		}
		require.NoError(t, db.AutoMigrate(&measureRow{}))
		began := time.Now()
		for i := range n {
			require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&measureRow{ID: uint64(i + 1), Value: "v"}).Error; err != nil {
					return err
				}
				if mode == nil {
					return nil
				}
				return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte(strconv.Itoa(i % 16)), Value: []byte("value")})
			}))
		}
		return time.Since(began)
	}
	table, wal := outbox.ModeTable, outbox.ModeWAL
	if slot := dbtest.NewWALSlot(t); slot == nil { // a slot exists, as in production
		t.Fatal("no slot")
	}
	none, tt, wt := measure(nil), measure(&table), measure(&wal)
	t.Logf("%d transactions: no plugin %v, table mode %v (%.2f), WAL mode %v (%.2f)",
		n, none.Round(time.Millisecond), tt.Round(time.Millisecond), tt.Seconds()/none.Seconds(), wt.Round(time.Millisecond), wt.Seconds()/none.Seconds())
}
