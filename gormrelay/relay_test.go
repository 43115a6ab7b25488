package gormrelay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// fastConfig is a relay configuration with short timings for tests. Its
// lease (2 s) is short enough that a takeover test waits little for a dead
// relay's buckets, and long enough that a busy machine's stalls do not
// lapse a live relay's lease.
func fastConfig(t testing.TB, id string) relay.Config {
	return relay.Config{
		RelayID:            id,
		BatchSize:          20,
		PollInterval:       50 * time.Millisecond,
		LeaseDuration:      2 * time.Second,
		LeaseRenewInterval: 200 * time.Millisecond,
		BackoffMin:         10 * time.Millisecond,
		BackoffMax:         100 * time.Millisecond,
		Logger:             dbtest.Logger(t),
	}
}

// startRelay starts a relay that the test stops when it ends.
func startRelay(t *testing.T, store relay.Store, pub relay.Publisher, cfg relay.Config) *relay.Relay {
	t.Helper()
	r, err := relay.New(store, pub, cfg)
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		assert.NoError(t, r.Stop(ctx))
	})
	return r
}

// call is one Publish call as the recording publisher saw it.
type call struct {
	relay  string
	bucket int
	msgs   []relay.Message // what was handed over
	acked  int
	err    error
	start  time.Time
}

// recorder is a function publisher shared by several relays. It records
// every call and flags two relays publishing one bucket at the same time.
type recorder struct {
	mu       sync.Mutex
	calls    []call
	inflight map[int]string
	overlaps []string
}

func newRecorder() *recorder { return &recorder{inflight: map[int]string{}} }

// publisher returns relayID's publisher. hook, if set, decides the result;
// by default everything is acknowledged.
func (r *recorder) publisher(relayID string, hook func(ctx context.Context, msgs []relay.Message) (int, error)) relay.Publisher {
	return relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		b := msgs[0].Bucket
		start := time.Now()
		r.mu.Lock()
		for _, m := range msgs {
			if m.Bucket != b {
				r.overlaps = append(r.overlaps, fmt.Sprintf("batch mixes buckets %d and %d", b, m.Bucket))
			}
		}
		if other, busy := r.inflight[b]; busy {
			r.overlaps = append(r.overlaps, fmt.Sprintf("bucket %d published by %s while %s was publishing it", b, relayID, other))
		}
		r.inflight[b] = relayID
		r.mu.Unlock()

		acked, err := len(msgs), error(nil)
		if hook != nil {
			acked, err = hook(ctx, msgs)
		}

		r.mu.Lock()
		if r.inflight[b] == relayID {
			delete(r.inflight, b)
		}
		r.calls = append(r.calls, call{relay: relayID, bucket: b, msgs: slices.Clone(msgs), acked: acked, err: err, start: start})
		r.mu.Unlock()
		return acked, err
	})
}

func (r *recorder) snapshot() []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// acked returns every acknowledged message in acknowledgement order.
func (r *recorder) acked() []relay.Message {
	var out []relay.Message
	for _, c := range r.snapshot() {
		out = append(out, c.msgs[:max(0, min(c.acked, len(c.msgs)))]...)
	}
	return out
}

// ackedIDs is the set of acknowledged message ids.
func (r *recorder) ackedIDs() map[string]int {
	set := map[string]int{}
	for _, m := range r.acked() {
		set[m.MessageID]++
	}
	return set
}

func (r *recorder) requireNoOverlap(t testing.TB) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.Empty(t, r.overlaps)
}

// deliverWithin bounds every wait of these tests for a condition that
// must come (delivery, a drain, a lease split, a metric): a deadline
// against a hung test, not a speed check: on a busy machine the databases stall for
// seconds at a time (a 10 s bound failed that way under the loaded-CI
// script, with every relay healthy), and a takeover waits out a lease.
const deliverWithin = time.Minute

// requireAllDelivered waits until the table is empty and every row was
// acknowledged at least once; on failure it says how many were not.
func requireAllDelivered(t testing.TB, b *storeBundle, rec *recorder, rows []outbox.MessageRow) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Zero(c, b.count(c), "rows left in the outbox table")
		got := rec.ackedIDs()
		missing := 0
		for _, r := range rows {
			if got[r.MessageID] == 0 {
				missing++
			}
		}
		assert.Zero(c, missing, "rows never acknowledged, of %d", len(rows))
	}, deliverWithin, 10*time.Millisecond)
}

