package gormrelay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// Strict mode end to end: the relay, a real database (every dialect), the
// transactional publisher and a Kafka-protocol broker (kfake, or the
// cluster in KAFKA_BROKERS), read back as a read_committed consumer.

// strictSaramaConfig keeps retries short so that fault tests stay fast.
func strictSaramaConfig(sc *sarama.Config) error {
	sc.ClientID = "outbox-strict-test"
	sc.Producer.Retry.Backoff = 10 * time.Millisecond
	sc.Metadata.Retry.Backoff = 10 * time.Millisecond
	sc.Producer.Transaction.Retry.Backoff = 20 * time.Millisecond
	sc.Net.DialTimeout = 3 * time.Second
	return nil
}

// newStrictPublisher returns a started transactional publisher on c with the
// given transactional id prefix, closed when the test ends (after the
// relays started later, whose cleanups run first).
func newStrictPublisher(t testing.TB, c *kafkatest.Cluster, prefix string, maxBytes int) *publisher.Transactional {
	t.Helper()
	return publishertest.StartTransactional(t, publisher.TransactionalConfig{
		Brokers:               c.Brokers(),
		TransactionalIDPrefix: prefix,
		Configure:             strictSaramaConfig,
		MaxMessageBytes:       maxBytes,
		Logger:                dbtest.Logger(t),
	})
}

func strictPrefix(t testing.TB) string {
	return fmt.Sprintf("outbox-strict-%s-%d-", strings.ReplaceAll(t.Name(), "/", "-"), time.Now().UnixNano())
}

// committedValues returns the values a read_committed consumer sees on
// topic now, by key, in log order.
func committedValues(t testing.TB, c *kafkatest.Cluster, topic string, opts ...kafkatest.ReadOption) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, r := range c.ReadLog(t, topic, 15*time.Second, opts...) {
		out[string(r.Key)] = append(out[string(r.Key)], string(r.Value))
	}
	return out
}

// seqValues is "key/0" ... "key/n-1".
func seqValues(key string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/%d", key, i)
	}
	return out
}

// keysInBucket returns n distinct keys that hash to bucket.
func keysInBucket(t testing.TB, bucket, n, buckets int) []string {
	t.Helper()
	var keys []string
	for i := 0; len(keys) < n && i < 100_000; i++ {
		k := fmt.Sprintf("key-%d", i)
		if outbox.Bucket([]byte(k), nil, "", buckets) == bucket {
			keys = append(keys, k)
		}
	}
	require.Len(t, keys, n)
	return keys
}

func withTopic(topic string, rows []outbox.MessageRow) []outbox.MessageRow {
	for i := range rows {
		rows[i].Topic = topic
	}
	return rows
}

// A relay in strict mode drains every bucket through its own transactional
// producer, started when the bucket is acquired: each key arrives in order,
// exactly once, and stopping the relay and closing the publisher leaves
// nothing running.
func TestStrictRelayDelivers(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c := kafkatest.Start(t)
		topic := c.Topic(t, 3)
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 4})
		prefix := strictPrefix(t)
		var inits *kfake.FaultHandle
		if fake := c.Fake(); fake != nil {
			inits = fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, Observe: true, Count: -1})
		}
		tx := newStrictPublisher(t, c, prefix, 0)
		counted := &acquireCounter{Transactional: tx}

		keys := keysN(12)
		rows := b.insert(t, withTopic(topic, keyed(keys, 15))...)
		cfg := fastConfig(t, "a")
		cfg.BucketCount = 4
		cfg.BatchSize = 25
		r := startRelay(t, b.store, counted, cfg)
		b.requireDrained(t)

		got := committedValues(t, c, topic, kafkatest.ReadCommitted())
		for _, k := range keys {
			require.Equal(t, seqValues(k, 15), got[k], "key %s", k)
		}
		require.Len(t, rows, 12*15)
		// Under load a lease may lapse and be re-acquired: wait for all four.
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, r.Leases(), 4) }, deliverWithin, 10*time.Millisecond)
		if inits != nil {
			// A lease that lapsed under load is announced again when it
			// is re-acquired, and gets a new producer then.
			require.GreaterOrEqual(t, counted.acquired.Load(), int64(4))
			require.EqualValues(t, counted.acquired.Load(), inits.Hits(), "one producer per acquired bucket, started at acquisition")
		}
	})
}

// acquireCounter counts the leases a relay announces as acquired to a
// transactional publisher.
type acquireCounter struct {
	*publisher.Transactional
	acquired atomic.Int64
}

