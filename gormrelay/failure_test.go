package gormrelay_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strconv"
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

// poison is a function publisher hook that fails every batch at the first
// message whose value is in the set, with err, and acknowledges the
// messages before it.
type poison struct {
	mu   sync.Mutex
	bad  map[string]bool
	err  error
	seen map[string]int // publish attempts per value
}

func newPoison(err error, values ...string) *poison {
	p := &poison{bad: map[string]bool{}, err: err, seen: map[string]int{}}
	for _, v := range values {
		p.bad[v] = true
	}
	return p
}

func (p *poison) heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.bad = map[string]bool{}
}

func (p *poison) hook(_ context.Context, msgs []relay.Message) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, m := range msgs {
		p.seen[string(m.Value)]++
		if p.bad[string(m.Value)] {
			return i, p.err
		}
	}
	return len(msgs), nil
}

// relayConfig is fastConfig with the bundle's bucket count.
//
// It is for tests of one relay: its lease (10 s) outlasts any stall of a
// busy machine's database, so the relay never loses a bucket to nobody;
// tests of takeover use fastConfig's short lease.
func (b *storeBundle) relayConfig(t testing.TB, id string) relay.Config {
	cfg := fastConfig(t, id)
	cfg.BucketCount = b.cfg.BucketCount
	cfg.LeaseDuration = 10 * time.Second
	return cfg
}

// startPolicyRelay starts relay "a" on the bundle's store with a failure
// policy of pc, publishing into a new recorder through pois.
func (b *storeBundle) startPolicyRelay(t *testing.T, pc gormrelay.FailurePolicyConfig, pois *poison) (*gormrelay.FailurePolicy, *recorder) {
	t.Helper()
	policy, err := gormrelay.NewFailurePolicy(b.store, pc)
	require.NoError(t, err)
	rec := newRecorder()
	cfg := b.relayConfig(t, "a")
	cfg.FailureHandler = policy
	startRelay(t, b.store, rec.publisher("a", pois.hook), cfg)
	return policy, rec
}

// deadRows reads the dead-letter table in id order.
func (b *storeBundle) deadRows(t require.TestingT) []outbox.DeadLetterRow {
	helper(t)
	var rows []outbox.DeadLetterRow
	require.NoError(t, b.db.DB.Table(b.cfg.Tables.DeadLettersTable()).Order("id").Find(&rows).Error)
	return rows
}

// pendingValues reads the values of the pending messages in id order.
func (b *storeBundle) pendingValues(t testing.TB) []string {
	t.Helper()
	var rows []outbox.MessageRow
	require.NoError(t, b.messages().Order("id").Find(&rows).Error)
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = string(r.Value)
	}
	return out
}

func deadValues(rows []outbox.DeadLetterRow) map[string]string {
	out := map[string]string{}
	for _, r := range rows {
		out[string(r.Value)] = r.State
	}
	return out
}

// ackedValues returns the acknowledged values in acknowledgement order.
func ackedValues(rec *recorder) []string {
	var out []string
	for _, m := range rec.acked() {
		out = append(out, string(m.Value))
	}
	return out
}

// requireKeyOrder checks that the values "key/seq" of key were first
// acknowledged in ascending seq order and that want is exactly the set.
func requireKeyOrder(t testing.TB, acked []string, key string, want ...int) {
	t.Helper()
	seen := map[string]bool{}
	var got []int
	for _, v := range acked {
		if seen[v] {
			continue
		}
		seen[v] = true
		k, seqText, ok := strings.Cut(v, "/")
		if !ok || k != key {
			continue
		}
		seq, err := strconv.Atoi(seqText)
		require.NoError(t, err)
		got = append(got, seq)
	}
	require.Equal(t, want, got, "deliveries of key %s", key)
}