// requireOrdered checks that within each key, and within each bucket, the
// first deliveries came in submission order.
func requireOrdered(t testing.TB, msgs []relay.Message) {
	t.Helper()
	seen := map[string]bool{}
	lastSeq := map[string]int{}
	lastID := map[int]int64{}
	for _, m := range msgs {
		if seen[m.MessageID] {
			continue // a duplicate after a failure or takeover
		}
		seen[m.MessageID] = true
		key, seqText, ok := strings.Cut(string(m.Value), "/")
		require.True(t, ok, "value %q", m.Value)
		var seq int
		_, err := fmt.Sscan(seqText, &seq)
		require.NoError(t, err)
		if last, ok := lastSeq[key]; ok {
			require.Equal(t, last+1, seq, "key %s out of order", key)
		} else {
			require.Equal(t, 0, seq, "key %s starts at %d", key, seq)
		}
		lastSeq[key] = seq
		require.Greater(t, m.ID, lastID[m.Bucket], "bucket %d out of order", m.Bucket)
		lastID[m.Bucket] = m.ID
	}
}

func TestRelayOrder(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		rows := b.insert(t, keyed(keysN(20), 15)...)
		rec := newRecorder()
		cfg := fastConfig(t, "a")
		cfg.BatchSize = 7 // many full and partial batches
		startRelay(t, b.store, rec.publisher("a", nil), cfg)

		requireAllDelivered(t, b, rec, rows)
		got := rec.acked()
		require.Len(t, got, len(rows), "no failures, so no duplicates")
		requireOrdered(t, got)
		for _, c := range rec.snapshot() {
			require.LessOrEqual(t, len(c.msgs), 7)
		}
	})
}

// A publisher that acknowledges 2 of 5 and fails: exactly those 2 are
// deleted, the attempt is recorded on the third, and the rest is published
// again in order.
func TestRelayPartialFailure(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{})
		rows := b.insert(t, keyed([]string{"order-1"}, 5)...)
		bucket := int(rows[0].Bucket)
		ids := b.ids(t, bucket)
		require.Len(t, ids, 5)

		rec := newRecorder()
		boom := errors.New("broker unavailable")
		failing := rec.publisher("a", func(_ context.Context, msgs []relay.Message) (int, error) {
			return 2, boom
		})
		var failures []relay.Failure
		cfg := fastConfig(t, "a")
		cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
			failures = append(failures, f)
			return relay.FailureBackoff, nil
		})
		r, err := relay.New(b.store, failing, cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(ctx)
		require.ErrorIs(t, err, boom)
		require.Equal(t, 2, n)
		require.Equal(t, ids[2:], b.ids(t, bucket), "only the acknowledged prefix is deleted")

		require.Len(t, failures, 1)
		require.Equal(t, ids[2], failures[0].Message.ID)
		require.Equal(t, 1, failures[0].Message.Attempts)
		require.Equal(t, 2, failures[0].Acked)
		require.ErrorIs(t, failures[0].Err, boom)
		var third outbox.MessageRow
		require.NoError(t, b.messages().Where("id = ?", ids[2]).Take(&third).Error)
		require.EqualValues(t, 1, third.Attempts)
		require.Contains(t, *third.LastError, "broker unavailable")

		// A running relay retries from the first unacknowledged message.
		var calls atomic.Int32
		flaky := rec.publisher("b", func(_ context.Context, msgs []relay.Message) (int, error) {
			if calls.Add(1) == 1 {
				return 1, boom
			}
			return len(msgs), nil
		})
		startRelay(t, b.store, flaky, fastConfig(t, "b"))
		b.requireDrained(t)

		var sent [][]int64
		for _, c := range rec.snapshot() {
			var s []int64
			for _, m := range c.msgs {
				s = append(s, m.ID)
			}
			sent = append(sent, s)
		}
		require.Equal(t, [][]int64{ids, ids[2:], ids[3:]}, sent)
		requireOrdered(t, rec.acked())
	})
}

