// Package storetest is the conformance suite of relay.Store and of each
// optional store capability the relay engine uses (relay.LeaseRenewer,
// relay.FailureRecorder, relay.BatchAdvancer, relay.BucketCounter,
// relay.StartChecker, relay.Prober). A store that passes it can be handed
// to relay.New.
//
// Run it from a test of your store with a Harness that creates an empty
// outbox and inserts messages into it the way your writers do:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, storetest.Harness{
//			New: func(t *testing.T, buckets int) relay.Store {
//				return newEmptyStore(t, buckets) // fresh tables, BucketCount buckets
//			},
//			Insert: func(t *testing.T, s relay.Store, msgs []relay.Message) {
//				insertCommitted(t, s, msgs) // in order, one committed transaction
//			},
//		})
//	}
//
// The suite checks what the engine relies on: oldest-first reads from the
// head of a bucket, deletes by id guarded by owner, term and expiry in the
// same statement, terms that grow on every acquisition, fair share across
// live relays, release and takeover of expired leases, an expired lease
// that stays lost to its owner (no renewal, no delete, a new term on a
// fresh claim), the bucket count check, each capability the store
// implements (a capability it does not implement is skipped and
// reported), and concurrent use for different buckets, which the engine's
// drainers do (run it with -race). Lease expiry is tested with leases of
// a few hundred milliseconds on the host's clock.
//
// RunOperator is the conformance suite of the operator API
// (ops.Operator), for a store that also offers the operator front ends.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// Harness creates the stores under test.
type Harness struct {
	// New returns the store of an empty outbox with buckets buckets
	// (fresh tables or state: no messages, leases or heartbeats), ready
	// for relay.New. Each call is a separate outbox.
	New func(t *testing.T, buckets int) relay.Store
	// Insert commits msgs to the outbox of s in order, as a writer would:
	// each with its Bucket, MessageID, Topic, Key, Value, Headers,
	// Partition and CreatedAt. ID and Attempts are the store's to assign.
	Insert func(t *testing.T, s relay.Store, msgs []relay.Message)
}

const (
	long  = time.Minute            // a lease that does not expire during a test
	short = 300 * time.Millisecond // a lease that does
)

// waitPast waits until more than d has passed since t0: long enough for
// a lease of d taken after t0 to have expired.
func waitPast(t *testing.T, t0 time.Time, d time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return time.Since(t0) > d }, 30*time.Second, 20*time.Millisecond)
}

// Run runs the suite. Every test is a subtest of t, run in parallel.
func Run(t *testing.T, h Harness) {
	t.Helper()
	require.NotNil(t, h.New, "Harness.New")
	require.NotNil(t, h.Insert, "Harness.Insert")
	tests := []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"NextBatch", testNextBatch},
		{"PendingBuckets", testPendingBuckets},
		{"AcquireLeases", testAcquire},
		{"FairShare", testFairShare},
		{"FairShareKeepsBusy", testFairShareBusy},
		{"BucketCountMismatch", testBucketCountMismatch},
		{"ReleaseLeases", testRelease},
		{"MarkPublished", testMarkPublished},
		{"MarkPublishedGuard", testMarkPublishedGuard},
		{"ExpiredLeaseTakenOver", testTakeover},
		{"ExpiredLeaseNotRenewed", testExpiredNotRenewed},
		{"LeaseRenewer", testRenewer},
		{"FailureRecorder", testRecorder},
		{"BatchAdvancer", testAdvancer},
		{"BatchSkipper", testSkipper},
		{"LargeBatches", testLargeBatches},
		{"BucketCounter", testBucketCounter},
		{"StartChecker", testStartChecker},
		{"Prober", testProber},
		{"Concurrent", testConcurrent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h)
		})
	}
}

// msgs returns n messages for bucket b, values "b/first..first+n-1".
func msgs(b, first, n int) []relay.Message {
	out := make([]relay.Message, n)
	now := time.UnixMilli(time.Now().UnixMilli())
	for i := range n {
		seq := first + i
		out[i] = relay.Message{
			MessageID: fmt.Sprintf("storetest-%d-%d-%d", b, seq, now.UnixNano()),
			Bucket:    b,
			Topic:     "storetest",
			Key:       fmt.Appendf(nil, "key-%d", seq%3),
			Value:     fmt.Appendf(nil, "%d/%d", b, seq),
			CreatedAt: now,
		}
	}
	return out
}