func (a *acquireCounter) LeasesAcquired(ctx context.Context, leases []relay.Lease) error {
	a.acquired.Add(int64(len(leases)))
	return a.Transactional.LeasesAcquired(ctx, leases)
}

// TestStrictPartialFailure is Dekaf's case end to end in strict mode: rows
// 1, 2 and 3 share a key and row 1 is too large. Nothing of the key becomes
// visible while row 1 fails (not even to read_uncommitted consumers: the
// batch fails before its transaction begins), the rows stay pending, and
// once a handler repairs row 1 the key arrives as 1, 2, 3, exactly once.
func TestStrictPartialFailure(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c := kafkatest.Start(t)
		topic := c.Topic(t, 3)
		b := newStoreBundle(t, db, outbox.Config{})
		const maxBytes = 10_000
		tx := newStrictPublisher(t, c, strictPrefix(t), maxBytes)

		rows := b.insert(t, withTopic(topic, keyed([]string{"order-1"}, 3))...)
		require.NoError(t, b.messages().Where("id = ?", rows[0].ID).Update("msg_value", make([]byte, 2*maxBytes)).Error)

		failures := make(chan relay.Failure, 100)
		repair := make(chan struct{})
		cfg := fastConfig(t, "a")
		cfg.FailureHandler = relay.FailureHandlerFunc(func(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
			select {
			case failures <- f:
			default:
			}
			select {
			case <-repair:
				// Fix the payload, keeping the message id.
				err := b.db.DB.WithContext(ctx).Table(b.cfg.Tables.MessagesTable()).
					Where("id = ?", f.Message.ID).Update("msg_value", []byte("order-1/0")).Error
				return relay.FailureRetry, err
			default:
				return relay.FailureBackoff, nil
			}
		})
		startRelay(t, b.store, tx, cfg)

		for range 3 {
			select {
			case f := <-failures:
				require.Equal(t, rows[0].MessageID, f.Message.MessageID, "the failure names row 1")
				require.Zero(t, f.Acked)
				require.True(t, publisher.IsTooLarge(f.Err), "%v", f.Err)
				require.True(t, relay.IsPermanent(f.Err))
			case <-time.After(10 * time.Second):
				t.Fatal("the batch did not fail")
			}
		}
		require.EqualValues(t, 3, b.count(t), "all three rows stay pending")
		require.Empty(t, committedValues(t, c, topic), "nothing reached the broker, even uncommitted")

		close(repair)
		b.requireDrained(t)
		require.Equal(t, map[string][]string{"order-1": seqValues("order-1", 3)}, committedValues(t, c, topic, kafkatest.ReadCommitted()))
	})
}

// TestStrictCulpritWithFailurePolicy puts the poison row in the middle of
// a batch and runs the outbox's own failure policy (dead letters with key
// quarantine). The transactional publisher acknowledges nothing of the
// failed batch but names the culprit; the relay publishes the rows before
// it first, then the policy dead-letters the culprit and parks the rest of
// its key. Consumers see every row before the culprit, nothing of its key
// after it, and the other key in full, in order.
func TestStrictCulpritWithFailurePolicy(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c := kafkatest.Start(t)
		topic := c.Topic(t, 3)
		b := newStoreBundle(t, db, outbox.Config{})
		const maxBytes = 10_000
		tx := newStrictPublisher(t, c, strictPrefix(t), maxBytes)

		keys := keysInBucket(t, 5, 2, 8)
		k1, k2 := keys[0], keys[1]
		rows := b.insert(t, withTopic(topic, keyed(keys, 3))...) // k1/0 k2/0 k1/1 k2/1 k1/2 k2/2
		culprit := rows[2]                                       // k1/1
		require.Equal(t, k1+"/1", string(culprit.Value))
		require.NoError(t, b.messages().Where("id = ?", culprit.ID).Update("msg_value", make([]byte, 2*maxBytes)).Error)

		startRelay(t, b.store, tx, fastConfig(t, "a")) // the store's failure policy
		b.requireDrained(t)

		require.Equal(t, map[string][]string{k1: {k1 + "/0"}, k2: seqValues(k2, 3)}, committedValues(t, c, topic, kafkatest.ReadCommitted()))
		var dead []outbox.DeadLetterRow
		require.NoError(t, b.db.DB.Table(b.cfg.Tables.DeadLettersTable()).Order("id").Find(&dead).Error)
		require.Len(t, dead, 2)
		require.Equal(t, culprit.MessageID, dead[0].MessageID)
		require.Equal(t, string(gormrelay.DeadLetterFailed), dead[0].State)
		require.Equal(t, k1+"/2", string(dead[1].Value))
		require.Equal(t, string(gormrelay.DeadLetterParked), dead[1].State)
	})
}