// A transient failure is retried with backoff until MaxAttempts, then the
// message is dead-lettered with its error and attempts, and the bucket
// moves on.
func TestFailurePolicyMaxAttempts(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t,
			outbox.MessageRow{MessageID: "a0", Value: []byte("a/0")},
			outbox.MessageRow{MessageID: "p", Key: []byte("p"), Value: []byte("p/0")},
			outbox.MessageRow{MessageID: "a1", Value: []byte("a/1")},
		)
		created := time.Now()
		pois := newPoison(errors.New("broker unavailable"), "p/0")
		_, rec := b.startPolicyRelay(t, gormrelay.FailurePolicyConfig{MaxAttempts: 3, Logger: dbtest.Logger(t)}, pois)

		b.requireDrained(t)
		dead := b.deadRows(t)
		require.Len(t, dead, 1)
		d := dead[0]
		require.Equal(t, "p", d.MessageID)
		require.Equal(t, "failed", d.State)
		require.EqualValues(t, 3, d.Attempts)
		require.NotNil(t, d.LastError)
		require.Contains(t, *d.LastError, "broker unavailable")
		require.Equal(t, []byte("p"), d.Key)
		require.Equal(t, []byte("p/0"), d.Value)
		require.WithinDuration(t, created, time.UnixMilli(d.CreatedAtMs), 5*time.Second)
		require.GreaterOrEqual(t, d.DeadAtMs, d.CreatedAtMs)
		pois.mu.Lock()
		require.Equal(t, 3, pois.seen["p/0"], "published exactly MaxAttempts times")
		pois.mu.Unlock()
		require.Equal(t, []string{"a/0", "a/1"}, ackedValues(rec))
	})
}

// A permanent error dead-letters at once, through the store's default
// policy: relay.Config.FailureHandler is not set.
func TestFailurePolicyPermanentDefault(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t,
			outbox.MessageRow{MessageID: "big", Value: []byte("big/0")},
			outbox.MessageRow{MessageID: "ok", Value: []byte("ok/0")},
		)
		pois := newPoison(relay.Permanent(errors.New("message too large")), "big/0")
		rec := newRecorder()
		startRelay(t, b.store, rec.publisher("a", pois.hook), b.relayConfig(t, "a"))

		b.requireDrained(t)
		dead := b.deadRows(t)
		require.Len(t, dead, 1)
		require.Equal(t, "failed", dead[0].State)
		require.EqualValues(t, 1, dead[0].Attempts)
		require.Contains(t, *dead[0].LastError, "message too large")
		require.Nil(t, dead[0].Key)
		require.Equal(t, []string{"ok/0"}, ackedValues(rec))
	})
}

// Key quarantine: the poison key's later messages are parked, other keys
// of the bucket flow; messages of the key enqueued later are parked too;
// requeueing the key restores its order, including pending messages of
// the key, and delivers everything in order.
func TestFailurePolicyQuarantineAndRequeue(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		admin := b.newAdmin(t)
		b.insert(t, keyed([]string{"k", "j"}, 3)...) // k/0 j/0 k/1 j/1 k/2 j/2
		pois := newPoison(relay.Permanent(errors.New("rejected")), "k/0")
		rec := newRecorder()
		r := startRelay(t, b.store, rec.publisher("a", pois.hook), b.relayConfig(t, "a"))

		b.requireDrained(t)
		require.Equal(t, map[string]string{"k/0": "failed", "k/1": "parked", "k/2": "parked"}, deadValues(b.deadRows(t)))
		requireKeyOrder(t, ackedValues(rec), "j", 0, 1, 2)
		requireKeyOrder(t, ackedValues(rec), "k")

		// Later messages: the quarantined key is parked, the other flows.
		b.insert(t, outbox.MessageRow{MessageID: "k-3", Key: []byte("k"), Value: []byte("k/3")},
			outbox.MessageRow{MessageID: "j-3", Key: []byte("j"), Value: []byte("j/3")})
		b.requireDrained(t)
		require.Equal(t, "parked", deadValues(b.deadRows(t))["k/3"])
		requireKeyOrder(t, ackedValues(rec), "j", 0, 1, 2, 3)
		requireKeyOrder(t, ackedValues(rec), "k")

		// With no relay running, a pending message of the key stays pending
		// and must come after the requeued ones.
		stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(stopCtx))
		b.insert(t, outbox.MessageRow{MessageID: "k-4", Key: []byte("k"), Value: []byte("k/4")})

		counts, err := admin.CountDeadLetters(ctx)
		require.NoError(t, err)
		require.Equal(t, gormrelay.DeadLetterCounts{Failed: 1, Parked: 3}, counts)

		pois.heal()
		res, err := admin.RequeueKey(ctx, []byte("k"))
		require.NoError(t, err)
		require.EqualValues(t, 4, res.Requeued)
		require.EqualValues(t, 1, res.Moved)
		require.Equal(t, []int{0}, res.Buckets)
		require.Empty(t, b.deadRows(t))
		require.Equal(t, []string{"k/0", "k/1", "k/2", "k/3", "k/4"}, b.pendingValues(t))
		var reset []outbox.MessageRow
		require.NoError(t, b.messages().Order("id").Find(&reset).Error)
		require.Equal(t, "k-0", reset[0].MessageID, "the message id is kept")
		require.Zero(t, reset[0].Attempts)
		require.Nil(t, reset[0].LastError)

		startRelay(t, b.store, rec.publisher("b", pois.hook), b.relayConfig(t, "b"))
		b.requireDrained(t)
		requireKeyOrder(t, ackedValues(rec), "k", 0, 1, 2, 3, 4)
		require.Empty(t, b.deadRows(t))
		rec.requireNoOverlap(t)
	})
}