// Three relays share one outbox: each takes its fair share, every bucket
// is covered, and no bucket is ever published by two relays at once.
func TestRelayFairShareThreeRelays(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		rec := newRecorder()
		var relays []*relay.Relay
		for _, id := range []string{"r1", "r2", "r3"} {
			cfg := fastConfig(t, id)
			// Generous leases: this test is about sharing, not expiry.
			cfg.LeaseDuration = 3 * time.Second
			cfg.LeaseRenewInterval = 100 * time.Millisecond
			relays = append(relays, startRelay(t, b.store, rec.publisher(id, nil), cfg))
		}

		require.Eventually(t, func() bool {
			owner := map[int]string{}
			for _, r := range relays {
				ls := r.Leases()
				if len(ls) < 2 || len(ls) > 3 {
					return false
				}
				for _, l := range ls {
					if _, dup := owner[l.Bucket]; dup {
						return false
					}
					owner[l.Bucket] = r.ID()
				}
			}
			return len(owner) == 8
		}, deliverWithin, 10*time.Millisecond)
		owners := map[string]int{}
		for _, l := range b.leaseRows(t) {
			require.NotNil(t, l.Owner)
			owners[*l.Owner]++
		}
		require.Len(t, owners, 3)

		rows := b.insert(t, keyed(keysN(40), 10)...)
		requireAllDelivered(t, b, rec, rows)
		rec.requireNoOverlap(t)
		requireOrdered(t, rec.acked())
		published := map[string]bool{}
		for _, c := range rec.snapshot() {
			published[c.relay] = true
		}
		require.Len(t, published, 3, "every relay drained its share")
	})
}

// crashStore simulates a relay process that died: once dead, every store
// call fails, so the relay can neither publish, renew nor release.
type crashStore struct {
	*gormrelay.Store
	dead atomic.Bool
}

var errCrashed = errors.New("relay process crashed")

func (c *crashStore) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	if c.dead.Load() {
		return relay.Acquired{}, errCrashed
	}
	return c.Store.AcquireLeases(ctx, req)
}

func (c *crashStore) RenewLeases(ctx context.Context, id string, ls []relay.Lease, d time.Duration) ([]relay.Lease, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.Store.RenewLeases(ctx, id, ls, d)
}

func (c *crashStore) ReleaseLeases(ctx context.Context, id string, ls []relay.Lease) error {
	if c.dead.Load() {
		return errCrashed
	}
	return c.Store.ReleaseLeases(ctx, id, ls)
}

func (c *crashStore) PendingBuckets(ctx context.Context, bs []int) ([]int, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.Store.PendingBuckets(ctx, bs)
}

func (c *crashStore) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	if c.dead.Load() {
		return nil, errCrashed
	}
	return c.Store.NextBatch(ctx, bucket, limit)
}

func (c *crashStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	if c.dead.Load() {
		return errCrashed
	}
	return c.Store.MarkPublished(ctx, id, l, msgs)
}

func (c *crashStore) RecordFailure(ctx context.Context, id string, l relay.Lease, m relay.Message, cause error) error {
	if c.dead.Load() {
		return errCrashed
	}
	return c.Store.RecordFailure(ctx, id, l, m, cause)
}

// A relay that dies without releasing its leases: a peer takes its buckets
// over once the leases expire, and nothing is lost.
func TestRelayTakeoverAfterCrash(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		rows := b.insert(t, keyed(keysN(30), 10)...)
		rec := newRecorder()

		crash := &crashStore{Store: b.store}
		a, err := relay.New(crash, rec.publisher("a", nil), fastConfig(t, "a"))
		require.NoError(t, err)
		require.NoError(t, a.Start(context.Background()))
		require.Eventually(t, func() bool { return len(rec.snapshot()) >= 2 }, deliverWithin, 5*time.Millisecond)

		crash.dead.Store(true)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, a.Stop(ctx)) // its release fails: the leases stay
		expiry := map[int]int64{}
		for _, l := range b.leaseRows(t) {
			require.Equal(t, "a", *l.Owner, "the dead relay still owns bucket %d", l.Bucket)
			expiry[int(l.Bucket)] = l.ExpiresAtMs
		}
		before := len(rec.snapshot())

		startRelay(t, b.store, rec.publisher("b", nil), fastConfig(t, "b"))
		requireAllDelivered(t, b, rec, rows)
		for _, c := range rec.snapshot()[before:] {
			require.Equal(t, "b", c.relay)
			require.GreaterOrEqual(t, c.start.UnixMilli(), expiry[c.bucket], "bucket %d taken over before its lease expired", c.bucket)
		}
		// A bucket the dead relay had drained has nothing to deliver: b
		// takes it over at an acquisition after its lease expired, which
		// can come after the last delivery.
		require.Eventually(t, func() bool {
			for _, l := range b.leaseRows(t) {
				if l.Owner == nil || *l.Owner != "b" || l.Term < 2 {
					return false
				}
			}
			return true
		}, deliverWithin, 10*time.Millisecond, "b owns every bucket under a new term")
		rec.requireNoOverlap(t)
		requireOrdered(t, rec.acked())
	})
}

