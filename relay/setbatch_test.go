package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// batchBuckets returns the distinct buckets of a batch, in order of first
// appearance.
func batchBuckets(msgs []relay.Message) []int {
	var bs []int
	for _, m := range msgs {
		if !slices.Contains(bs, m.Bucket) {
			bs = append(bs, m.Bucket)
		}
	}
	return bs
}

// requireInOrder checks that the publishes, taken together, carried each
// bucket's messages "b/0", "b/1", ... in order, each batch grouped by
// bucket, and returns how many each bucket had.
func requireInOrder(t *testing.T, log *pubLog) map[int]int {
	t.Helper()
	next := map[int]int{}
	for i := range log.n() {
		call := log.call(i)
		for j, m := range call {
			if j > 0 && m.Bucket != call[j-1].Bucket {
				require.NotContains(t, batchBuckets(call[:j]), m.Bucket, "a batch is grouped by bucket")
			}
			require.Equal(t, fmt.Sprintf("%d/%d", m.Bucket, next[m.Bucket]), string(m.Value), "bucket %d in order", m.Bucket)
			next[m.Bucket]++
		}
	}
	return next
}

// filled returns a store of buckets buckets with n messages in each of
// the first k, added bucket after bucket.
func filled(buckets, k, n int) *fakeStore {
	s := newFakeStore(buckets)
	for b := range k {
		s.add(b, n)
	}
	return s
}

// With MaxBatchBuckets above 1, ready buckets are drained together: one
// read, one publish and one delete for all of them, every bucket's
// messages in order. By default (1) every batch is one bucket's, as with
// a store that cannot span buckets.
func TestSetBatchSpansReadyBuckets(t *testing.T) {
	t.Parallel()
	for _, maxSet := range []int{0, 1, 3, 64} {
		t.Run(fmt.Sprintf("MaxBatchBuckets=%d", maxSet), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := filled(8, 8, 5)
				var log pubLog
				cfg := config("a")
				cfg.Parallelism = 1
				cfg.BatchSize = 100
				cfg.MaxBatchBuckets = maxSet
				r, err := relay.New(advancingStore{s}, log.publisher(nil), cfg)
				require.NoError(t, err)
				n, err := r.DrainOnce(t.Context())
				require.NoError(t, err)
				require.Equal(t, 40, n)
				require.Zero(t, s.pending())
				got := requireInOrder(t, &log)
				for b := range 8 {
					require.Equal(t, 5, got[b], "bucket %d", b)
				}
				widest := 0
				for i := range log.n() {
					widest = max(widest, len(batchBuckets(log.call(i))))
				}
				switch maxSet {
				case 64: // every ready bucket at once
					require.Equal(t, 1, log.n(), "one publish for the 8 ready buckets")
					require.Equal(t, 8, widest)
					require.Zero(t, s.count("batch"), "no bucket read on its own")
					require.Zero(t, s.count("mark"))
				case 0, 1: // the default is 1
					require.Equal(t, 1, widest)
					require.Zero(t, s.count("setbatch"))
					require.Zero(t, s.count("setmark"))
				default:
					require.Equal(t, 3, widest, "at most MaxBatchBuckets per batch")
					require.Equal(t, 3, log.n(), "8 buckets in sets of 3, 3 and 2")
				}
			})
		})
	}
}

// A set batch is cut at BatchSize in id order across its buckets: each
// bucket's part is its oldest messages, and the rest follow in the next
// batches, in order. The batch is published bucket by bucket.
func TestSetBatchCutInIDOrder(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(4)
		for range 10 { // ids interleave across the buckets
			for b := range 4 {
				s.add(b, 1)
			}
		}
		var log pubLog
		cfg := config("a")
		cfg.BucketCount = 4
		cfg.Parallelism = 1
		cfg.BatchSize = 7
		cfg.MaxBatchBuckets = 64
		r, err := relay.New(advancingStore{s}, log.publisher(nil), cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 40, n)
		var ids []int64
		for _, m := range log.call(0) {
			ids = append(ids, m.ID)
		}
		slices.Sort(ids)
		require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7}, ids, "the 7 oldest ids of the set")
		got := requireInOrder(t, &log)
		for b := range 4 {
			require.Equal(t, 10, got[b])
		}
	})
}