// A requeue while the relay runs and holds the bucket: the relay's cached
// quarantine is revoked with its lease term, so the requeued messages are
// delivered rather than parked again.
func TestFailurePolicyRequeueWhileRunning(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		admin := b.newAdmin(t)
		b.insert(t, keyed([]string{"k"}, 3)...)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "k/0")
		rec := newRecorder()
		r := startRelay(t, b.store, rec.publisher("a", pois.hook), b.relayConfig(t, "a"))
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, len(b.deadRows(c)) == 3) }, deliverWithin, 10*time.Millisecond)
		require.Equal(t, []relay.Lease{{Bucket: 0, Term: 1}}, r.Leases())

		pois.heal()
		res, err := admin.RequeueIDs(ctx, b.deadRows(t)[0].ID, 999_999)
		require.NoError(t, err)
		require.EqualValues(t, 3, res.Requeued, "a keyed dead letter brings its key group back")
		require.Equal(t, []int64{999_999}, res.NotFound)

		b.requireDrained(t)
		require.Empty(t, b.deadRows(t))
		requireKeyOrder(t, ackedValues(rec), "k", 0, 1, 2)
	})
}

// Block never gives up: the poison message stays, its bucket does not
// advance, nothing is dead-lettered, and other buckets flow.
func TestFailurePolicyBlock(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 2})
		stuck, free := keyInBucket(t, 0, 2), keyInBucket(t, 1, 2)
		b.insert(t, keyed([]string{stuck, free}, 3)...)
		pois := newPoison(relay.Permanent(errors.New("rejected")), stuck+"/0")
		policy, rec := b.startPolicyRelay(t, gormrelay.FailurePolicyConfig{Mode: gormrelay.ModeBlock, MaxAttempts: 2}, pois)
		require.Equal(t, gormrelay.ModeBlock, policy.Config().Mode)

		var head outbox.MessageRow
		require.Eventually(t, func() bool {
			head = outbox.MessageRow{}
			return b.messages().Where("bucket = ?", 0).Order("id").Take(&head).Error == nil && head.Attempts >= 4
		}, deliverWithin, 10*time.Millisecond, "the poison message is retried past MaxAttempts")
		require.Equal(t, stuck+"/0", string(head.Value))
		require.Contains(t, *head.LastError, "rejected")
		// The operator sees what holds bucket 0 back, and nothing in 1.
		st, err := b.newAdmin(t).Status(context.Background())
		require.NoError(t, err)
		r := st.Buckets[0].Retrying
		require.NotNil(t, r, "the status names the message the relay retries")
		require.Equal(t, head.ID, r.ID)
		require.Equal(t, stuck, string(r.Key))
		require.GreaterOrEqual(t, r.Attempts, 4)
		require.Contains(t, r.LastError, "rejected")
		require.Nil(t, st.Buckets[1].Retrying)
		// The other bucket's drain runs beside the retries; on a busy
		// machine it may end after the fourth attempt.
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Empty(c, b.ids(c, 1)) }, deliverWithin, 10*time.Millisecond, "the other bucket flows")
		require.Len(t, b.ids(t, 0), 3, "the blocked bucket does not advance")
		require.Empty(t, b.deadRows(t))
		requireKeyOrder(t, ackedValues(rec), free, 0, 1, 2)
		requireKeyOrder(t, ackedValues(rec), stuck)
	})
}