// Stop releases the leases: a peer owns every bucket at its next
// acquisition, long before the leases would have expired.
func TestRelayGracefulStopHandsOver(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		rec := newRecorder()
		long := func(id string) relay.Config {
			cfg := fastConfig(t, id)
			cfg.LeaseDuration = 30 * time.Second
			cfg.LeaseRenewInterval = 100 * time.Millisecond
			return cfg
		}
		a, err := relay.New(b.store, rec.publisher("a", nil), long("a"))
		require.NoError(t, err)
		require.NoError(t, a.Start(context.Background()))
		r2 := startRelay(t, b.store, rec.publisher("b", nil), long("b"))
		require.Eventually(t, func() bool { return len(a.Leases()) == 4 && len(r2.Leases()) == 4 }, deliverWithin, 10*time.Millisecond)

		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stopped := time.Now()
		require.NoError(t, a.Stop(ctx))
		require.NoError(t, a.Stop(ctx), "a second Stop is a no-op")
		require.NoError(t, a.Err())
		require.Empty(t, a.Leases())
		select {
		case <-a.Stopped():
		default:
			t.Fatal("Stopped not closed after Stop returned")
		}
		var relaysLeft []string
		require.NoError(t, db.DB.Table(b.cfg.Tables.RelaysTable()).Pluck("relay_id", &relaysLeft).Error)
		require.Equal(t, []string{"b"}, relaysLeft, "the stopped relay's heartbeat is gone")

		// Well inside the 30s leases: handed over without waiting for
		// them to expire.
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, r2.Leases(), 8) }, deliverWithin, 5*time.Millisecond)
		t.Logf("handed over %s after Stop", time.Since(stopped).Round(time.Millisecond))
		require.ErrorIs(t, a.Start(context.Background()), relay.ErrStopped)

		rows := b.insert(t, keyed(keysN(10), 3)...)
		requireAllDelivered(t, b, rec, rows)
	})
}

// A publish that takes three lease durations keeps its lease through
// renewal, and no other relay publishes the bucket meanwhile.
func TestRelayRenewsDuringSlowPublish(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		rec := newRecorder()
		cfgFor := func(id string) relay.Config {
			cfg := fastConfig(t, id)
			cfg.LeaseDuration = 2 * time.Second
			cfg.LeaseRenewInterval = 150 * time.Millisecond
			return cfg
		}
		const block = 3 * 2 * time.Second
		started, finished := make(chan struct{}), make(chan error, 2)
		var once sync.Once
		slow := rec.publisher("a", func(ctx context.Context, msgs []relay.Message) (int, error) {
			if string(msgs[0].Value) != "slow/0" {
				return len(msgs), nil
			}
			// A publish cancelled anyway is retried: the test then fails
			// on the first result, not on a second close.
			once.Do(func() { close(started) })
			select {
			case <-time.After(block): // the sink is slow, not the test
				finished <- nil
				return len(msgs), nil
			case <-ctx.Done():
				finished <- ctx.Err()
				return 0, ctx.Err()
			}
		})
		a := startRelay(t, b.store, slow, cfgFor("a"))
		other := startRelay(t, b.store, rec.publisher("b", nil), cfgFor("b"))
		require.Eventually(t, func() bool { return len(a.Leases()) == 4 && len(other.Leases()) == 4 }, deliverWithin, 10*time.Millisecond)

		bucket := a.Leases()[0].Bucket
		key := keyInBucket(t, bucket, 8)
		b.insert(t, outbox.MessageRow{MessageID: "slow", Key: []byte(key), Value: []byte("slow/0")})
		select {
		case <-started:
		case <-time.After(5 * time.Second):
			t.Fatal("slow publish never started")
		}

		// While the publish is blocked, the lease stays with a and unexpired.
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		checks := 0
	wait:
		for {
			select {
			case err := <-finished:
				require.NoError(t, err, "the slow publish was cancelled")
				break wait
			case <-tick.C:
				var l outbox.LeaseRow
				require.NoError(t, db.DB.Table(b.cfg.Tables.LeasesTable()).Where("bucket = ?", bucket).Take(&l).Error)
				require.Equal(t, "a", *l.Owner)
				require.Greater(t, l.ExpiresAtMs, time.Now().UnixMilli(), "lease expired during the publish")
				checks++
			}
		}
		require.Greater(t, checks, 10)
		b.requireDrained(t)
		require.Equal(t, map[string]int{"slow": 1}, rec.ackedIDs(), "published once, by a")
		rec.requireNoOverlap(t)
		require.Contains(t, leaseBuckets(a.Leases()), bucket, "a kept the bucket")
	})
}

