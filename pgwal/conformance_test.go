package pgwal_test

// The WAL source's conformance to what the relay's store contract
// (relay/storetest) checks, where it applies. The reader publishes
// through the relay engine over a relay.Store of its own (source.go):
// the buckets are the decoded messages' in-memory queues, and the one
// lease of the slot stands for every bucket's lease under the reader's
// term. What carries over, and where it is tested:
//
//   - oldest first per bucket, no message skipped: per key in commit
//     order (TestConformanceCommitOrderPerKey, TestReaderPublishesInOrder,
//     TestEngineBucketsInParallel);
//   - a guarded acknowledgement (MarkPublishedGuard): MarkPublished under
//     a stale term, or after the stream ended or its lease lapsed, takes
//     nothing out of the queues and moves no position
//     (TestSourceTermGuard, TestSourceLeaseLapses); the position is
//     confirmed only up to the first message neither published nor
//     dead-lettered (TestReaderBackpressure,
//     TestReaderKilledMidStreamLosesNothing);
//   - at least once across a reader's death (ExpiredLeaseTakenOver):
//     TestReaderKilledMidStreamLosesNothing, and in test/chaos
//     TestChaosWAL;
//   - terms that grow on every acquisition, the lease waited for while
//     held, taken over once it lapsed: TestConformanceTakeoverTerms,
//     TestReaderSecondReaderWaits;
//   - the failure recorder's attempts and the failure policy's dead
//     letters, a key parked behind its dead letter, requeue in order
//     (FailureRecorder, RunOperator's RequeueKeyKeepsOrder):
//     TestReaderFailures, with the engine's observer events;
//   - hints (relay.Hints) wake the engine for a bucket without a poll:
//     TestEngineHintsPublishWithoutPoll.
//
// What does not apply: FairShare and FairShareKeepsBusy (one reader reads
// the slot and owns every bucket), LargeBatches (the server streams;
// MaxPending bounds the messages waiting: TestReaderBackpressure),
// BatchAdvancer and StartChecker (capabilities of a table store),
// BucketCountMismatch at start (a message in a bucket beyond BucketCount
// stops the reader with a *relay.MisconfigurationError when it is
// decoded; there is no stored bucket count to compare at start).

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/relay"
)

// TestConformanceCommitOrderPerKey: transactions that write the same keys
// and commit in another order than they began are published in commit
// order, each key's messages in the order their transactions committed.
func TestConformanceCommitOrderPerKey(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	rng := rand.New(rand.NewPCG(1, 2))
	const rounds, open, keys = 8, 4, 3
	want := map[string][]string{}
	for round := range rounds {
		txs := make([]*gorm.DB, open)
		for i := range txs {
			txs[i] = e.db.DB.Begin()
			require.NoError(t, txs[i].Error)
			for k := range keys {
				key := "k" + strconv.Itoa(k)
				v := key + "/" + strconv.Itoa(round) + "." + strconv.Itoa(i)
				require.NoError(t, outbox.Enqueue(txs[i], &outbox.Message{Topic: e.topic, Key: []byte(key), Value: []byte(v)}))
			}
		}
		for _, i := range rng.Perm(open) {
			require.NoError(t, txs[i].Commit().Error)
			for k := range keys {
				key := "k" + strconv.Itoa(k)
				want[key] = append(want[key], key+"/"+strconv.Itoa(round)+"."+strconv.Itoa(i))
			}
		}
	}
	var got map[string][]string
	require.Eventually(t, func() bool {
		got = map[string][]string{}
		n := 0
		for _, rec := range e.kafka.ReadLog(t, e.topic, 30*time.Second) {
			got[string(rec.Key)] = append(got[string(rec.Key)], string(rec.Value))
			n++
		}
		return n == rounds*open*keys
	}, 60*time.Second, 50*time.Millisecond)
	require.Equal(t, want, got, "each key in commit order, once")
	require.NoError(t, stop())
}

// leaseLog is a publisher that records the leases a reader announces.
type leaseLog struct {
	relay.Publisher
	mu       sync.Mutex
	acquired []relay.Lease
	released []relay.Lease
}

func (l *leaseLog) LeasesAcquired(_ context.Context, ls []relay.Lease) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.acquired = append(l.acquired, ls...)
	return nil
}

