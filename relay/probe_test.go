package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// probedStore is a fakeStore that can be probed (relay.Prober); its
// probes fail while down. It records when each acquisition and probe
// came.
type probedStore struct {
	*fakeStore
	mu       sync.Mutex
	down     bool
	probes   []time.Time
	acquires []time.Time
}

func (p *probedStore) Probe(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.probes = append(p.probes, time.Now())
	if p.down {
		return errors.New("connection refused")
	}
	return nil
}

func (p *probedStore) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	p.mu.Lock()
	p.acquires = append(p.acquires, time.Now())
	p.mu.Unlock()
	return p.fakeStore.AcquireLeases(ctx, req)
}

func (p *probedStore) setDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
}

// since returns the times of ts at or after t.
func since(mu *sync.Mutex, ts *[]time.Time, t time.Time) []time.Time {
	mu.Lock()
	defer mu.Unlock()
	var out []time.Time
	for _, x := range *ts {
		if !x.Before(t) {
			out = append(out, x)
		}
	}
	return out
}

// probeConfig has a BackoffMin below ProbeIntervalMin and a BackoffMax
// far above it.
func probeConfig() relay.Config {
	cfg := config("a")
	cfg.BackoffMin, cfg.BackoffMax = 10*time.Millisecond, 4*time.Second
	return cfg
}

// A relay whose store stops answering probes it at most every
// ProbeIntervalMin, though BackoffMin is shorter, and acquires at the
// first probe that answers, not at the end of its backoff (seconds by
// then); the outage's end is the probe's answer, not a call that failed.
func TestProbeEndsTheBackoffWhenTheStoreAnswers(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := &probedStore{fakeStore: newFakeStore(8)}
		s.add(1, 3)
		r := start(t, s, (&pubLog{}).publisher(nil), probeConfig())
		synctest.Wait()
		require.Len(t, r.Leases(), 8)

		down := time.Now()
		s.setDown(true)
		s.failLeases(errors.New("connection refused"))
		const outage = 10 * time.Second
		time.Sleep(outage)
		probes := since(&s.mu, &s.probes, down)
		require.NotEmpty(t, probes)
		require.LessOrEqual(t, len(probes), int(outage/relay.ProbeIntervalMin)+1, "probes at least ProbeIntervalMin apart")
		for i := 1; i < len(probes); i++ {
			require.GreaterOrEqual(t, probes[i].Sub(probes[i-1]), relay.ProbeIntervalMin)
		}
		require.Empty(t, r.Leases(), "the trust window ended during the outage")

		back := time.Now()
		s.failLeases(nil)
		s.setDown(false)
		s.add(2, 3)
		time.Sleep(relay.ProbeIntervalMin)
		synctest.Wait()
		acquires := since(&s.mu, &s.acquires, back)
		require.NotEmpty(t, acquires, "acquired within a probe interval of the store answering")
		require.Len(t, r.Leases(), 8)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)
	})
}

// An acquisition that fails while the probe answers (a failure the probe
// cannot see) keeps its plain backoff: once the backoff reached
// BackoffMax, acquisitions come at least BackoffMax/2 apart (one early
// retry allowed), not every probe interval.
func TestProbeAnsweringKeepsTheBackoffOfAFailureItDoesNotSee(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := &probedStore{fakeStore: newFakeStore(8)}
		cfg := probeConfig()
		r := start(t, s, (&pubLog{}).publisher(nil), cfg)
		synctest.Wait()

		s.failLeases(errors.New("permission denied for table outbox_leases"))
		// By then the backoff is at BackoffMax: 10ms doubled to 4s within
		// about 5s of failures, and the trust window long over.
		time.Sleep(10 * time.Second)
		from := time.Now()
		const window = 10 * time.Second
		time.Sleep(window)
		acquires := since(&s.mu, &s.acquires, from)
		require.NotEmpty(t, acquires)
		require.LessOrEqual(t, len(acquires), int(window/(cfg.BackoffMax/2))+2,
			"acquisitions at least BackoffMax/2 apart, bar one early retry: %v", acquires)
		require.NotEmpty(t, since(&s.mu, &s.probes, from), "the store was probed meanwhile")
		s.failLeases(nil)
		stop(t, r)
	})
}

// failOps makes the store's calls named in ops fail with err, as when the
// database goes away while the control loop's own calls happen to
// succeed; no ops ends that.
func (p *probedStore) failOps(err error, ops ...string) {
	p.mu.Lock()
	p.down = len(ops) > 0
	p.mu.Unlock()
	p.fakeStore.mu.Lock()
	defer p.fakeStore.mu.Unlock()
	if len(ops) == 0 {
		p.fakeStore.fail = nil
		return
	}
	p.fakeStore.fail = func(op string) error {
		if slices.Contains(ops, op) {
			return err
		}
		return nil
	}
}

// storeFilter is a failure handler whose BatchFilter reads the store's
// database, as the GORM store's failure policy does: it fails while the
// fake store's "filter" calls fail.
type storeFilter struct{ s *fakeStore }

