package relay_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// recObserver records the relay's instrumentation events.
type recObserver struct {
	sampling relay.BacklogSampling

	mu          sync.Mutex
	owned       int
	ownedMax    int
	acquired    int
	expired     int
	publishes   []relay.PublishEvent
	cycles      int
	samples     []relay.Backlog
	unavailable []error
	available   bool
	dead        map[bool]int // parked -> count
}

var _ relay.BacklogObserver = (*recObserver)(nil)

func (o *recObserver) OwnedBuckets(n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.owned, o.ownedMax = n, max(o.ownedMax, n)
}

func (o *recObserver) LeasesAcquired(n int) { o.mu.Lock(); o.acquired += n; o.mu.Unlock() }
func (o *recObserver) LeasesExpired(n int)  { o.mu.Lock(); o.expired += n; o.mu.Unlock() }
func (o *recObserver) Published(e relay.PublishEvent) {
	o.mu.Lock()
	o.publishes = append(o.publishes, e)
	o.mu.Unlock()
}
func (o *recObserver) CycleFinished(time.Duration) { o.mu.Lock(); o.cycles++; o.mu.Unlock() }
func (o *recObserver) MessagesDeadLettered(n int, parked bool) {
	o.mu.Lock()
	if o.dead == nil {
		o.dead = map[bool]int{}
	}
	o.dead[parked] += n
	o.mu.Unlock()
}
func (o *recObserver) BacklogSampling() relay.BacklogSampling { return o.sampling }
func (o *recObserver) BacklogSampled(b relay.Backlog) {
	o.mu.Lock()
	o.samples, o.available = append(o.samples, b), true
	o.mu.Unlock()
}
func (o *recObserver) BacklogUnavailable(err error) {
	o.mu.Lock()
	o.unavailable, o.available = append(o.unavailable, err), false
	o.mu.Unlock()
}

func (o *recObserver) get(f func(o *recObserver)) {
	o.mu.Lock()
	defer o.mu.Unlock()
	f(o)
}

// samplerStore adds a BacklogSampler to a fakeStore.
type samplerStore struct {
	*fakeStore
	calls, inflight, maxInflight atomic.Int32
	// sample, if set, replaces the result.
	sample func(ctx context.Context) (relay.Backlog, error)
}

func (s *samplerStore) SampleBacklog(ctx context.Context) (relay.Backlog, error) {
	s.calls.Add(1)
	n := s.inflight.Add(1)
	defer s.inflight.Add(-1)
	for {
		m := s.maxInflight.Load()
		if n <= m || s.maxInflight.CompareAndSwap(m, n) {
			break
		}
	}
	if s.sample != nil {
		return s.sample(ctx)
	}
	return relay.Backlog{BucketCount: s.buckets, Pending: int64(s.pending())}, nil
}

// The relay reports leases, publishes and cycles, and nothing after Stop
// but an empty lease set and an unavailable backlog.
func TestObserverEvents(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		for b := range 8 {
			s.add(b, 15) // a full batch of 10, then 5
		}
		obs := &recObserver{}
		cfg := config("a")
		cfg.Observer = obs
		var log pubLog
		r := start(t, s, log.publisher(nil), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		synctest.Wait()
		obs.get(func(o *recObserver) {
			require.Equal(t, 8, o.owned)
			require.Equal(t, 8, o.acquired)
			require.Zero(t, o.expired)
			require.Len(t, o.publishes, 16)
			acked := 0
			for _, e := range o.publishes {
				require.False(t, e.Failed())
				require.False(t, e.Cancelled)
				require.Equal(t, e.Messages, e.Acked)
				acked += e.Acked
			}
			require.Equal(t, 8*15, acked)
			require.Positive(t, o.cycles)
			require.Equal(t, []error{nil}, o.unavailable, "the store cannot sample: the backlog is unknown")
		})
		stop(t, r)
		obs.get(func(o *recObserver) {
			require.Equal(t, 0, o.owned)
			require.Equal(t, 8, o.ownedMax)
		})
	})
}

