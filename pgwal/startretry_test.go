package pgwal_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/tcpgate"
	"github.com/gorm-outbox/outbox/pgwal"
)

// TestReaderRetriesSetupWhileDatabaseDown: Run started while the database
// cannot be reached (down, restarting, not yet accepting connections)
// retries creating its lease table and publication with backoff instead
// of returning, and reads once the database answers.
func TestReaderRetriesSetupWhileDatabaseDown(t *testing.T) {
	e := setup(t)
	e.reader(t, e.pub, "setup") // the slot, dropped at the end
	pc, err := pgconn.ParseConfig(dbtest.PostgresWALDSN())
	require.NoError(t, err)
	g := tcpgate.Start(t, net.JoinHostPort(pc.Host, strconv.Itoa(int(pc.Port))))
	g.Open() // opening pings
	db, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN+g.Via(), &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	g.Shut()
	sqlDB.SetMaxIdleConns(0) // closes the pinged connection
	sqlDB.SetMaxIdleConns(2)
	r, err := pgwal.New(db, e.plugin, e.pub, pgwal.Config{
		ReplicationDSN: dbtest.PostgresWALDSN(), RelayID: "behind-the-gate",
		LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Logger: dbtest.Logger(t),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	require.Eventually(t, func() bool {
		select {
		case err := <-done:
			require.NoError(t, err, "Run returned while the database was down")
		default:
		}
		return g.Refused() >= 20
	}, 30*time.Second, 5*time.Millisecond, "Run keeps trying to reach the database")
	g.Open()
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)
	cancel()
	require.NoError(t, <-done)
}

// TestReaderConcurrentStart: readers started at once on a fresh outbox
// race to create the lease table and the publication; the losers see the
// winner's objects and go on instead of returning.
func TestReaderConcurrentStart(t *testing.T) {
	e := setup(t)
	const n = 8
	readers := make([]*pgwal.Reader, n)
	for i := range readers {
		r, err := pgwal.New(e.db.DB, e.plugin, e.pub, pgwal.Config{
			ReplicationDSN: dbtest.PostgresWALDSN(), RelayID: "r" + strconv.Itoa(i),
			LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
			BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Logger: dbtest.Logger(t),
		})
		require.NoError(t, err)
		readers[i] = r
	}
	slot := readers[0].Config().Slot
	e.dropSlotNamedAtEnd(t, slot)
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, n)
	start := make(chan struct{})
	for _, r := range readers {
		go func() { <-start; errs <- r.Run(ctx) }()
	}
	close(start)
	require.Eventually(t, func() bool {
		select {
		case err := <-errs:
			require.NoError(t, err, "a reader returned at start")
		default:
		}
		// The slot is created, and reading starts from its consistent
		// point, once the lease row records a position.
		var recorded int64
		_ = e.db.Raw("SELECT confirmed_lsn FROM "+e.plugin.Config().Tables.Leases+"_wal WHERE slot = ?", slot).Scan(&recorded).Error
		return recorded > 0
	}, 30*time.Second, 5*time.Millisecond)
	e.write(t, 2, 0, 5)
	e.checkDelivered(t, 2, 5)
	cancel()
	for range n {
		require.NoError(t, <-errs)
	}
}