// stalledPublisher is relay A's publisher in the takeover test: its
// Publish ignores cancellation, like a process frozen in the middle of a
// publish whose in-flight transaction outlives its lease. It forwards
// LeaseAware through the embedded publisher.
//
// With hold set, its first Publish waits for release before it reaches the
// producer: the process stalls after reading its batch and before any of
// it reaches the broker. That stall needs no broker fault, so it runs on
// Apache Kafka as well as on kfake.
type stalledPublisher struct {
	*publisher.Transactional
	results chan error

	hold          bool
	once          sync.Once
	held, release chan struct{}
}

func (p *stalledPublisher) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	if p.hold {
		p.once.Do(func() {
			close(p.held)
			<-p.release
		})
	}
	acked, err := p.Transactional.Publish(context.WithoutCancel(ctx), msgs)
	select {
	case p.results <- err:
	default:
	}
	return acked, err
}

// countingStore counts MarkPublished calls.
type countingStore struct {
	*crashStore
	deletes atomic.Int32
}

func (s *countingStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	s.deletes.Add(1)
	return s.crashStore.MarkPublished(ctx, id, l, msgs)
}

// TestStrictTakeoverFencesStaleRelay is the takeover Dekaf documents as
// unfixable without Kafka transactions. Relay A is held in the middle of a
// transaction (at its commit, or before its records reach the broker) and
// its process stalls: its lease expires, relay B takes the bucket over,
// initialises the bucket's transactional id (which fences A and aborts A's
// transaction) and publishes every row, then newer rows. When A resumes,
// its commit or produce is refused: A reports the fencing, drops the
// bucket and deletes nothing. A read_committed consumer sees every key in
// enqueue order, exactly once, with no stale copy after a newer message;
// only a read_uncommitted consumer sees A's aborted copies.
//
// HeldAtEndTxn and HeldAtProduce hold A's request in the broker, a fault
// only kfake can inject; HeldBeforeProduce stalls A in its own process
// after it read its batch, and runs on Apache Kafka too, where the fencing
// errors are the ones the real broker returns.
func TestStrictTakeoverFencesStaleRelay(t *testing.T) {
	t.Parallel()
	for _, at := range []kmsg.Key{kmsg.EndTxn, kmsg.Produce, heldBeforeProduce} {
		name := "HeldAt" + at.Name()
		if at == heldBeforeProduce {
			name = "HeldBeforeProduce"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
				testStrictTakeover(t, db, at)
			})
		})
	}
}

// heldBeforeProduce is testStrictTakeover's client-side stall: no request
// key, A never reaches the broker before it is fenced.
const heldBeforeProduce kmsg.Key = -1