// Failures are reported with their error; a publish cancelled because the
// lease was lost is not a failure, and the lost bucket is counted once.
func TestObserverFailuresAndLostLeases(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 3)
		obs := &recObserver{}
		cfg := config("a")
		cfg.Observer = obs
		var calls atomic.Int32
		boom := relay.Permanent(errors.New("record too large"))
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			switch calls.Add(1) {
			case 1:
				return 1, boom
			case 2:
				return 1, nil // short without an error
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		synctest.Wait()
		obs.get(func(o *recObserver) {
			require.Len(t, o.publishes, 3)
			require.ErrorIs(t, o.publishes[0].Err, boom)
			require.Equal(t, 1, o.publishes[0].Acked)
			require.Error(t, o.publishes[1].Err, "fewer acknowledged without an error is a failure")
			require.False(t, relay.IsPermanent(o.publishes[1].Err))
			require.NoError(t, o.publishes[2].Err)
		})
		stop(t, r)

		// Another relay takes bucket 1 over during the publish.
		s2 := newFakeStore(8)
		s2.add(1, 2)
		s2.renew = func([]relay.Lease) []relay.Lease {
			s2.leases[1] = fakeLease{owner: "b", term: s2.leases[1].term + 1, expires: time.Now().Add(time.Hour)}
			return nil
		}
		obs2 := &recObserver{}
		cfg = config("a")
		cfg.Observer = obs2
		r2 := start(t, s2, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			<-ctx.Done()
			return 0, ctx.Err()
		}), cfg)
		time.Sleep(cfg.LeaseRenewInterval + time.Millisecond) // the renewal during the publish
		synctest.Wait()
		obs2.get(func(o *recObserver) {
			require.Len(t, o.publishes, 1)
			require.True(t, o.publishes[0].Cancelled)
			require.False(t, o.publishes[0].Failed())
			require.Equal(t, 8, o.expired, "the renewal kept no lease: every bucket is lost, each counted once")
			require.Equal(t, 7, o.owned, "re-acquired at once, except the bucket b holds")
		})
		stop(t, r2)
	})
}

// A relay whose store stops answering reports its leases expired once
// the trust window ends.
func TestObserverTrustExpiry(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		obs := &recObserver{}
		cfg := config("a")
		cfg.Observer = obs
		var log pubLog
		r := start(t, s, log.publisher(nil), cfg)
		synctest.Wait()
		s.failLeases(errors.New("database unreachable"))
		time.Sleep(cfg.LeaseDuration)
		obs.get(func(o *recObserver) {
			require.Equal(t, 8, o.expired)
			require.Equal(t, 0, o.owned)
		})
		stop(t, r)
	})
}

// The sampler runs once per interval after each sample completes, never
// two at a time, reports a timed-out sample as unavailable with its cause,
// and stops with the relay.
func TestBacklogSampler(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := &samplerStore{fakeStore: newFakeStore(8)}
		s.add(3, 4)
		var slow atomic.Bool
		s.sample = func(ctx context.Context) (relay.Backlog, error) {
			if slow.Load() {
				<-ctx.Done() // a store honouring the timeout
				return relay.Backlog{}, ctx.Err()
			}
			time.Sleep(2 * time.Second) // each sample takes 2s
			return relay.Backlog{BucketCount: 8, Pending: 4}, nil
		}
		obs := &recObserver{sampling: relay.BacklogSampling{Interval: 10 * time.Second, Timeout: 3 * time.Second}}
		cfg := config("a")
		cfg.Observer = obs
		cfg.PollInterval = time.Hour // keep the fake clock's events few
		var log pubLog
		started := time.Now()
		r := start(t, s, log.publisher(nil), cfg)

		time.Sleep(35 * time.Second)
		obs.get(func(o *recObserver) {
			// Samples complete at 2s, 14s, 26s (each 10s after the last,
			// jittered by at most a tenth, plus 2s of query).
			require.GreaterOrEqual(t, len(o.samples), 3)
			require.LessOrEqual(t, len(o.samples), 4)
			require.True(t, o.available)
			require.Equal(t, int64(4), o.samples[0].Pending)
			require.False(t, o.samples[0].SampledAt.Before(started), "SampledAt filled in")
		})
		require.EqualValues(t, 1, s.maxInflight.Load(), "one sample at a time")

		slow.Store(true)
		time.Sleep(20 * time.Second)
		obs.get(func(o *recObserver) {
			require.False(t, o.available)
			require.NotEmpty(t, o.unavailable)
			err := o.unavailable[len(o.unavailable)-1]
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorContains(t, err, "timed out after 3s")
		})
		stop(t, r)
		synctest.Wait()
		calls := s.calls.Load()
		time.Sleep(time.Minute)
		require.Equal(t, calls, s.calls.Load(), "no sampling after Stop")
		obs.get(func(o *recObserver) {
			require.False(t, o.available)
			require.NoError(t, o.unavailable[len(o.unavailable)-1], "stopped")
		})
	})
}