func (storeFilter) HandleFailure(context.Context, relay.Failure) (relay.FailureAction, error) {
	return relay.FailureBackoff, nil
}

func (f storeFilter) FilterBatch(_ context.Context, _ string, _ relay.Lease, msgs []relay.Message) ([]relay.Message, error) {
	err := f.s.begin("filter")
	f.s.mu.Unlock()
	return msgs, err
}

// Buckets backing off after their drainers' store calls failed (a read,
// a delete, the failure handler's filter), while the control loop's acquisitions and discoveries
// succeed, are retried at the first probe that answers, not after their
// backoff (seconds by then): the drainers' failures, not only the loop's,
// have the store probed.
func TestProbeEndsTheBackoffOfDrainersStoreFailures(t *testing.T) {
	t.Parallel()
	for _, ops := range [][]string{{"batch"}, {"mark"}, {"filter"}} {
		t.Run(ops[0], func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				s := &probedStore{fakeStore: newFakeStore(8)}
				cfg := probeConfig()
				cfg.FailureHandler = storeFilter{s.fakeStore}
				r := start(t, s, (&pubLog{}).publisher(nil), cfg)
				synctest.Wait()
				require.Len(t, r.Leases(), 8)

				down := time.Now()
				s.failOps(errors.New("connection refused"), ops...)
				s.add(1, 3)
				const outage = 10 * time.Second
				time.Sleep(outage)
				require.Positive(t, s.count(ops[0]), "the drainer met the outage")
				require.Positive(t, s.count("acquire"), "the loop's own calls went on")
				probes := since(&s.mu, &s.probes, down)
				require.NotEmpty(t, probes, "the drainers' failures had the store probed")
				require.LessOrEqual(t, len(probes), int(outage/relay.ProbeIntervalMin)+1, "probes at least ProbeIntervalMin apart")
				require.Len(t, r.Leases(), 8, "the leases held throughout")
				require.Equal(t, 3, s.pending(), "nothing deleted during the outage")
				// By now bucket 1 backs off for seconds (10ms doubled up to 4s).

				reads := s.count("batch")
				s.failOps(nil)
				time.Sleep(relay.ProbeIntervalMin)
				synctest.Wait()
				require.Greater(t, s.count("batch"), reads, "read again within a probe interval of the store answering")
				require.Zero(t, s.pending(), "drained within a probe interval of the store answering")
				stop(t, r)
			})
		})
	}
}

// The sequence that left buckets sleeping out their backoff after a
// database outage: the drainers' reads fail until a bucket backs off for
// seconds; the loop's acquisition fails too, briefly, so the store is
// probed; when the database answers, the loop's acquisition, retried
// after its short backoff, succeeds before a probe answers. The loop's
// own calls no longer wait for a retry, but the bucket still does: the
// next probe that answers retries it, not the end of its backoff.
func TestProbeRetriesBucketsAfterTheLoopsCallsAnswered(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := &probedStore{fakeStore: newFakeStore(8)}
		cfg := probeConfig()
		// As in gormrelay's test: the leases outlast the outage, and the
		// loop acquires every 200ms.
		cfg.LeaseDuration, cfg.LeaseRenewInterval = time.Minute, 200*time.Millisecond
		r := start(t, s, (&pubLog{}).publisher(nil), cfg)
		synctest.Wait()
		require.Len(t, r.Leases(), 8)

		down := errors.New("connection refused")
		s.failOps(down, "batch")
		s.add(1, 3)
		time.Sleep(10 * time.Second) // bucket 1's backoff reached BackoffMax (10ms doubled to 4s)
		// Right after one of its reads failed, bucket 1 backs off at least
		// BackoffMax/2.
		reads := s.count("batch")
		for s.count("batch") == reads {
			time.Sleep(time.Millisecond)
		}
		failed := time.Now()
		s.failOps(down, "batch", "acquire", "renew", "pending")
		for len(since(&s.mu, &s.acquires, failed)) == 0 {
			time.Sleep(time.Millisecond)
		}
		// The failed acquisitions have the store probed (on main too).
		acquireFailed := time.Now()
		for len(since(&s.mu, &s.probes, acquireFailed)) == 0 {
			time.Sleep(time.Millisecond)
		}

		// The database answers, but the probes have not yet: the loop's
		// acquisition answers first.
		back := time.Now()
		s.failOps(nil)
		s.setDown(true)
		for len(since(&s.mu, &s.acquires, back)) == 0 {
			time.Sleep(time.Millisecond)
		}
		synctest.Wait()
		reads = s.count("batch")
		probed := time.Now()
		s.setDown(false)
		time.Sleep(relay.ProbeIntervalMin)
		synctest.Wait()
		require.Less(t, time.Since(failed), cfg.BackoffMax/2, "bucket 1 still backs off")
		require.Greater(t, s.count("batch"), reads, "bucket 1 read again within a probe interval of the probe answering (at %s), not after its backoff", probed.Sub(failed))
		require.Zero(t, s.pending())
		stop(t, r)
	})
}
