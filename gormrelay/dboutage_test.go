package gormrelay_test

import (
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

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/internal/tcpgate"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// The relay's records of a failed acquisition, of a bucket's failed
// read, and of an outage's end.
const (
	logAcquireFailed = "relay: acquire leases failed"
	logReadFailed    = "relay: read batch failed"
	logAnswered      = "relay: the store answers again; retrying now"
)

// gatedOutbox is a relay whose connections to PostgreSQL go through a
// gate, publishing to kfake, and the outbox it drains, read and written
// directly, not through the gate.
type gatedOutbox struct {
	*storeBundle
	gate      *tcpgate.Gate
	cluster   *kafkatest.Cluster
	topic     string
	logs      <-chan slog.Record
	publishes *publishTimes
}

// publishTimes records when each publish began, by bucket.
type publishTimes struct {
	relay.NopObserver
	mu    sync.Mutex
	began map[int][]time.Time
}

func (p *publishTimes) Published(e relay.PublishEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.began[e.Bucket] = append(p.began[e.Bucket], time.Now().Add(-e.Duration))
}

// first returns the first publish of bucket (any bucket if -1) that
// began after t, and whether there is one.
func (p *publishTimes) first(bucket int, t time.Time) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var first time.Time
	for b, ts := range p.began {
		if bucket >= 0 && b != bucket {
			continue
		}
		for _, x := range ts {
			if x.After(t) && (first.IsZero() || x.Before(first)) {
				first = x
			}
		}
	}
	return first, !first.IsZero()
}

// startGatedRelay starts a relay on PostgreSQL behind an open gate with
// BackoffMin lo and BackoffMax hi, leases of leaseDuration renewed every
// 200ms, watching the records above.
func startGatedRelay(t *testing.T, lo, hi, leaseDuration time.Duration) *gatedOutbox {
	t.Helper()
	db := dbtest.Open(t, dbtest.Postgres)
	o := &gatedOutbox{storeBundle: newStoreBundle(t, db, outbox.Config{})}
	pc, err := pgconn.ParseConfig(dbtest.PostgresDSN())
	require.NoError(t, err)
	o.gate = tcpgate.Start(t, net.JoinHostPort(pc.Host, strconv.Itoa(int(pc.Port))))
	o.gate.Open()
	gated, err := dbtest.OpenGorm(dbtest.Postgres, db.DSN+o.gate.Via(), &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := gated.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	store, err := gormrelay.NewStore(gated, o.cfg)
	require.NoError(t, err)

	o.cluster = kafkatest.Start(t)
	o.topic = o.cluster.Topic(t, 3)
	k := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: o.cluster.Brokers(), Logger: dbtest.Logger(t)})
	var log *slog.Logger
	log, o.logs = dbtest.WatchLog(t, logAcquireFailed, logReadFailed, logAnswered)
	cfg := o.relayConfig(t, "behind-the-gate")
	cfg.LeaseDuration, cfg.LeaseRenewInterval = leaseDuration, 200*time.Millisecond
	cfg.BackoffMin, cfg.BackoffMax, cfg.Logger = lo, hi, log
	o.publishes = &publishTimes{began: map[int][]time.Time{}}
	cfg.Observer = o.publishes
	startRelay(t, store, k, cfg)
	return o
}

// rows returns messages from to to-1 over 12 keys.
func (o *gatedOutbox) rows(from, to int) []outbox.MessageRow {
	var out []outbox.MessageRow
	for i := from; i < to; i++ {
		out = append(out, outbox.MessageRow{Topic: o.topic, Key: []byte("key-" + strconv.Itoa(i%12)), Value: []byte(strconv.Itoa(i))})
	}
	return out
}

// reopen opens the gate and requires the first publish of bucket (of
// any bucket if -1) after it to begin before wouldRetry, the earliest
// moment the backoff the relay was in would have ended; then that the
// outbox drains, the outage's end was logged once, and every message
// reached the topic.
func (o *gatedOutbox) reopen(t *testing.T, what string, wouldRetry time.Time, bucket, want int) {
	t.Helper()
	o.gate.Open()
	answered := time.Now()
	var first time.Time
	require.Eventually(t, func() bool {
		var ok bool
		first, ok = o.publishes.first(bucket, answered)
		return ok
	}, time.Minute, time.Millisecond)
	t.Logf("published %s after the database answered again; %s would have ended %s after it",
		first.Sub(answered), what, wouldRetry.Sub(answered))
	require.True(t, first.Before(wouldRetry), "published %s after the database answered, before %s would have ended, %s after it",
		first.Sub(answered), what, wouldRetry.Sub(answered))
	o.requireDrained(t)
	ends := 0
	for len(o.logs) > 0 {
		if (<-o.logs).Message == logAnswered {
			ends++
		}
	}
	require.Equal(t, 1, ends, "the outage's end is logged once")
	require.GreaterOrEqual(t, len(o.cluster.ReadAll(t, o.topic, want, 30*time.Second)), want)
}