// With BucketZeroOwnerOnly only the holder of bucket 0 queries; the other
// relay reports unavailable. When bucket 0 moves, sampling moves with it.
func TestBacklogSamplerBucketZeroOwnerOnly(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		fs := newFakeStore(8)
		fs.allowed = func(id string, b int) bool { return (id == "a") == (b < 4) }
		sa, sb := &samplerStore{fakeStore: fs}, &samplerStore{fakeStore: fs}
		sampling := relay.BacklogSampling{Interval: 5 * time.Second, BucketZeroOwnerOnly: true}
		oa, ob := &recObserver{sampling: sampling}, &recObserver{sampling: sampling}
		cfgA, cfgB := config("a"), config("b")
		cfgA.Observer, cfgB.Observer = oa, ob
		var log pubLog
		ra := start(t, sa, log.publisher(nil), cfgA)
		rb := start(t, sb, log.publisher(nil), cfgB)
		time.Sleep(20 * time.Second)

		require.Positive(t, sa.calls.Load())
		require.Zero(t, sb.calls.Load(), "b does not own bucket 0: no query")
		oa.get(func(o *recObserver) { require.True(t, o.available) })
		ob.get(func(o *recObserver) {
			require.False(t, o.available)
			require.Empty(t, o.samples)
			for _, err := range o.unavailable {
				require.NoError(t, err, "not sampling is not an error")
			}
		})

		// a stops; b may now take every bucket and starts sampling.
		fs.mu.Lock()
		fs.allowed = nil
		fs.mu.Unlock()
		stop(t, ra)
		time.Sleep(20 * time.Second)
		require.Positive(t, sb.calls.Load())
		ob.get(func(o *recObserver) { require.True(t, o.available) })
		stop(t, rb)
	})
}

// A store without the capability: the observer is told the backlog is
// unavailable and nothing runs.
func TestBacklogSamplerUnsupported(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		obs := &recObserver{}
		cfg := config("a")
		cfg.Observer = obs
		var log pubLog
		r := start(t, newFakeStore(8), log.publisher(nil), cfg)
		synctest.Wait()
		obs.get(func(o *recObserver) {
			require.Equal(t, []error{nil}, o.unavailable)
			require.Empty(t, o.samples)
		})
		stop(t, r)
	})
}

// A failure handler that moves the failed message away (FailureRetry)
// is reported as one dead letter.
func TestObserverDeadLetters(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(4, 3)
		obs := &recObserver{}
		cfg := config("a")
		cfg.Observer = obs
		cfg.FailureHandler = relay.FailureHandlerFunc(func(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
			s.mu.Lock()
			s.msgs[4] = s.msgs[4][1:] // dead-lettered
			s.mu.Unlock()
			return relay.FailureRetry, nil
		})
		var calls atomic.Int32
		pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if calls.Add(1) == 1 {
				return 0, relay.Permanent(errors.New("rejected"))
			}
			return len(msgs), nil
		})
		r, err := relay.New(s, pub, cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 2, n)
		obs.get(func(o *recObserver) { require.Equal(t, map[bool]int{false: 1}, o.dead) })
	})
}

// BacklogSampling.WithDefaults fills the zero fields (and a negative
// Timeout) and keeps a negative Interval, which disables sampling.
func TestBacklogSamplingWithDefaults(t *testing.T) {
	t.Parallel()
	require.Equal(t, relay.BacklogSampling{Interval: relay.BacklogSampleIntervalDefault, Timeout: relay.BacklogSampleTimeoutDefault},
		relay.BacklogSampling{}.WithDefaults())
	require.Equal(t, relay.BacklogSampling{Interval: -1, Timeout: relay.BacklogSampleTimeoutDefault, BucketZeroOwnerOnly: true},
		relay.BacklogSampling{Interval: -1, Timeout: -time.Second, BucketZeroOwnerOnly: true}.WithDefaults())
}

// TestReleaseReasons: the leases-changed log line says why each released
// bucket was given up.
func TestReleaseReasons(t *testing.T) {
	require.Equal(t, "2 paused by an operator; 3,5 above the fair share; 7 revoked by an operator; 9 lost (the lease expired before its renewal)",
		relay.ReleaseReasons([]int{2, 3, 5, 7, 9}, []int{2}, []int{3, 5}, []int{7}))
	require.Equal(t, "4 lost (the lease expired before its renewal)", relay.ReleaseReasons([]int{4}, nil, nil, nil),
		"a store that does not say")
}