// A relay that gains many buckets reads their quarantined keys in one
// statement, not one per bucket, and still parks every quarantined key of
// each of them.
func TestFailurePolicyQuarantineReadOnce(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const n = 8
		b := newStoreBundle(t, db, outbox.Config{BucketCount: n})
		var reads atomic.Int32
		dead := b.cfg.Tables.DeadLettersTable()
		require.NoError(t, db.DB.Callback().Row().After("gorm:row").Register("test:quarantine_reads", func(tx *gorm.DB) {
			if sql := tx.Statement.SQL.String(); strings.Contains(sql, dead) && strings.Contains(sql, "DISTINCT") {
				reads.Add(1)
			}
		}))

		// Bucket 2 and 5 each have a quarantined key; every bucket has a
		// free key with pending messages, and 2 and 5 a message of their
		// quarantined key.
		var rows []outbox.MessageRow
		for bucket := range n {
			rows = append(rows, keyed([]string{keyInBucket(t, bucket, n)}, 2)...)
		}
		q2, q5 := prefixedKeyInBucket(t, "q", 2, n), prefixedKeyInBucket(t, "q", 5, n)
		b.insertDead(t,
			outbox.DeadLetterRow{ID: 1_000_001, Bucket: 2, Key: []byte(q2), Value: []byte(q2 + "/dead")},
			outbox.DeadLetterRow{ID: 1_000_002, Bucket: 5, Key: []byte(q5), Value: []byte(q5 + "/dead")},
		)
		rows = append(rows, keyed([]string{q2, q5}, 1)...)
		b.insert(t, rows...)

		_, rec := b.startPolicyRelay(t, gormrelay.FailurePolicyConfig{}, newPoison(nil))
		b.requireDrained(t)
		require.Equal(t, map[string]string{q2 + "/dead": "failed", q5 + "/dead": "failed", q2 + "/0": "parked", q5 + "/0": "parked"}, deadValues(b.deadRows(t)))
		require.Len(t, ackedValues(rec), 2*n)
		require.EqualValues(t, 1, reads.Load(), "one read of the quarantined keys for %d buckets", n)
	})
}

// Keyless messages are never quarantined; DisableQuarantine lets the rest
// of a key through.
func TestFailurePolicyNoQuarantine(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t,
			outbox.MessageRow{MessageID: "n0", Value: []byte("n/0")},
			outbox.MessageRow{MessageID: "n1", Value: []byte("n/1")},
			outbox.MessageRow{MessageID: "k0", Key: []byte("k"), Value: []byte("k/0")},
			outbox.MessageRow{MessageID: "k1", Key: []byte("k"), Value: []byte("k/1")},
			outbox.MessageRow{MessageID: "e0", Key: []byte{}, Value: []byte("e/0")},
			outbox.MessageRow{MessageID: "e1", Key: []byte{}, Value: []byte("e/1")},
		)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "n/0", "k/0")
		_, rec := b.startPolicyRelay(t, gormrelay.FailurePolicyConfig{DisableQuarantine: true}, pois)
		b.requireDrained(t)
		require.Equal(t, map[string]string{"n/0": "failed", "k/0": "failed"}, deadValues(b.deadRows(t)))
		require.Equal(t, []string{"n/1", "k/1", "e/0", "e/1"}, ackedValues(rec))
	})
}

// The empty key is a real key: it is quarantined like any other and
// requeued by RequeueKey([]byte{}).
func TestFailurePolicyEmptyKey(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t,
			outbox.MessageRow{MessageID: "e0", Key: []byte{}, Value: []byte("e/0")},
			outbox.MessageRow{MessageID: "n0", Value: []byte("n/0")},
			outbox.MessageRow{MessageID: "e1", Key: []byte{}, Value: []byte("e/1")},
		)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "e/0")
		rec := newRecorder()
		r, err := relay.New(b.store, rec.publisher("a", pois.hook), b.relayConfig(t, "a"))
		require.NoError(t, err)
		n, err := r.DrainOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, map[string]string{"e/0": "failed", "e/1": "parked"}, deadValues(b.deadRows(t)))

		admin := b.newAdmin(t)
		pois.heal()
		res, err := admin.RequeueKey(ctx, []byte{})
		require.NoError(t, err)
		require.EqualValues(t, 2, res.Requeued)
		n, err = r.DrainOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.Equal(t, []string{"n/0", "e/0", "e/1"}, ackedValues(rec))
		require.Empty(t, b.deadRows(t))
	})
}