func values(ms []relay.Message) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = string(m.Value)
	}
	return out
}

func acquire(t *testing.T, s relay.Store, id string, buckets int, d time.Duration) relay.Acquired {
	t.Helper()
	res, err := s.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: id, BucketCount: buckets, LeaseDuration: d})
	require.NoError(t, err)
	return res
}

func leaseOf(t *testing.T, res relay.Acquired, bucket int) relay.Lease {
	t.Helper()
	for _, l := range res.Leases {
		if l.Bucket == bucket {
			return l
		}
	}
	t.Fatalf("bucket %d not among the leases %v", bucket, res.Leases)
	return relay.Lease{}
}

func bucketsOf(ls []relay.Lease) []int {
	out := make([]int, len(ls))
	for i, l := range ls {
		out[i] = l.Bucket
	}
	return out
}

func next(t *testing.T, s relay.Store, bucket, limit int) []relay.Message {
	t.Helper()
	ms, err := s.NextBatch(t.Context(), bucket, limit)
	require.NoError(t, err)
	return ms
}

func testNextBatch(t *testing.T, h Harness) {
	s := h.New(t, 4)
	part := int32(5)
	in := msgs(1, 0, 5)
	in[1].Key = nil         // keyless
	in[2].Key = []byte{}    // an empty key is a real key
	in[3].Value = nil       // a tombstone
	in[4].Partition = &part // pinned
	in[4].Headers = []relay.Header{{Key: "a", Value: []byte("1")}, {Key: "a", Value: []byte("2")}, {Key: "empty", Value: []byte{}}}
	h.Insert(t, s, in)
	h.Insert(t, s, msgs(3, 0, 2))

	got := next(t, s, 1, 3)
	require.Equal(t, []string{"1/0", "1/1", "1/2"}, values(got), "oldest first, at most limit")
	all := next(t, s, 1, 100)
	require.Len(t, all, 5)
	for i, m := range all {
		require.Equal(t, in[i].MessageID, m.MessageID, "submission order")
		require.Equal(t, 1, m.Bucket)
		require.Equal(t, "storetest", m.Topic)
		require.Equal(t, in[i].Value, m.Value, "message %d value", i)
		require.Equal(t, in[i].CreatedAt.UnixMilli(), m.CreatedAt.UnixMilli(), "message %d created at", i)
		require.Zero(t, m.Attempts)
		if i > 0 {
			require.Greater(t, m.ID, all[i-1].ID, "ids grow with submission")
		}
	}
	require.Equal(t, got, all[:3], "a read repeats from the head: no cursor")
	require.Nil(t, all[1].Key, "a keyless message keeps a nil key")
	require.NotNil(t, all[2].Key, "an empty key stays a key")
	require.Empty(t, all[2].Key)
	require.Nil(t, all[3].Value, "a tombstone keeps a nil value")
	require.NotNil(t, all[4].Partition)
	require.Equal(t, part, *all[4].Partition)
	require.Nil(t, all[0].Partition)
	require.Equal(t, in[4].Headers, all[4].Headers, "headers in order, duplicates kept")
	require.Empty(t, next(t, s, 0, 10), "an empty bucket")
	require.Equal(t, []string{"3/0", "3/1"}, values(next(t, s, 3, 10)), "buckets are separate")
}

func testPendingBuckets(t *testing.T, h Harness) {
	s := h.New(t, 8)
	h.Insert(t, s, msgs(6, 0, 1))
	h.Insert(t, s, msgs(2, 0, 3))
	h.Insert(t, s, msgs(7, 0, 1))
	got, err := s.PendingBuckets(t.Context(), []int{0, 1, 2, 3, 4, 5, 6, 7})
	require.NoError(t, err)
	require.Equal(t, []int{2, 6, 7}, got, "ascending")
	got, err = s.PendingBuckets(t.Context(), []int{7, 0, 2})
	require.NoError(t, err)
	require.Equal(t, []int{2, 7}, got, "only the buckets asked about")
	got, err = s.PendingBuckets(t.Context(), []int{0, 1})
	require.NoError(t, err)
	require.Empty(t, got)
	got, err = s.PendingBuckets(t.Context(), nil)
	require.NoError(t, err)
	require.Empty(t, got, "no bucket asked about")
}

