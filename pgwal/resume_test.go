package pgwal_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/tcpgate"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// backoffFloor is the least a reader's backoff after its n-th
// consecutive failure lasts: half its cap, lo doubled n-1 times and at
// most hi (internal/backoff.Exponential's jitter keeps the upper half).
func backoffFloor(lo, hi time.Duration, n int) time.Duration {
	d := lo
	for i := 1; i < n && d < hi; i++ {
		d *= 2
	}
	return min(d, hi) / 2
}

// The reader's records of a failed attempt and of an outage's end.
const (
	logFailed   = "pgwal: reading the slot failed, retrying"
	logAnswered = "pgwal: the database answers again; retrying now"
)

// TestReaderResumesWhenDatabaseAnswers: the database is unreachable (its
// connections cut, new ones closed at once) until the reader's backoff
// reaches BackoffMax; once it answers again the reader reads at once
// instead of sleeping out its backoff. Ordering, from timestamps of this
// run: the messages written meanwhile are published before the earliest
// moment the backoff after the last failed attempt would have ended.
// The outage is logged as it ends, once.
func TestReaderResumesWhenDatabaseAnswers(t *testing.T) {
	e := setup(t)
	const lo, hi = 20 * time.Millisecond, 4 * time.Second
	g, r, logs := e.gatedReader(t, lo, hi)
	stop := run(r)
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)
	outage := func() (slog.Record, int) { return waitOutage(t, logs, lo, hi) }

	g.Shut()
	last, lastN := outage()
	e.write(t, 2, 10, 20) // directly, not through the gate
	g.Open()
	answered := time.Now()
	require.Eventually(t, func() bool { return r.Stats().Published >= 40 }, time.Minute, time.Millisecond)
	published := time.Now()
	wouldRetry := last.Time.Add(backoffFloor(lo, hi, lastN))
	t.Logf("attempt %d failed %s before the database answered again; published %s after that; the backoff would have ended %s after it at the earliest",
		lastN, answered.Sub(last.Time), published.Sub(answered), wouldRetry.Sub(answered))
	require.True(t, published.Before(wouldRetry),
		"published %s after the database answered, before the backoff of attempt %d (at least %s) would have ended, %s after it",
		published.Sub(answered), lastN, backoffFloor(lo, hi, lastN), wouldRetry.Sub(answered))
	e.checkDelivered(t, 2, 20)
	var ends int
	for len(logs) > 0 {
		if (<-logs).Message == logAnswered {
			ends++
		}
	}
	require.Equal(t, 1, ends, "the outage's end is logged once")

	// Stopping while the reader waits out a long backoff returns before
	// the backoff would have ended.
	g.Shut()
	last, lastN = outage()
	require.NoError(t, stop())
	require.True(t, time.Now().Before(last.Time.Add(backoffFloor(lo, hi, lastN))), "Run returned before the backoff of attempt %d ended", lastN)
}

// gatedReader returns a reader whose connections, the session's and the
// replication ones, all go through a gate in front of the WAL-mode
// server, with BackoffMin lo and BackoffMax hi, and the records of its
// failed attempts and of an outage's end.
func (e *env) gatedReader(t *testing.T, lo, hi time.Duration) (*tcpgate.Gate, *pgwal.Reader, <-chan slog.Record) {
	t.Helper()
	e.reader(t, e.pub, "setup") // the slot, dropped at the end
	pc, err := pgconn.ParseConfig(dbtest.PostgresWALDSN())
	require.NoError(t, err)
	g := tcpgate.Start(t, net.JoinHostPort(pc.Host, strconv.Itoa(int(pc.Port))))
	g.Open()
	via := g.Via()
	db, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN+via, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	log, logs := dbtest.WatchLog(t, logFailed, logAnswered)
	r, err := pgwal.New(db, e.plugin, e.pub, pgwal.Config{
		ReplicationDSN: dbtest.PostgresWALDSN() + via, RelayID: "behind-the-gate",
		LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BackoffMin: lo, BackoffMax: hi, Logger: log,
	})
	require.NoError(t, err)
	return g, r, logs
}