// nextRecord returns the next watched record, failing the test after a
// minute without one, or on an outage's end while the gate is shut.
func (o *gatedOutbox) nextRecord(t *testing.T) slog.Record {
	t.Helper()
	select {
	case rec := <-o.logs:
		require.NotEqual(t, logAnswered, rec.Message, "no outage's end while the database is unreachable")
		return rec
	case <-time.After(time.Minute):
		t.Fatal("nothing logged for a minute while the database was unreachable")
		return slog.Record{}
	}
}

// TestRelayResumesWhenDatabaseAnswers: the relay's connections to
// PostgreSQL are cut (new ones closed at once) until the backoff of its
// acquisition reaches BackoffMax, long after its leases' trust window
// ended; once the database answers again the relay drains at once
// instead of sleeping out that backoff. Ordering, from timestamps of this
// run: the first publish after the database answered, of the messages
// written meanwhile, begins before the moment the backoff after the last
// failed acquisition would have ended.
func TestRelayResumesWhenDatabaseAnswers(t *testing.T) {
	t.Parallel()
	const lo, hi = 20 * time.Millisecond, 4 * time.Second
	o := startGatedRelay(t, lo, hi, 1500*time.Millisecond)
	o.insert(t, o.rows(0, 20)...)
	o.requireDrained(t)

	o.gate.Shut()
	var last slog.Record
	var retryIn time.Duration
	for retryIn < hi/2 {
		if last = o.nextRecord(t); last.Message == logAcquireFailed {
			v, ok := dbtest.Attr(last, "retry_in")
			require.True(t, ok)
			retryIn = v.Duration()
		}
	}
	o.insert(t, o.rows(20, 60)...)
	o.reopen(t, "the backoff of the last failed acquisition ("+retryIn.String()+")", last.Time.Add(retryIn), -1, 60)
}

// TestRelayRetriesBucketsWhenDatabaseAnswers: the connections are cut
// while the relay drains a backlog under leases it keeps trusting; the
// buckets whose reads fail back off, until one has failed so often that
// its backoff lasts at least BackoffMax/2. Once the database answers
// again that bucket is published at once, not after its backoff.
func TestRelayRetriesBucketsWhenDatabaseAnswers(t *testing.T) {
	t.Parallel()
	const lo, hi = 20 * time.Millisecond, 4 * time.Second
	o := startGatedRelay(t, lo, hi, time.Minute)
	const n = 3000
	o.insert(t, o.rows(0, n)...)
	require.Eventually(t, func() bool { return o.count(t) < n }, time.Minute, time.Millisecond, "the drain began")

	o.gate.Shut()
	failures := map[int]int{}
	var last slog.Record
	var lastN, bucket int
	for backoffFloor(lo, hi, lastN) < hi/2 {
		rec := o.nextRecord(t)
		if rec.Message != logReadFailed {
			continue
		}
		v, ok := dbtest.Attr(rec, "bucket")
		require.True(t, ok)
		bucket = int(v.Int64())
		failures[bucket]++
		last, lastN = rec, failures[bucket]
	}
	o.reopen(t, "the backoff of bucket "+strconv.Itoa(bucket)+"'s failure "+strconv.Itoa(lastN), last.Time.Add(backoffFloor(lo, hi, lastN)), bucket, n)
}

// backoffFloor is the least the backoff after the n-th consecutive
// failure lasts: half its cap, lo doubled n-1 times and at most hi
// (internal/backoff.Exponential's jitter keeps the upper half).
func backoffFloor(lo, hi time.Duration, n int) time.Duration {
	d := lo
	for i := 1; i < n && d < hi; i++ {
		d *= 2
	}
	return min(d, hi) / 2
}