func testAcquire(t *testing.T, h Harness) {
	s := h.New(t, 4)
	res := acquire(t, s, "a", 4, long)
	require.Equal(t, []int{0, 1, 2, 3}, bucketsOf(res.Leases), "a lone relay owns every bucket, by bucket")
	require.Equal(t, 1, res.LiveRelays)
	require.Equal(t, 4, res.FairShare)
	again := acquire(t, s, "a", 4, long)
	require.Equal(t, res.Leases, again.Leases, "renewing keeps the terms")
	require.NoError(t, s.ReleaseLeases(t.Context(), "a", res.Leases))
	third := acquire(t, s, "a", 4, long)
	for i, l := range third.Leases {
		require.Greater(t, l.Term, res.Leases[i].Term, "bucket %d: a new acquisition has a new term", l.Bucket)
	}
}

func testFairShare(t *testing.T, h Harness) {
	s := h.New(t, 8)
	a := acquire(t, s, "a", 8, long)
	require.Len(t, a.Leases, 8)
	b := acquire(t, s, "b", 8, long)
	require.Equal(t, 2, b.LiveRelays)
	require.Equal(t, 4, b.FairShare)
	require.Empty(t, b.Leases, "every bucket is held by a until it gives up its surplus")
	a = acquire(t, s, "a", 8, long)
	require.Len(t, a.Leases, 4, "a releases what is above its fair share")
	b = acquire(t, s, "b", 8, long)
	require.Len(t, b.Leases, 4, "and b claims it")
	owned := append(bucketsOf(a.Leases), bucketsOf(b.Leases)...)
	slices.Sort(owned)
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, owned, "every bucket has exactly one owner")
	c := acquire(t, s, "c", 8, long)
	require.Equal(t, 3, c.LiveRelays)
	require.Equal(t, 3, c.FairShare)
}

// testFairShareBusy: a lease named in AcquireRequest.Busy is never
// released, however far above its fair share the relay is; the surplus
// comes from the others, and the rest goes once the batches are done.
func testFairShareBusy(t *testing.T, h Harness) {
	s := h.New(t, 8)
	require.Len(t, acquire(t, s, "a", 8, long).Leases, 8)
	acquire(t, s, "b", 8, long) // a second live relay: a's fair share is 4
	busy := []int{1, 3, 5, 6, 7}
	res, err := s.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: "a", BucketCount: 8, LeaseDuration: long, Busy: busy})
	require.NoError(t, err)
	require.Equal(t, 4, res.FairShare)
	require.Equal(t, busy, bucketsOf(res.Leases), "every busy lease is kept and renewed; every other one is surplus")
	b := acquire(t, s, "b", 8, long)
	require.Equal(t, []int{0, 2, 4}, bucketsOf(b.Leases), "b claims what a released")
	res, err = s.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: "a", BucketCount: 8, LeaseDuration: long, Busy: []int{7}})
	require.NoError(t, err)
	require.Len(t, res.Leases, 4, "once the batches are done, a gives up the rest of its surplus")
	require.Contains(t, bucketsOf(res.Leases), 7)
}

func testBucketCountMismatch(t *testing.T, h Harness) {
	s := h.New(t, 4)
	_, err := s.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: "a", BucketCount: 8, LeaseDuration: long})
	var me *relay.MisconfigurationError
	require.ErrorAs(t, err, &me, "a relay with another BucketCount is refused")
	require.ErrorIs(t, err, relay.ErrMisconfigured)
}

func testRelease(t *testing.T, h Harness) {
	s := h.New(t, 4)
	a := acquire(t, s, "a", 4, long)
	require.Len(t, a.Leases, 4)
	// The relay lists only the leases it knows of; a claim whose reply it
	// never saw leaves others it owns, and those are released too.
	require.NoError(t, s.ReleaseLeases(t.Context(), "a", a.Leases[:1]))
	b := acquire(t, s, "b", 4, long)
	require.Len(t, b.Leases, 4, "every lease of a is released and claimed at once, and a's heartbeat is gone")
	require.Equal(t, 1, b.LiveRelays)
	// A lease another relay took over is left alone.
	require.NoError(t, s.ReleaseLeases(t.Context(), "a", a.Leases), "releasing leases taken over is no error")
	require.Empty(t, acquire(t, s, "c", 4, long).Leases, "and releases nothing of b's")
	require.NoError(t, s.ReleaseLeases(t.Context(), "d", nil), "a relay holding nothing")
}