func testStrictTakeover(t *testing.T, db *dbtest.DB, at kmsg.Key) {
	const buckets, bucket = 2, 1
	c := kafkatest.Start(t)
	var fake *kfake.Cluster
	if at != heldBeforeProduce {
		fake = c.RequireFake(t) // kfake only: the broker holds A's request
	}
	partitions := int32(3)
	if at != kmsg.EndTxn {
		// One partition: when a transaction spanning several partitions
		// fails at produce, sarama's retry goroutines race on the
		// transaction manager's last error (IBM/sarama#2913), which -race
		// reports. The fencing under test is the same.
		partitions = 1
	}
	topic := c.Topic(t, partitions)
	b := newStoreBundle(t, db, outbox.Config{BucketCount: buckets})
	prefix := strictPrefix(t)
	pubA := &stalledPublisher{Transactional: newStrictPublisher(t, c, prefix, 0), results: make(chan error, 10)}
	pubB := newStrictPublisher(t, c, prefix, 0)
	storeA := &countingStore{crashStore: &crashStore{Store: b.store}}

	keys := keysInBucket(t, bucket, 3, buckets)
	var rows []outbox.MessageRow
	for seq := range 10 {
		for _, k := range keys {
			rows = append(rows, outbox.MessageRow{Topic: topic, MessageID: fmt.Sprintf("%s-%d", k, seq), Key: []byte(k), Value: fmt.Appendf(nil, "%s/%d", k, seq)})
		}
	}
	b.insert(t, rows...)

	var held, release chan struct{}
	if at == heldBeforeProduce {
		held, release = make(chan struct{}), make(chan struct{})
		pubA.hold, pubA.held, pubA.release = true, held, release
	} else {
		held, release = kafkatest.HoldRequest(fake, at, func(req kmsg.Request) bool {
			if r, ok := req.(*kmsg.EndTxnRequest); ok {
				return r.TransactionalID == pubA.TransactionalID(bucket) && r.Commit
			}
			return true // the first produce request is A's
		})
	}
	cfg := func(id string) relay.Config {
		cfg := fastConfig(t, id)
		cfg.BucketCount = buckets
		return cfg
	}
	startRelay(t, storeA, pubA, cfg("a"))
	// B keeps its lease through any stall of a busy machine: if it lapsed
	// and came back, B's own open transaction would be aborted too, and
	// the count of aborted copies below would not be A's alone.
	cfgB := cfg("b")
	cfgB.LeaseDuration = 10 * time.Second
	select {
	case <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("relay A never reached the broker")
	}
	// A stalls: its database calls fail from now on, its lease expires.
	storeA.dead.Store(true)

	r2 := startRelay(t, b.store, pubB, cfgB)
	b.requireDrained(t, "B publishes everything")
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Contains(c, leaseBuckets(r2.Leases()), bucket) }, deliverWithin, 10*time.Millisecond,
		"B holds the bucket (under load a lease may lapse and be re-acquired)")
	var newer []outbox.MessageRow
	for seq := 10; seq < 15; seq++ {
		for _, k := range keys {
			newer = append(newer, outbox.MessageRow{Topic: topic, MessageID: fmt.Sprintf("%s-%d", k, seq), Key: []byte(k), Value: fmt.Appendf(nil, "%s/%d", k, seq)})
		}
	}
	b.insert(t, newer...)
	b.requireDrained(t, "B publishes the newer rows")

	// A resumes, with a working database again.
	storeA.dead.Store(false)
	deletesBefore := storeA.deletes.Load()
	close(release)
	select {
	case err := <-pubA.results:
		require.True(t, relay.IsFenced(err), "A's publish: %v", err)
		require.ErrorIs(t, err, relay.ErrLeaseLost)
	case <-time.After(15 * time.Second):
		t.Fatal("relay A's publish did not return")
	}
	require.Equal(t, deletesBefore, storeA.deletes.Load(), "a fenced relay deletes nothing")

	committed := committedValues(t, c, topic, kafkatest.ReadCommitted())
	for _, k := range keys {
		require.Equal(t, seqValues(k, 15), committed[k], "key %s: enqueue order, once each", k)
	}
	uncommitted := committedValues(t, c, topic)
	stale := 0
	for _, k := range keys {
		stale += len(uncommitted[k]) - 15
	}
	if at == kmsg.EndTxn {
		// A's first batch was written before the takeover and aborted.
		require.Equal(t, 20, stale, "A's aborted batch is visible to read_uncommitted only")
	} else {
		require.Zero(t, stale, "A's produce came after the fencing and was refused")
	}
	t.Logf("%s: read_committed %d records, read_uncommitted %d stale aborted copies", t.Name(), 45, stale)
}

// relay.IsFenced and the *publisher.Error both reach through the error the
// transactional publisher returns.
func TestStrictErrorsCompose(t *testing.T) {
	t.Parallel()
	inner := &publisher.Error{Index: 2, MessageID: "m", Topic: "t", Err: relay.Permanent(errors.New("boom"))}
	i, ok := relay.FailedIndex(fmt.Errorf("wrapped: %w", inner))
	require.True(t, ok)
	require.Equal(t, 2, i)
	_, ok = relay.FailedIndex(errors.New("plain"))
	require.False(t, ok)

	fenced := relay.Fenced(fmt.Errorf("publisher: transactional id fenced: %w", sarama.ErrProducerFenced))
	require.True(t, relay.IsFenced(fenced))
	require.ErrorIs(t, fenced, relay.ErrLeaseLost)
	require.ErrorIs(t, fenced, sarama.ErrProducerFenced)
	require.False(t, relay.IsPermanent(fenced))
	require.Nil(t, relay.Fenced(nil))
	require.False(t, relay.IsFenced(inner))
}

// leaseTracker is a LeaseAware publisher that checks the relay's side of
// the contract: a bucket is announced acquired before it is published,
// released once per acquisition under the term it was acquired with, and
// never published while not announced.
type leaseTracker struct {
	mu         sync.Mutex
	held       map[int]int64
	acquired   int
	released   int
	published  map[int]int
	violations []string
	// fail, if set, decides the result of a publish.
	fail func(msgs []relay.Message) (int, error)
}