// An exact bucket hint wakes an idle relay, which would otherwise find
// the row only at its next poll. The poll is an hour away, so only the
// hint can deliver within the test; the latency is logged, not bounded
// (a busy machine stalls for seconds; speed belongs to outbox-bench).
func TestRelayHintWakeUp(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		key := keyInBucket(t, 2, 8)
		b.insert(t, outbox.MessageRow{MessageID: "first", Key: []byte(key), Value: []byte("k/0")})

		delivered := make(chan time.Time, 10)
		rec := newRecorder()
		pub := rec.publisher("a", func(_ context.Context, msgs []relay.Message) (int, error) {
			delivered <- time.Now()
			return len(msgs), nil
		})
		notifier := outbox.NewNotifier(8)
		cfg := fastConfig(t, "a")
		cfg.PollInterval = time.Hour
		cfg.LeaseDuration = 10 * time.Second
		cfg.LeaseRenewInterval = time.Second
		cfg.Hints = notifier
		startRelay(t, b.store, pub, cfg)

		// The first message is found at start; afterwards the bucket is
		// known to be empty and only a poll or a hint finds new rows.
		select {
		case <-delivered:
		case <-time.After(deliverWithin):
			t.Fatal("pre-existing message not delivered")
		}
		b.insert(t, outbox.MessageRow{MessageID: "second", Key: []byte(key), Value: []byte("k/1")})
		require.Never(t, func() bool { return len(delivered) > 0 }, 300*time.Millisecond, 10*time.Millisecond,
			"delivered without a hint before the poll interval")

		notified := time.Now()
		notifier.Notify([]int{2})
		select {
		case at := <-delivered:
			t.Logf("hint to publish latency: %s (PollInterval %s)", at.Sub(notified), cfg.PollInterval)
		case <-time.After(deliverWithin):
			t.Fatal("hint did not wake the relay")
		}
		// The hook runs inside the publish; the recorder counts the
		// acknowledgement after it returns.
		require.Eventually(t, func() bool { return len(rec.acked()) == 2 }, deliverWithin, 5*time.Millisecond)
	})
}

// The write side end to end: Enqueue in a transaction, the plugin's
// notifier wakes the relay after commit.
func TestRelayWithPluginNotifier(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		p, err := outbox.NewPlugin(outbox.Config{})
		require.NoError(t, err)
		require.NoError(t, db.DB.Use(p))
		require.NoError(t, p.AutoMigrate(context.Background(), db.DB))
		store, err := gormrelay.NewStore(db.DB, p.Config())
		require.NoError(t, err)

		rec := newRecorder()
		cfg := fastConfig(t, "a")
		cfg.PollInterval = time.Hour // only the notifier can deliver in time
		cfg.LeaseDuration = 10 * time.Second
		cfg.LeaseRenewInterval = time.Second
		cfg.Hints = p.Notifier()
		r := startRelay(t, store, rec.publisher("a", nil), cfg)
		require.Eventually(t, func() bool { return len(r.Leases()) == 8 }, deliverWithin, 5*time.Millisecond)

		committed := time.Now()
		require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx,
				&outbox.Message{Topic: "orders", Key: []byte("o-1"), Value: []byte("o-1/0")},
				&outbox.Message{Topic: "orders", Key: []byte("o-1"), Value: []byte("o-1/1")},
			)
		}))
		require.Eventually(t, func() bool { return len(rec.acked()) == 2 }, deliverWithin, 2*time.Millisecond)
		t.Logf("commit to publish latency: %s", time.Since(committed))
		requireOrdered(t, rec.acked())
	})
}

