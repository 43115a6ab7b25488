package pgwal_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/promtest"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// downablePub publishes to the test's Kafka, and fails as unavailable
// (the broker down) while the returned flag is set.
func (e *env) downablePub() (relay.Publisher, *atomic.Bool) {
	blocked := new(atomic.Bool)
	return relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		if blocked.Load() {
			return 0, relay.Unavailable(errors.New("broker down"))
		}
		return e.pub.Publish(ctx, msgs)
	}), blocked
}

// otherProcessAdmin is an Admin on a connection pool of its own, with no
// reader: the API process of a service whose reader runs elsewhere.
func (e *env) otherProcessAdmin(t *testing.T, r *pgwal.Reader) *pgwal.Admin {
	t.Helper()
	admin, _ := e.otherProcessAdminDB(t, r)
	return admin
}

// otherProcessAdminDB is otherProcessAdmin with the Admin's own pool.
func (e *env) otherProcessAdminDB(t *testing.T, r *pgwal.Reader) (*pgwal.Admin, *sql.DB) {
	t.Helper()
	db, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	plugin, err := outbox.NewPlugin(outbox.Config{Name: e.plugin.Config().Name, Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, db.Use(plugin))
	admin, err := pgwal.NewAdmin(db, plugin, pgwal.Config{Slot: r.Config().Slot, LeaseDuration: r.Config().LeaseDuration, StandbyInterval: r.Config().StandbyInterval})
	require.NoError(t, err)
	return admin, sqlDB
}

// TestCollectorsWithoutDatabase: while the database does not answer, the
// WAL collectors leave their slot series out and the scrape stands, so
// the process's other series (here a counter of its own) are still
// scraped: an error would fail the whole scrape.
func TestCollectorsWithoutDatabase(t *testing.T) {
	e := setup(t)
	pub, _ := e.downablePub()
	r := e.reader(t, pub, "reader-a")
	admin, sqlDB := e.otherProcessAdminDB(t, r)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(admin.Collector())
	other := prometheus.NewCounter(prometheus.CounterOpts{Name: "process_own_total", Help: "A series of the process."})
	other.Inc()
	reg.MustRegister(other)
	require.NoError(t, sqlDB.Close()) // the Admin's database gone
	families, err := reg.Gather()
	require.NoError(t, err, "a failed slot read fails no scrape")
	var names []string
	for _, f := range families {
		names = append(names, f.GetName())
	}
	require.Equal(t, []string{"process_own_total"}, names, "the slot's series are absent, the others stand")
}

// TestAdminCollectorWithoutReader: the Admin's collector, in a process
// that runs no reader, exports the WAL the slot retains and its state
// while no reader runs anywhere (what wal-alerts.yml reads), whether a
// reader holds the lease, and the lag in time the reader holding it
// records. The slot retains WAL that no outbox message is in: the
// server's whole WAL from the slot's confirmed position.
func TestAdminCollectorWithoutReader(t *testing.T) {
	e := setup(t)
	pub, blocked := e.downablePub()
	r := e.reader(t, pub, "reader-a") // the slot exists; no reader has run
	admin := e.otherProcessAdmin(t, r)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(admin.Collector())
	outboxName := e.plugin.Config().Name
	series := func(name string) map[string]float64 { return promtest.Series(t, reg, name, outboxName) }
	slot := "slot=" + r.Config().Slot

	retained := series(pgwal.NameRetainedBytes)[slot]
	require.Equal(t, map[string]float64{slot: 0}, series(pgwal.NameSlotLost))
	require.Equal(t, map[string]float64{slot: 0}, series(pgwal.NameLeaseHeld), "no reader holds the lease")
	require.Empty(t, series(pgwal.NameLagAge), "no reader: the lag is unknown, not 0")

	// WAL written by no outbox message: the slot retains it too.
	require.NoError(t, e.db.Exec("CREATE TABLE walfill AS SELECT g, repeat('x', 100) AS pad FROM generate_series(1, 20000) g").Error)
	t.Cleanup(func() { _ = e.db.Exec("DROP TABLE IF EXISTS walfill").Error })
	grown := series(pgwal.NameRetainedBytes)[slot]
	require.Greater(t, grown, retained+1e6, "retained WAL grows with the server's writes, not only the outbox's")

	// A reader in another process holds the lease, its broker down.
	blocked.Store(true)
	stop := run(r)
	e.write(t, 1, 0, 2)
	require.Eventually(t, func() bool { return series(pgwal.NameLeaseHeld)[slot] == 1 }, 30*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return series(pgwal.NameLagAge)[slot] >= 0.3 }, 30*time.Second, 10*time.Millisecond,
		"the held messages' age, from the lease: %v", series(pgwal.NameLagAge))
	blocked.Store(false)
	e.checkDelivered(t, 1, 2)
	require.Eventually(t, func() bool {
		lag, ok := series(pgwal.NameLagAge)[slot]
		return ok && lag == 0
	}, 30*time.Second, 10*time.Millisecond, "caught up")
	require.NoError(t, stop())
	require.Eventually(t, func() bool { return series(pgwal.NameLeaseHeld)[slot] == 0 }, 30*time.Second, 10*time.Millisecond,
		"the lease lapsed: no reader")
	require.Empty(t, series(pgwal.NameLagAge))

	// A reader's Admin leaves the slot's gauges to the reader's
	// Collector: both register in one registry.
	ra, err := r.Admin(e.plugin)
	require.NoError(t, err)
	one := prometheus.NewPedanticRegistry()
	require.NoError(t, one.Register(r.Collector()))
	require.NoError(t, one.Register(ra.Collector()))
	_, err = one.Gather()
	require.NoError(t, err)
}