func (l *leaseLog) LeasesReleased(_ context.Context, ls []relay.Lease) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.released = append(l.released, ls...)
}

func (l *leaseLog) terms() (acquired, released []int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, x := range l.acquired {
		acquired = append(acquired, x.Term)
	}
	for _, x := range l.released {
		released = append(released, x.Term)
	}
	return acquired, released
}

// TestConformanceTakeoverTerms: a reader that dies holding the lease is
// taken over once the lease lapses, not before; the new reader's term is
// larger, every bucket is announced to the publisher under it, and the
// dead reader's buckets were released under the old term; nothing is
// lost across the takeover.
func TestConformanceTakeoverTerms(t *testing.T) {
	e := setup(t)
	la, lb := &leaseLog{Publisher: e.pub}, &leaseLog{Publisher: e.pub}
	a := e.reader(t, la, "a")
	b := e.reader(t, lb, "b")
	stopA := run(a)
	e.write(t, 3, 0, 10)
	e.checkDelivered(t, 3, 10)
	stopB := run(b)
	e.write(t, 3, 10, 20)
	e.checkDelivered(t, 3, 20)
	require.Zero(t, b.Stats().Received, "the lease is held: the other reader waits")
	require.NoError(t, stopA()) // dies: the lease is left to lapse
	e.write(t, 3, 20, 30)
	e.checkDelivered(t, 3, 30)
	require.NotZero(t, b.Stats().Published, "the other reader took over")

	buckets := e.plugin.Config().BucketCount
	aAcq, aRel := la.terms()
	bAcq, _ := lb.terms()
	require.Len(t, aAcq, buckets)
	require.Equal(t, aAcq, aRel, "the dead reader's buckets were released under its term")
	require.Len(t, bAcq, buckets, "every bucket announced to the new reader's publisher")
	require.Greater(t, bAcq[0], aAcq[0], "the takeover's term is larger")
	for _, term := range bAcq {
		require.Equal(t, bAcq[0], term, "one term for the whole slot")
	}
	require.NoError(t, stopB())
}

// slowFence is a publisher whose LeasesAcquired takes a while, as the
// strict-mode publisher's fencing does on a cluster that is recovering.
type slowFence struct {
	leaseLog
	wait time.Duration
}

func (s *slowFence) LeasesAcquired(ctx context.Context, ls []relay.Lease) error {
	select {
	case <-time.After(s.wait):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.leaseLog.LeasesAcquired(ctx, ls)
}

// TestConformanceLeaseKeptWhilePublisherPrepares: the reader keeps its
// lease while the publisher prepares for longer than the lease lasts:
// the waiting reader does not take the slot over (it could not stream
// it anyway while the first holds it), and the first reads under the
// term it acquired.
func TestConformanceLeaseKeptWhilePublisherPrepares(t *testing.T) {
	e := setup(t)
	slow := &slowFence{leaseLog: leaseLog{Publisher: e.pub}, wait: 4 * time.Second}
	a := e.reader(t, slow, "a")
	lb := &leaseLog{Publisher: e.pub}
	b := e.reader(t, lb, "b")
	stopA := run(a)
	require.Eventually(t, func() bool { return a.Stats().Confirmed > 0 || slotActive(e.db.DB, a.Config().Slot) }, 30*time.Second, 10*time.Millisecond)
	stopB := run(b)
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)
	// Its first standby update succeeds: the lease is still its own.
	require.Eventually(t, func() bool { return a.Stats().Confirmed > 0 }, 30*time.Second, 10*time.Millisecond)
	e.write(t, 2, 10, 20)
	e.checkDelivered(t, 2, 20)
	acquired, _ := slow.terms()
	require.Len(t, acquired, e.plugin.Config().BucketCount, "one term: the lease was not lost while the publisher prepared")
	bAcq, _ := lb.terms()
	require.Empty(t, bAcq, "the waiting reader never took the lease")
	require.Zero(t, b.Stats().Received)
	require.NoError(t, stopB())
	require.NoError(t, stopA())
}

func slotActive(db *gorm.DB, slot string) bool {
	var n int64
	_ = db.Raw("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ? AND active", slot).Scan(&n).Error
	return n > 0
}