// The one-shot runner drains everything once, dead-letters what fails
// permanently and carries on.
func TestDrainOnceRunner(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{})
		rows := b.insert(t, keyed(keysN(10), 3)...)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "key-3/1")
		rec := newRecorder()
		cfg := b.relayConfig(t, "once")
		n, err := gormrelay.DrainOnce(ctx, db.DB, b.cfg, rec.publisher("once", pois.hook), cfg)
		require.NoError(t, err)
		require.Equal(t, len(rows)-2, n)
		require.Zero(t, b.count(t))
		require.Equal(t, map[string]string{"key-3/1": "failed", "key-3/2": "parked"}, deadValues(b.deadRows(t)))
		requireOrdered(t, rec.acked())

		// Nothing left: a second run publishes nothing.
		n, err = gormrelay.DrainOnce(ctx, db.DB, b.cfg, rec.publisher("once", nil), cfg)
		require.NoError(t, err)
		require.Zero(t, n)

		// A new run (a new store, nothing cached) reads the quarantine from
		// the dead-letter table: a later message of the key is parked.
		b.insert(t, outbox.MessageRow{MessageID: "key-3-3", Key: []byte("key-3"), Value: []byte("key-3/3")},
			outbox.MessageRow{MessageID: "key-4-3", Key: []byte("key-4"), Value: []byte("key-4/3")})
		n, err = gormrelay.DrainOnce(ctx, db.DB, b.cfg, rec.publisher("once", nil), cfg)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		require.Equal(t, "parked", deadValues(b.deadRows(t))["key-3/3"])
		requireKeyOrder(t, ackedValues(rec), "key-3", 0)
	})
}

// The paced drain publishes at most RateLimit messages per second, in
// batches no larger than the pace allows.
func TestRelayRateLimit(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 2})
		b.insert(t, keyed(keysN(4), 15)...) // 60 messages
		rec := newRecorder()
		cfg := b.relayConfig(t, "paced")
		cfg.BatchSize = 100
		cfg.RateLimit = 40 // burst 40: the first 40 at once, 20 more after 0.5s
		start := time.Now()
		r, err := relay.New(b.store, rec.publisher("paced", nil), cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 60, n)
		require.GreaterOrEqual(t, time.Since(start), 400*time.Millisecond)
		for _, c := range rec.snapshot() {
			require.LessOrEqual(t, len(c.msgs), 40)
		}
		requireOrdered(t, rec.acked())

		_, err = relay.New(b.store, rec.publisher("x", nil), relay.Config{RateLimit: -1})
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
	})
}

func TestFailurePolicyConfig(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	store, err := gormrelay.NewStore(db.DB, outbox.Config{})
	require.NoError(t, err)
	_, err = gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{MaxAttempts: -1})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{Mode: 7})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = gormrelay.NewFailurePolicy(nil, gormrelay.FailurePolicyConfig{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	p, err := gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{})
	require.NoError(t, err)
	require.Equal(t, gormrelay.MaxAttemptsDefault, p.Config().MaxAttempts)
	require.Equal(t, gormrelay.ModeDeadLetter, p.Config().Mode)
	require.Same(t, store.FailurePolicy(), store.FailurePolicy())
	require.Equal(t, "block", gormrelay.ModeBlock.String())
	require.True(t, slices.Contains([]string{"dead-letter"}, gormrelay.ModeDeadLetter.String()))
}

// The default wiring: the store brings the failure policy (dead-letter
// after 10 attempts, key quarantine), and relay.New picks it up.
func ExampleNewStore_failurePolicy() {
	var db *gorm.DB // from gorm.Open, with the outbox tables migrated
	var publisher relay.Publisher

	store, err := gormrelay.NewStore(db, outbox.Config{})
	if err != nil {
		panic(err)
	}
	r, err := relay.New(store, publisher, relay.Config{})
	if err != nil {
		panic(err)
	}
	_ = r.Start(context.Background())
}

// A policy with other settings, passed to the relay explicitly.
func ExampleNewFailurePolicy() {
	var store *gormrelay.Store // from gormrelay.NewStore
	var publisher relay.Publisher

	policy, err := gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{
		MaxAttempts: 5, // transient failures before dead-lettering
	})
	if err != nil {
		panic(err)
	}
	r, err := relay.New(store, publisher, relay.Config{
		FailureHandler: policy,
		RateLimit:      200, // messages per second while draining a backlog
	})
	if err != nil {
		panic(err)
	}
	_ = r.Start(context.Background())
}