func testMarkPublished(t *testing.T, h Harness) {
	s := h.New(t, 2)
	h.Insert(t, s, msgs(1, 0, 5))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	batch := next(t, s, 1, 5)
	// Ids, never a range: deleting 0, 1 and 3 leaves 2 and 4.
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, []relay.Message{batch[0], batch[1], batch[3]}))
	require.Equal(t, []string{"1/2", "1/4"}, values(next(t, s, 1, 10)))
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, batch[:2]), "rows already gone are no error")
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, nil))
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, []relay.Message{batch[2], batch[4]}))
	require.Empty(t, next(t, s, 1, 10))
}

func testMarkPublishedGuard(t *testing.T, h Harness) {
	s := h.New(t, 2)
	h.Insert(t, s, msgs(0, 0, 3))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 0)
	batch := next(t, s, 0, 3)
	for _, tc := range []struct {
		name  string
		id    string
		lease relay.Lease
	}{
		{"another owner", "b", l},
		{"an older term", "a", relay.Lease{Bucket: 0, Term: l.Term - 1}},
		{"a newer term", "a", relay.Lease{Bucket: 0, Term: l.Term + 1}},
	} {
		err := s.MarkPublished(t.Context(), tc.id, tc.lease, batch[:1])
		require.ErrorIs(t, err, relay.ErrLeaseLost, tc.name)
		require.Len(t, next(t, s, 0, 10), 3, "%s: nothing deleted", tc.name)
	}
	// Another bucket's lease deletes nothing of this one.
	other := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	_ = s.MarkPublished(t.Context(), "a", other, batch[:1])
	require.Len(t, next(t, s, 0, 10), 3, "another bucket's lease deletes nothing")
	require.NoError(t, s.ReleaseLeases(t.Context(), "a", []relay.Lease{l}))
	require.ErrorIs(t, s.MarkPublished(t.Context(), "a", l, batch[:1]), relay.ErrLeaseLost, "a released lease")
	require.Len(t, next(t, s, 0, 10), 3)
}

func testTakeover(t *testing.T, h Harness) {
	s := h.New(t, 1)
	h.Insert(t, s, msgs(0, 0, 2))
	a := leaseOf(t, acquire(t, s, "a", 1, short), 0)
	batch := next(t, s, 0, 2)
	// b waits for the lease to expire, then claims it under a new term.
	var b relay.Lease
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		res, err := s.AcquireLeases(context.Background(), relay.AcquireRequest{RelayID: "b", BucketCount: 1, LeaseDuration: long})
		if assert.NoError(c, err) && assert.Len(c, res.Leases, 1) {
			b = res.Leases[0]
		}
	}, 30*time.Second, 20*time.Millisecond)
	require.Greater(t, b.Term, a.Term)
	require.ErrorIs(t, s.MarkPublished(t.Context(), "a", a, batch), relay.ErrLeaseLost, "the old owner cannot delete")
	require.Len(t, next(t, s, 0, 10), 2)
	res := acquire(t, s, "a", 1, short)
	require.Empty(t, res.Leases, "nor take the bucket back while b holds it")
	require.NoError(t, s.MarkPublished(t.Context(), "b", b, batch))
	require.Empty(t, next(t, s, 0, 10))
}

// An expired lease is lost even when no other relay took the bucket:
// its owner can neither renew it nor delete under it, and claiming the
// bucket again gives a new term, under which alone it deletes.
func testExpiredNotRenewed(t *testing.T, h Harness) {
	s := h.New(t, 1)
	h.Insert(t, s, msgs(0, 0, 2))
	l := leaseOf(t, acquire(t, s, "a", 1, short), 0)
	acquired := time.Now()
	batch := next(t, s, 0, 2)
	waitPast(t, acquired, 2*short)
	if rn, ok := s.(relay.LeaseRenewer); ok {
		kept, err := rn.RenewLeases(t.Context(), "a", []relay.Lease{l}, long)
		require.NoError(t, err)
		require.Empty(t, kept, "an expired lease is not renewed")
	}
	require.ErrorIs(t, s.MarkPublished(t.Context(), "a", l, batch), relay.ErrLeaseLost, "nor deleted under")
	require.Len(t, next(t, s, 0, 10), 2)
	again := leaseOf(t, acquire(t, s, "a", 1, long), 0)
	require.Greater(t, again.Term, l.Term, "claimed again under a new term")
	require.ErrorIs(t, s.MarkPublished(t.Context(), "a", l, batch), relay.ErrLeaseLost, "the old term stays lost")
	require.NoError(t, s.MarkPublished(t.Context(), "a", again, batch))
	require.Empty(t, next(t, s, 0, 10))
}