// TestReaderBacklogMetrics: a metrics.Collector as the reader's Observer
// reports WAL mode's backlog as table mode's (so alerts.yml's age and
// sample alerts read it): available while the reader reads, the held
// messages and the oldest one's age while the broker is down, 0 once
// published, and unavailable once the reader stopped.
func TestReaderBacklogMetrics(t *testing.T) {
	e := setup(t)
	pub, blocked := e.downablePub()
	name := e.plugin.Config().Name
	mc, err := metrics.New(metrics.Config{Outbox: name, SampleInterval: 50 * time.Millisecond})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(mc)
	series := func(n string) map[string]float64 { return promtest.Series(t, reg, n, name) }
	r := e.reader(t, pub, "reader-a", func(c *pgwal.Config) { c.Observer = mc })
	require.Equal(t, map[string]float64{"": 0}, series(metrics.NamePendingAvailable), "not reading yet")

	blocked.Store(true)
	stop := run(r)
	e.write(t, 2, 0, 3) // 6 messages
	require.Eventually(t, func() bool {
		return series(metrics.NamePendingAvailable)[""] == 1 && series(metrics.NamePending)[""] == 6 &&
			series(metrics.NamePendingOldestAge)[""] >= 0.3
	}, 30*time.Second, 10*time.Millisecond, "the held messages and their age: %v %v", series(metrics.NamePending), series(metrics.NamePendingOldestAge))
	require.Equal(t, map[string]float64{"": 0}, series(metrics.NameDeadLetters))

	blocked.Store(false)
	e.checkDelivered(t, 2, 3)
	require.Eventually(t, func() bool {
		age, ok := series(metrics.NamePendingOldestAge)[""]
		return ok && age == 0 && series(metrics.NamePending)[""] == 0
	}, 30*time.Second, 10*time.Millisecond, "published: nothing pending")
	require.NoError(t, stop())
	require.Equal(t, map[string]float64{"": 0}, series(metrics.NamePendingAvailable), "a stopped reader vouches for no sample")
	require.Empty(t, series(metrics.NamePendingOldestAge))
}