func TestRelayMisconfiguration(t *testing.T) {
	t.Parallel()

	t.Run("RenewNotShorterThanDuration", func(t *testing.T) {
		t.Parallel()
		cfg := relay.Config{LeaseDuration: time.Second, LeaseRenewInterval: time.Second}
		_, err := relay.New(&gormrelay.Store{}, relay.PublisherFunc(nil), cfg)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "LeaseRenewInterval", ce.Field)
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
	})

	waitStopped := func(t *testing.T, r *relay.Relay) error {
		t.Helper()
		select {
		case <-r.Stopped():
		case <-time.After(10 * time.Second):
			t.Fatal("relay did not stop on a misconfiguration")
		}
		return r.Err()
	}

	startErr := func(t *testing.T, s relay.Store, cfg relay.Config) error {
		t.Helper()
		r, err := relay.New(s, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
			t.Error("a misconfigured relay published")
			return 0, nil
		}), cfg)
		require.NoError(t, err)
		return r.Start(context.Background())
	}

	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		// Rows in a bucket no relay can own: Start refuses, nothing is
		// published or deleted.
		b := newStoreBundle(t, db, outbox.Config{})
		b.insert(t, keyed(keysN(5), 2)...)
		b.insert(t, outbox.MessageRow{MessageID: "wide", Bucket: 8, Value: []byte("x")})
		var me *relay.MisconfigurationError
		require.ErrorAs(t, startErr(t, b.store, fastConfig(t, "a")), &me)
		require.Equal(t, "BucketCount", me.Setting)
		require.Contains(t, me.Error(), "bucket 8")
		require.EqualValues(t, 11, b.count(t))
		require.NoError(t, b.messages().Where("message_id = ?", "wide").Delete(&outbox.MessageRow{}).Error)

		// A relay configured with a different bucket count than the
		// store's outbox: New refuses it, naming both counts.
		cfg := fastConfig(t, "c")
		cfg.BucketCount = 16
		_, err := relay.New(b.store, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil }), cfg)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
		require.Equal(t, "BucketCount", ce.Field)
		require.Contains(t, err.Error(), "the relay uses 16 buckets but the store's outbox is configured with 8")
		// The same count, or none, is the store's.
		cfg.BucketCount = 0
		r0, err := relay.New(b.store, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil }), cfg)
		require.NoError(t, err)
		require.Empty(t, r0.Leases())
		// A store asked directly for another count still refuses it.
		_, err = b.store.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: "c", BucketCount: 16, LeaseDuration: time.Second})
		require.ErrorAs(t, err, &me)
		require.Equal(t, "BucketCount", me.Setting)

		// Started before AutoMigrate.
		bare, err := gormrelay.NewStore(db.DB, outbox.Config{Tables: outbox.WithPrefix("later_")})
		require.NoError(t, err)
		require.ErrorAs(t, startErr(t, bare, fastConfig(t, "d")), &me)
		require.Equal(t, "Tables", me.Setting)
		require.Contains(t, me.Error(), "p.AutoMigrate(ctx, db)")

		// A writer with a larger BucketCount after the relay started: the
		// relay notices at its next discovery poll, stops, and releases
		// its leases.
		rec := newRecorder()
		started := time.Now()
		r := startRelay(t, b.store, rec.publisher("e", nil), fastConfig(t, "e"))
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, b.count(t)) }, deliverWithin, 10*time.Millisecond)
		wrote := time.Now()
		b.insert(t, outbox.MessageRow{MessageID: "wide-later", Bucket: 8, Value: []byte("x")})
		err = waitStopped(t, r)
		require.ErrorAs(t, err, &me)
		require.Equal(t, "BucketCount", me.Setting)
		t.Logf("misconfiguration noticed %s after the write (poll interval %s; relay up for %s)",
			time.Since(wrote).Round(time.Millisecond), fastConfig(t, "e").PollInterval, wrote.Sub(started).Round(time.Millisecond))
		for _, l := range b.leaseRows(t) {
			require.Nil(t, l.Owner, "bucket %d: leases released by the stopped relay", l.Bucket)
		}
	})
}

// Two outboxes with different tables in one database run independent
// relays.
func TestRelayTwoOutboxes(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		billing := newStoreBundle(t, db, outbox.Config{Tables: outbox.WithPrefix("billing_")})
		shipping := newStoreBundle(t, db, outbox.Config{Tables: outbox.WithPrefix("shipping_"), BucketCount: 4})
		recB, recS := newRecorder(), newRecorder()
		startRelay(t, billing.store, recB.publisher("b", nil), fastConfig(t, "same-id"))
		cfgS := fastConfig(t, "same-id") // lease rows are per outbox
		cfgS.BucketCount = 4
		startRelay(t, shipping.store, recS.publisher("s", nil), cfgS)

		rowsB := billing.insert(t, keyed([]string{"invoice-1", "invoice-2"}, 5)...)
		rowsS := shipping.insert(t, keyed([]string{"parcel-1"}, 4)...)
		requireAllDelivered(t, billing, recB, rowsB)
		requireAllDelivered(t, shipping, recS, rowsS)
		require.Len(t, recB.acked(), 10)
		require.Len(t, recS.acked(), 4)
		for _, m := range recS.acked() {
			require.True(t, strings.HasPrefix(string(m.Value), "parcel-"))
		}
		requireOrdered(t, recB.acked())
		requireOrdered(t, recS.acked())
	})
}