// waitOutage waits for the failed attempt after which the backoff lasts
// at least hi/2, and returns its record and number.
func waitOutage(t *testing.T, logs <-chan slog.Record, lo, hi time.Duration) (slog.Record, int) {
	t.Helper()
	var last slog.Record
	n := 0
	for backoffFloor(lo, hi, n) < hi/2 {
		select {
		case last = <-logs:
			require.Equal(t, logFailed, last.Message, "no outage's end while the database is unreachable")
			v, _ := dbtest.Attr(last, "attempt")
			n = int(v.Int64())
		case <-time.After(time.Minute):
			t.Fatalf("no failed attempt logged for a minute while the database was unreachable (last: %d)", n)
		}
	}
	return last, n
}

// TestReaderProbesAtLeastProbeIntervalMinApart: with a BackoffMin of 1ms
// the reader probes an unreachable database every ProbeIntervalMin, not
// every millisecond. The gate counts the connections it refused during
// the outage: a failed attempt or a probe opens at most dialsPer of
// them, so over an outage of elapsed time E with n failed attempts they
// are at most dialsPer × (E/ProbeIntervalMin + n + 1); at a probe every
// millisecond they would be about E/1ms. Once the gate opens the
// messages written meanwhile are published.
func TestReaderProbesAtLeastProbeIntervalMinApart(t *testing.T) {
	e := setup(t)
	const lo, hi = time.Millisecond, 2 * time.Second
	g, r, logs := e.gatedReader(t, lo, hi)
	stop := run(r)
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)

	g.Shut()
	before, began := g.Refused(), time.Now()
	_, lastN := waitOutage(t, logs, lo, hi)
	refused, elapsed := g.Refused()-before, time.Since(began)
	const dialsPer = 4
	bound := dialsPer * (int64(elapsed/pgwal.ProbeIntervalMin) + int64(lastN) + 1)
	t.Logf("%d connections refused in %s of outage over %d failed attempts (at most %d with probes %s apart)",
		refused, elapsed.Round(time.Millisecond), lastN, bound, pgwal.ProbeIntervalMin)
	require.Positive(t, refused)
	require.LessOrEqual(t, refused, bound, "probes at least %s apart", pgwal.ProbeIntervalMin)

	e.write(t, 2, 10, 20)
	g.Open()
	e.checkDelivered(t, 2, 20)
	require.NoError(t, stop())
}

// netDown is the error a dial to brokers that are down returns.
var netDown = &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}

// failingFence is a publisher whose LeasesAcquired fails with a network
// error, as a strict-mode publisher's fencing does while the brokers are
// down, the first fails times; it records when each call came.
type failingFence struct {
	relay.Publisher
	fails int
	mu    sync.Mutex
	calls []time.Time
}

func (f *failingFence) LeasesAcquired(context.Context, []relay.Lease) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, time.Now())
	if len(f.calls) <= f.fails {
		return netDown
	}
	return nil
}

func (f *failingFence) LeasesReleased(context.Context, []relay.Lease) {}

// TestReaderPublisherOutageKeepsBackoff: a term that fails because the
// publisher cannot reach the brokers, while the database answers, is
// retried after the plain backoff: the probe that cuts a database
// outage short does not see the brokers, and must not make the reader
// retry every BackoffMin.
func TestReaderPublisherOutageKeepsBackoff(t *testing.T) {
	e := setup(t)
	const lo, hi, fails = 20 * time.Millisecond, time.Second, 7
	f := &failingFence{Publisher: e.pub, fails: fails}
	r := e.reader(t, f, "fence", func(c *pgwal.Config) { c.BackoffMin, c.BackoffMax = lo, hi })
	stop := run(r)
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)
	f.mu.Lock()
	calls := append([]time.Time(nil), f.calls...)
	f.mu.Unlock()
	require.Greater(t, len(calls), fails)
	for n := 1; n <= fails; n++ {
		require.GreaterOrEqual(t, calls[n].Sub(calls[n-1]), backoffFloor(lo, hi, n),
			"the term after failure %d began after at least its backoff", n)
	}
	require.NoError(t, stop())
}