// testProber: a store that answers probes healthy, and a probe under an
// ended context fails.
func testProber(t *testing.T, h Harness) {
	s := h.New(t, 2)
	p, ok := s.(relay.Prober)
	if !ok {
		t.Skip("the store does not implement relay.Prober")
	}
	require.NoError(t, p.Probe(t.Context()))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.Error(t, p.Probe(ctx), "a probe under an ended context")
}

func testRenewer(t *testing.T, h Harness) {
	s := h.New(t, 2)
	rn, ok := s.(relay.LeaseRenewer)
	if !ok {
		t.Skip("the store does not implement relay.LeaseRenewer")
	}
	h.Insert(t, s, msgs(0, 0, 1))
	res := acquire(t, s, "a", 2, long)
	require.Len(t, res.Leases, 2)
	stale := relay.Lease{Bucket: 1, Term: res.Leases[1].Term + 1}
	kept, err := rn.RenewLeases(t.Context(), "a", []relay.Lease{res.Leases[0], stale}, long)
	require.NoError(t, err)
	require.Equal(t, []relay.Lease{res.Leases[0]}, kept, "a lease not held under its term is not renewed")
	kept, err = rn.RenewLeases(t.Context(), "b", res.Leases, long)
	require.NoError(t, err)
	require.Empty(t, kept, "nor one held by another relay")
	// A renewal extends a lease to now + d but never shortens it: bucket
	// 0, held for a minute and renewed for a moment, is still held once
	// the moment has passed, and b finds both buckets taken.
	shortened := time.Now()
	kept, err = rn.RenewLeases(t.Context(), "a", res.Leases[:1], short)
	require.NoError(t, err)
	require.Equal(t, res.Leases[:1], kept, "a lease already held for longer is held")
	waitPast(t, shortened, 2*short)
	other, err := s.AcquireLeases(t.Context(), relay.AcquireRequest{RelayID: "b", BucketCount: 2, LeaseDuration: long})
	require.NoError(t, err)
	require.Empty(t, other.Leases, "b takes nothing: a renewal for a moment did not shorten the minute")
	kept, err = rn.RenewLeases(t.Context(), "a", res.Leases, long)
	require.NoError(t, err)
	require.Equal(t, res.Leases, kept)
	require.NoError(t, s.MarkPublished(t.Context(), "a", res.Leases[0], next(t, s, 0, 1)))
}

func testRecorder(t *testing.T, h Harness) {
	s := h.New(t, 2)
	rec, ok := s.(relay.FailureRecorder)
	if !ok {
		t.Skip("the store does not implement relay.FailureRecorder")
	}
	h.Insert(t, s, msgs(1, 0, 2))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	batch := next(t, s, 1, 2)
	cause := errors.New("broker said no")
	require.NoError(t, rec.RecordFailure(t.Context(), "a", l, batch[0], cause))
	require.NoError(t, rec.RecordFailure(t.Context(), "a", l, batch[0], cause))
	got := next(t, s, 1, 2)
	require.Equal(t, 2, got[0].Attempts, "attempts counted on the message")
	require.Zero(t, got[1].Attempts, "and only on it")
	require.ErrorIs(t, rec.RecordFailure(t.Context(), "b", l, batch[0], cause), relay.ErrLeaseLost, "guarded by the lease")
	require.Equal(t, 2, next(t, s, 1, 1)[0].Attempts)
}