// A set batch that fails deletes its acknowledged prefix and hands its
// buckets back solo: the failure policy meets the culprit in its own
// bucket's batch, under that bucket's lease, and only there; the other
// buckets are drained.
func TestSetBatchFailureMeetsPolicySolo(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := filled(4, 4, 3)
		culprit := errors.New("record rejected")
		var log pubLog
		pub := log.publisher(func(ctx context.Context, msgs []relay.Message) (int, error) {
			for i, m := range msgs {
				if string(m.Value) == "2/1" {
					return i, relay.Permanent(culprit)
				}
			}
			return len(msgs), nil
		})
		var (
			mu       sync.Mutex
			failures []relay.Failure
		)
		cfg := config("a")
		cfg.BucketCount = 4
		cfg.Parallelism = 1
		cfg.BatchSize = 100
		cfg.MaxBatchBuckets = 64
		cfg.FailureHandler = relay.FailureHandlerFunc(func(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
			mu.Lock()
			defer mu.Unlock()
			failures = append(failures, f)
			return relay.FailureBackoff, nil
		})
		r, err := relay.New(advancingStore{s}, pub, cfg)
		require.NoError(t, err)
		_, err = r.DrainOnce(t.Context())
		require.ErrorIs(t, err, culprit, "DrainOnce reports the bucket that failed")

		require.Greater(t, len(batchBuckets(log.call(0))), 1, "the first batch spanned the buckets")
		mu.Lock()
		require.Len(t, failures, 1, "only the culprit's own batch meets the failure policy")
		f := failures[0]
		mu.Unlock()
		require.Equal(t, 2, f.Lease.Bucket)
		require.Equal(t, "2/1", string(f.Message.Value))
		require.Zero(t, f.Acked, "its own batch starts at it: the set batch acknowledged and deleted 2/0")

		s.mu.Lock()
		left := slices.Clone(s.msgs[2])
		others := len(s.msgs[0]) + len(s.msgs[1]) + len(s.msgs[3])
		s.mu.Unlock()
		require.Zero(t, others, "the other buckets are drained")
		require.Len(t, left, 2, "bucket 2 keeps the culprit and what follows it")
		require.Equal(t, "2/1", string(left[0].Value))
		require.Greater(t, s.count("batch"), 0, "the buckets were read on their own after the failure")
	})
}

// A bucket whose lease is taken over during a set batch's publish deletes
// nothing; the other buckets of the batch delete theirs, and the relay
// drops only that bucket.
func TestSetBatchLostBucketDeletesNothing(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := filled(4, 4, 3)
		var once sync.Once
		pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			once.Do(func() {
				// Another relay takes bucket 1 over while the batch is
				// published.
				s.mu.Lock()
				l := s.leases[1]
				s.leases[1] = fakeLease{owner: "b", term: l.term + 1, expires: time.Now().Add(time.Hour)}
				s.mu.Unlock()
			})
			return len(msgs), nil
		})
		cfg := config("a")
		cfg.BucketCount = 4
		cfg.Parallelism = 1
		cfg.BatchSize = 100
		cfg.MaxBatchBuckets = 64
		r, err := relay.New(advancingStore{s}, pub, cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		var notOwned *relay.NotOwnedError
		require.ErrorAs(t, err, &notOwned, "bucket 1 is left to its new owner")
		require.Equal(t, []int{1}, notOwned.Buckets)
		require.Equal(t, 9, n, "the messages of the three buckets still held")
		s.mu.Lock()
		defer s.mu.Unlock()
		require.Len(t, s.msgs[1], 3, "bucket 1's rows are its new owner's")
		require.Empty(t, s.msgs[0])
		require.Empty(t, s.msgs[2])
		require.Empty(t, s.msgs[3])
		require.Equal(t, 1, s.calls["setmark"])
	})
}

// leaseAwareFunc is a LeaseAware publisher, as the strict-mode one is.
type leaseAwareFunc struct{ relay.PublisherFunc }

func (leaseAwareFunc) LeasesAcquired(context.Context, []relay.Lease) error { return nil }
func (leaseAwareFunc) LeasesReleased(context.Context, []relay.Lease)       {}

// A LeaseAware publisher works per bucket: it gets no set batches.
func TestSetBatchNotForLeaseAware(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := filled(8, 8, 2)
		var log pubLog
		cfg := config("a")
		cfg.Parallelism = 1
		cfg.MaxBatchBuckets = 64
		r, err := relay.New(advancingStore{s}, leaseAwareFunc{log.publisher(nil).(relay.PublisherFunc)}, cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 16, n)
		require.Zero(t, s.count("setbatch"))
		for i := range log.n() {
			require.Len(t, batchBuckets(log.call(i)), 1)
		}
	})
}

// Config.MaxBatchBuckets is checked like the other fields.
func TestSetBatchConfig(t *testing.T) {
	t.Parallel()
	for _, v := range []int{-1, relay.BucketCountMax + 1} {
		cfg := config("a")
		cfg.MaxBatchBuckets = v
		_, err := relay.New(newFakeStore(8), relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil }), cfg)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "MaxBatchBuckets", ce.Field)
	}
}