// The line of a park names the parked messages: their dead-letter ids
// and message ids (the first 20, counting the rest) and their keys (a
// binary key as base64), so an operator can find them.
func TestFailurePolicyParkLogNamesMessages(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const binary = "\xff\x00"
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		rows := keyed([]string{"k", binary, "j"}, 25)
		for i := range rows {
			rows[i].MessageID = strings.ReplaceAll(rows[i].MessageID, binary, "bin")
		}
		b.insert(t, rows...)
		logger, records := dbtest.WatchLog(t, "outbox: messages parked behind a dead letter of their key")
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{Logger: logger})
		require.NoError(t, err)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "k/0", binary+"/0")
		rec := newRecorder()
		cfg := b.relayConfig(t, "a")
		cfg.BatchSize = 100
		cfg.FailureHandler = policy
		startRelay(t, b.store, rec.publisher("a", pois.hook), cfg)
		b.requireDrained(t)

		parked := map[int64]outbox.DeadLetterRow{}
		for _, d := range b.deadRows(t) {
			if d.State == "parked" {
				parked[d.ID] = d
			}
		}
		require.Len(t, parked, 48)
		logged, omitted := map[int64]bool{}, 0
		keys := map[string]bool{}
		for len(logged)+omitted < len(parked) {
			var r slog.Record
			select {
			case r = <-records:
			case <-time.After(10 * time.Second):
				t.Fatalf("park lines name %d and omit %d of %d parked messages", len(logged), omitted, len(parked))
			}
			attr := func(key string) slog.Value {
				v, ok := dbtest.Attr(r, key)
				require.True(t, ok, "attribute %s", key)
				return v
			}
			n := int(attr("parked").Int64())
			ids := attr("ids").Any().([]int64)
			messageIDs := attr("message_ids").Any().([]string)
			require.Len(t, ids, min(n, 20))
			require.Len(t, messageIDs, len(ids))
			if n > 20 {
				require.EqualValues(t, n-20, attr("ids_omitted").Int64())
				omitted += n - 20
			} else {
				_, ok := dbtest.Attr(r, "ids_omitted")
				require.False(t, ok)
			}
			for i, id := range ids {
				d, ok := parked[id]
				require.True(t, ok, "id %d is a parked dead letter", id)
				require.Equal(t, d.MessageID, messageIDs[i])
				require.False(t, logged[id], "id %d logged twice", id)
				logged[id] = true
			}
			for _, k := range attr("keys").Any().([]string) {
				keys[k] = true
			}
		}
		require.Equal(t, map[string]bool{"k": true, "base64:/wA=": true}, keys)
	})
}

// The line of a dead-lettered message names its key, in the park line's
// printable form (a key that is not printable text as base64:...), and
// no key for a message without one.
func TestFailurePolicyDeadLetterLogNamesKey(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const binary = "\xff\x00"
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t,
			outbox.MessageRow{MessageID: "text", Key: []byte("k"), Value: []byte("text")},
			outbox.MessageRow{MessageID: "binary", Key: []byte(binary), Value: []byte("binary")},
			outbox.MessageRow{MessageID: "keyless", Value: []byte("keyless")})
		logger, records := dbtest.WatchLog(t, "outbox: message dead-lettered")
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{Logger: logger, DisableQuarantine: true})
		require.NoError(t, err)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "text", "binary", "keyless")
		cfg := b.relayConfig(t, "a")
		cfg.FailureHandler = policy
		startRelay(t, b.store, newRecorder().publisher("a", pois.hook), cfg)
		b.requireDrained(t)

		keys := map[string]string{}
		for len(keys) < 3 {
			var r slog.Record
			select {
			case r = <-records:
			case <-time.After(10 * time.Second):
				t.Fatalf("dead-lettered lines for %v only", keys)
			}
			id, ok := dbtest.Attr(r, "message_id")
			require.True(t, ok)
			key := "(none)"
			if v, ok := dbtest.Attr(r, "key"); ok {
				key = v.String()
			}
			keys[id.String()] = key
		}
		require.Equal(t, map[string]string{"text": "k", "binary": "base64:/wA=", "keyless": "(none)"}, keys)
	})
}