func testAdvancer(t *testing.T, h Harness) {
	s := h.New(t, 2)
	adv, ok := s.(relay.BatchAdvancer)
	if !ok {
		t.Skip("the store does not implement relay.BatchAdvancer")
	}
	h.Insert(t, s, msgs(1, 0, 7))
	h.Insert(t, s, msgs(0, 0, 1))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	first := next(t, s, 1, 3)

	_, err := adv.MarkPublishedNext(t.Context(), "b", l, first, 3)
	require.ErrorIs(t, err, relay.ErrLeaseLost, "guarded like MarkPublished")
	_, err = adv.MarkPublishedNext(t.Context(), "a", relay.Lease{Bucket: 1, Term: l.Term + 1}, first, 3)
	require.ErrorIs(t, err, relay.ErrLeaseLost)
	require.Len(t, next(t, s, 1, 10), 7, "a refused call deletes nothing")

	second, err := adv.MarkPublishedNext(t.Context(), "a", l, first, 3)
	require.NoError(t, err)
	require.Equal(t, []string{"1/3", "1/4", "1/5"}, values(second), "the next batch, from the head, without the deleted ones")
	require.Equal(t, values(next(t, s, 1, 3)), values(second), "what NextBatch reads after the delete")
	require.Equal(t, next(t, s, 1, 3), second, "with every field")

	// Ids, never a range, here too.
	third, err := adv.MarkPublishedNext(t.Context(), "a", l, []relay.Message{second[0], second[2]}, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"1/4", "1/6"}, values(third))
	last, err := adv.MarkPublishedNext(t.Context(), "a", l, third, 10)
	require.NoError(t, err)
	require.NotNil(t, last, "an empty bucket reads as an empty, non-nil batch")
	require.Empty(t, last)
	require.Empty(t, next(t, s, 1, 10))
	require.Len(t, next(t, s, 0, 10), 1, "other buckets untouched")
}

func testSkipper(t *testing.T, h Harness) {
	s := h.New(t, 2)
	sk, ok := s.(relay.BatchSkipper)
	if !ok {
		t.Skip("the store does not implement relay.BatchSkipper")
	}
	h.Insert(t, s, msgs(1, 0, 7))
	h.Insert(t, s, msgs(0, 0, 1))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	first := next(t, s, 1, 3)

	got, err := sk.NextBatchExcept(t.Context(), 1, 3, first)
	require.NoError(t, err)
	require.Equal(t, []string{"1/3", "1/4", "1/5"}, values(got), "the next batch, from the head, without the batch left out")
	require.Len(t, next(t, s, 1, 10), 7, "reads only")
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, first))
	require.Equal(t, next(t, s, 1, 3), got, "what NextBatch reads once the batch is deleted, with every field")

	// Ids, never a range: what is not left out is read, holes and all.
	rest := next(t, s, 1, 10)
	got, err = sk.NextBatchExcept(t.Context(), 1, 10, []relay.Message{rest[0], rest[2]})
	require.NoError(t, err)
	require.Equal(t, []string{"1/4", "1/6"}, values(got))
	got, err = sk.NextBatchExcept(t.Context(), 1, 10, rest)
	require.NoError(t, err)
	require.NotNil(t, got, "nothing left reads as an empty, non-nil batch")
	require.Empty(t, got)
	got, err = sk.NextBatchExcept(t.Context(), 0, 10, rest)
	require.NoError(t, err)
	require.Len(t, got, 1, "other buckets: their own rows")

	// Hundreds left out, with holes among the ids.
	h.Insert(t, s, msgs(1, 100, 900))
	all := next(t, s, 1, 1000)
	require.Len(t, all, 904)
	var odd []relay.Message
	for i := 1; i < 801; i += 2 {
		odd = append(odd, all[i])
	}
	got, err = sk.NextBatchExcept(t.Context(), 1, 500, odd)
	require.NoError(t, err)
	if got != nil { // nil: the store reads nothing past so many ids
		require.Len(t, got, 500)
		require.Equal(t, values(all[0:1]), values(got[:1]))
		require.Equal(t, values(all[2:3]), values(got[1:2]), "ids, never a range")
		require.Equal(t, values(all[800:900]), values(got[400:]))
	}
}

// interleaved returns, in one slice to insert at once, n messages of each
// of buckets taken in turn (b0/0, b1/0, ..., b0/1, b1/1, ...), so that
// the buckets' ids interleave.
func interleaved(buckets []int, n int) []relay.Message {
	var out []relay.Message
	for seq := range n {
		for _, b := range buckets {
			out = append(out, msgs(b, seq, 1)...)
		}
	}
	return out
}