func newLeaseTracker() *leaseTracker {
	return &leaseTracker{held: map[int]int64{}, published: map[int]int{}}
}

func (l *leaseTracker) LeasesAcquired(_ context.Context, leases []relay.Lease) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ls := range leases {
		if t, ok := l.held[ls.Bucket]; ok {
			l.violations = append(l.violations, fmt.Sprintf("bucket %d acquired under term %d while held under %d", ls.Bucket, ls.Term, t))
		}
		l.held[ls.Bucket] = ls.Term
		l.acquired++
	}
	return nil
}

func (l *leaseTracker) LeasesReleased(_ context.Context, leases []relay.Lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, ls := range leases {
		if t, ok := l.held[ls.Bucket]; !ok || t != ls.Term {
			l.violations = append(l.violations, fmt.Sprintf("bucket %d released under term %d, held: %v %d", ls.Bucket, ls.Term, ok, t))
		}
		delete(l.held, ls.Bucket)
		l.released++
	}
}

func (l *leaseTracker) Publish(_ context.Context, msgs []relay.Message) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := msgs[0].Bucket
	if _, ok := l.held[b]; !ok {
		l.violations = append(l.violations, fmt.Sprintf("bucket %d published while not announced", b))
	}
	if l.fail != nil {
		if acked, err := l.fail(msgs); err != nil {
			return acked, err
		}
	}
	l.published[b] += len(msgs)
	return len(msgs), nil
}

func (l *leaseTracker) check(t testing.TB) (held, acquired, released int) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	require.Empty(t, l.violations)
	return len(l.held), l.acquired, l.released
}

// The relay's side of relay.LeaseAware, with two relays handing buckets
// over: announcements match the leases, publishes happen only on announced
// buckets, and a stopped relay has released everything it announced.
func TestStrictLeaseAwareContract(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		ta, tb := newLeaseTracker(), newLeaseTracker()
		a, err := relay.New(b.store, ta, fastConfig(t, "a"))
		require.NoError(t, err)
		require.NoError(t, a.Start(context.Background()))
		r2 := startRelay(t, b.store, tb, fastConfig(t, "b"))
		require.Eventually(t, func() bool { return len(a.Leases()) == 4 && len(r2.Leases()) == 4 }, deliverWithin, 10*time.Millisecond)
		b.insert(t, keyed(keysN(20), 5)...)
		b.requireDrained(t)

		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, a.Stop(ctx))
		held, acquired, released := ta.check(t)
		require.Zero(t, held, "a stopped relay released every bucket it announced")
		require.Equal(t, acquired, released)
		require.GreaterOrEqual(t, acquired, 4)

		require.Eventually(t, func() bool { return len(r2.Leases()) == 8 }, deliverWithin, 10*time.Millisecond)
		b.insert(t, keyed(keysN(20), 2)...)
		b.requireDrained(t)
		held, _, _ = tb.check(t)
		require.Equal(t, 8, held)
	})
}

// A fenced publish drops the bucket without deleting anything; when the
// relay still holds the lease in the database (the broker fenced it for
// another reason, a transaction timeout), it acquires the bucket again,
// announces it anew and publishes.
func TestStrictFencedRelayRecovers(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		store := &countingStore{crashStore: &crashStore{Store: b.store}}
		rows := b.insert(t, keyed([]string{"order-1"}, 3)...)
		bucket := int(rows[0].Bucket)
		tr := newLeaseTracker()
		var fenced atomic.Int32
		tr.fail = func(msgs []relay.Message) (int, error) {
			if fenced.Add(1) == 1 {
				return 0, relay.Fenced(errors.New("producer fenced"))
			}
			return 0, nil
		}
		r := startRelay(t, store, tr, fastConfig(t, "a"))
		b.requireDrained(t)
		require.GreaterOrEqual(t, fenced.Load(), int32(2))
		require.EqualValues(t, 1, store.deletes.Load(), "one delete, after the publish that succeeded")
		held, acquired, released := tr.check(t)
		require.Equal(t, 8, held)
		require.GreaterOrEqual(t, released, 1, "the fenced bucket was released to the publisher")
		require.Equal(t, acquired, held+released, "and acquired again")
		require.Contains(t, leaseBuckets(r.Leases()), bucket)
	})
}