// BenchmarkDrainPostgres measures the drain rate of one relay with a
// function publisher on PostgreSQL: 20k prefilled messages over 8 buckets,
// batches of the default size (relay.BatchSizeDefault).
//
//	go test -run '^$' -bench DrainPostgres -benchtime 5x .
func BenchmarkDrainPostgres(b *testing.B) {
	db := dbtest.Open(b, dbtest.Postgres)
	bundle := newStoreBundle(b, db, outbox.Config{})
	const n = 20_000
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
	cfg := relay.Config{RelayID: "bench", Logger: slog.New(slog.DiscardHandler)}
	payload := make([]byte, 200)
	total, elapsed := 0, time.Duration(0)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		rows := make([]outbox.MessageRow, n)
		for i := range rows {
			rows[i] = outbox.MessageRow{MessageID: fmt.Sprintf("bench-%d", i), Key: fmt.Appendf(nil, "key-%d", i%1000), Value: payload}
		}
		bundle.insert(b, rows...)
		r, err := relay.New(bundle.store, pub, cfg)
		require.NoError(b, err)
		b.StartTimer()
		start := time.Now()
		got, err := r.DrainOnce(context.Background())
		elapsed += time.Since(start)
		require.NoError(b, err)
		require.Equal(b, n, got)
		total += got
	}
	b.ReportMetric(float64(total)/elapsed.Seconds(), "msg/s")
}

// BenchmarkAdvance measures, for batches of 1 to 500 messages, deleting
// a batch and reading the next one through BatchAdvancer and as the two
// calls MarkPublished and NextBatch, on every database: what the relay
// pays per batch, at a low rate (a hinted bucket is read ahead after a
// batch of a few) and draining a backlog (full batches). It is how the
// store's statement forms were chosen (see MarkPublishedNext).
//
//	go test -run '^$' -bench Advance -benchtime 300x .
func BenchmarkAdvance(b *testing.B) {
	for _, dialect := range []string{dbtest.Postgres, dbtest.MySQL, dbtest.SQLite} {
		b.Run(dialect, func(b *testing.B) { benchAdvance(b, dbtest.Open(b, dialect)) })
	}
}

func benchAdvance(b *testing.B, db *dbtest.DB) {
	bundle := newStoreBundle(b, db, outbox.Config{})
	acq, err := bundle.store.AcquireLeases(context.Background(), relay.AcquireRequest{RelayID: "bench", BucketCount: 8, LeaseDuration: time.Hour})
	require.NoError(b, err)
	lease := acq.Leases[1]
	require.Equal(b, 1, lease.Bucket)
	for _, size := range []int{1, 4, 32, 128, 500} {
		for _, mode := range []string{"advance", "two-calls"} {
			b.Run(fmt.Sprintf("%s/%d", mode, size), func(b *testing.B) {
				rows := make([]outbox.MessageRow, size)
				insert := func() {
					for i := range rows {
						rows[i] = outbox.MessageRow{Bucket: 1, Value: []byte("v")}
					}
					bundle.insert(b, rows...)
				}
				insert()
				batch, err := bundle.store.NextBatch(context.Background(), 1, 500)
				require.NoError(b, err)
				for b.Loop() {
					b.StopTimer()
					insert()
					b.StartTimer()
					if mode == "advance" {
						batch, err = bundle.store.MarkPublishedNext(context.Background(), "bench", lease, batch, 500)
					} else {
						if err = bundle.store.MarkPublished(context.Background(), "bench", lease, batch); err == nil {
							batch, err = bundle.store.NextBatch(context.Background(), 1, 500)
						}
					}
					require.NoError(b, err)
					require.Len(b, batch, size)
				}
				require.NoError(b, bundle.store.MarkPublished(context.Background(), "bench", lease, batch))
			})
		}
	}
}