// testLargeBatches deletes and reads ahead batches of hundreds of
// messages, sizes at which a store may build its statements another way
// than for a few, with holes among the ids.
func testLargeBatches(t *testing.T, h Harness) {
	s := h.New(t, 2)
	h.Insert(t, s, msgs(1, 0, 900))
	l := leaseOf(t, acquire(t, s, "a", 2, long), 1)
	batch := next(t, s, 1, 500)
	require.Len(t, batch, 500)
	var odd []relay.Message
	for i := 1; i < len(batch); i += 2 {
		odd = append(odd, batch[i])
	}
	require.ErrorIs(t, s.MarkPublished(t.Context(), "b", l, odd), relay.ErrLeaseLost, "guarded")
	require.Len(t, next(t, s, 1, 1000), 900, "a refused delete deletes nothing")
	require.NoError(t, s.MarkPublished(t.Context(), "a", l, odd))
	rest := next(t, s, 1, 1000)
	require.Len(t, rest, 650)
	require.Equal(t, "1/0", string(rest[0].Value))
	require.Equal(t, "1/2", string(rest[1].Value), "ids, never a range")

	adv, ok := s.(relay.BatchAdvancer)
	if !ok {
		return
	}
	head := rest[:400]
	_, err := adv.MarkPublishedNext(t.Context(), "b", l, head, 300)
	require.ErrorIs(t, err, relay.ErrLeaseLost, "guarded like MarkPublished")
	require.Len(t, next(t, s, 1, 1000), 650, "a refused call deletes nothing")
	got, err := adv.MarkPublishedNext(t.Context(), "a", l, head, 300)
	require.NoError(t, err)
	require.Equal(t, values(rest[400:650]), values(got), "the next batch, from the head, without the deleted ones")
	require.Equal(t, next(t, s, 1, 300), got, "what NextBatch reads after the delete")
}

func testBucketCounter(t *testing.T, h Harness) {
	s := h.New(t, 16)
	bc, ok := s.(relay.BucketCounter)
	if !ok {
		t.Skip("the store does not implement relay.BucketCounter")
	}
	require.Equal(t, 16, bc.BucketCount())
}

func testStartChecker(t *testing.T, h Harness) {
	s := h.New(t, 4)
	sc, ok := s.(relay.StartChecker)
	if !ok {
		t.Skip("the store does not implement relay.StartChecker")
	}
	require.NoError(t, sc.CheckStart(t.Context(), 4))
	err := sc.CheckStart(t.Context(), 8)
	var me *relay.MisconfigurationError
	require.ErrorAs(t, err, &me, "another BucketCount is a misconfiguration")
}

// testConcurrent drains every bucket at once, one goroutine per bucket as
// the engine's drainers do, while leases are renewed and discovery runs
// alongside: everything is deleted exactly once.
func testConcurrent(t *testing.T, h Harness) {
	const buckets, perBucket, batch = 8, 60, 7
	s := h.New(t, buckets)
	for b := range buckets {
		h.Insert(t, s, msgs(b, 0, perBucket))
	}
	res := acquire(t, s, "a", buckets, long)
	require.Len(t, res.Leases, buckets)
	adv, _ := s.(relay.BatchAdvancer)
	rn, _ := s.(relay.LeaseRenewer)
	ctx := t.Context()
	var wg sync.WaitGroup
	errs := make(chan error, buckets+2)
	seen := make([][]string, buckets)
	done := make(chan struct{})
	for _, l := range res.Leases {
		wg.Go(func() {
			ms, err := s.NextBatch(ctx, l.Bucket, batch)
			for err == nil && len(ms) > 0 {
				seen[l.Bucket] = append(seen[l.Bucket], values(ms)...)
				if adv != nil && len(seen[l.Bucket])%2 == 0 {
					ms, err = adv.MarkPublishedNext(ctx, "a", l, ms, batch)
					if err == nil && ms == nil {
						ms, err = s.NextBatch(ctx, l.Bucket, batch)
					}
					continue
				}
				if err = s.MarkPublished(ctx, "a", l, ms); err == nil {
					ms, err = s.NextBatch(ctx, l.Bucket, batch)
				}
			}
			if err != nil {
				errs <- fmt.Errorf("bucket %d: %w", l.Bucket, err)
			}
		})
	}
	var side sync.WaitGroup
	side.Go(func() {
		all := []int{0, 1, 2, 3, 4, 5, 6, 7}
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := s.PendingBuckets(ctx, all); err != nil {
				errs <- fmt.Errorf("pending buckets: %w", err)
				return
			}
			if rn != nil {
				if _, err := rn.RenewLeases(ctx, "a", res.Leases, long); err != nil {
					errs <- fmt.Errorf("renew: %w", err)
					return
				}
			}
		}
	})
	wg.Wait()
	close(done)
	side.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for b := range buckets {
		require.Equal(t, values(msgs(b, 0, perBucket)), seen[b], "bucket %d: every message once, in order", b)
	}
	pending, err := s.PendingBuckets(ctx, []int{0, 1, 2, 3, 4, 5, 6, 7})
	require.NoError(t, err)
	require.Empty(t, pending)
}
