package relay_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox/relay"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func testLogger() *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// config has round timings; tests run in a synctest bubble, so they cost
// no real time.
func config(id string) relay.Config {
	return relay.Config{
		RelayID:            id,
		BucketCount:        8,
		BatchSize:          10,
		PollInterval:       time.Second,
		LeaseDuration:      3 * time.Second,
		LeaseRenewInterval: time.Second,
		BackoffMin:         100 * time.Millisecond,
		BackoffMax:         time.Second,
		Logger:             testLogger(),
	}
}

// pubLog records publish calls.
type pubLog struct {
	mu    sync.Mutex
	calls [][]relay.Message
	at    []time.Time
}

func (p *pubLog) publisher(hook func(ctx context.Context, msgs []relay.Message) (int, error)) relay.Publisher {
	return relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		p.mu.Lock()
		p.calls = append(p.calls, msgs)
		p.at = append(p.at, time.Now())
		p.mu.Unlock()
		if hook != nil {
			return hook(ctx, msgs)
		}
		return len(msgs), nil
	})
}

func (p *pubLog) time(i int) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.at[i]
}

func (p *pubLog) call(i int) []relay.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[i]
}

// values returns the values of every published message, in publish order.
func (p *pubLog) values() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, c := range p.calls {
		for _, m := range c {
			out = append(out, string(m.Value))
		}
	}
	return out
}

// seqValues returns the values "bucket/from" to "bucket/to-1".
func seqValues(bucket, from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, fmt.Sprintf("%d/%d", bucket, i))
	}
	return out
}

func (p *pubLog) n() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.calls)
}

func start(t *testing.T, s relay.Store, pub relay.Publisher, cfg relay.Config) *relay.Relay {
	t.Helper()
	r, err := relay.New(s, pub, cfg)
	require.NoError(t, err)
	require.NoError(t, r.Start(t.Context()))
	return r
}

func stop(t *testing.T, r *relay.Relay) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, r.Stop(ctx))
}

func TestConfig(t *testing.T) {
	t.Parallel()
	c := relay.Config{}.WithDefaults()
	require.Equal(t, 8, c.BucketCount)
	require.Equal(t, 2000, c.BatchSize)
	require.Equal(t, relay.BatchSizeDefault, c.BatchSize)
	require.Equal(t, relay.ParallelismDefault, c.Parallelism)
	require.Equal(t, relay.PipelineDepthDefault, c.PipelineDepth)
	require.Equal(t, time.Second, c.PollInterval)
	require.Equal(t, 30*time.Second, c.LeaseDuration)
	require.Equal(t, 10*time.Second, c.LeaseRenewInterval)
	require.Equal(t, relay.ReleaseTimeoutDefault, c.ReleaseTimeout)
	require.NotNil(t, c.Logger)
	host, _ := os.Hostname()
	require.True(t, strings.HasPrefix(c.RelayID, host+"-"), c.RelayID)
	require.NotEqual(t, c.RelayID, relay.Config{}.WithDefaults().RelayID)

	for _, tc := range []struct {
		field string
		cfg   relay.Config
	}{
		{"LeaseRenewInterval", relay.Config{LeaseDuration: time.Second, LeaseRenewInterval: time.Second}},
		{"LeaseRenewInterval", relay.Config{LeaseDuration: time.Second, LeaseRenewInterval: 2 * time.Second}},
		{"LeaseRenewInterval", relay.Config{LeaseRenewInterval: time.Minute}},
		{"BucketCount", relay.Config{BucketCount: 5000}},
		{"BucketCount", relay.Config{BucketCount: -1}},
		{"BatchSize", relay.Config{BatchSize: 10_001}},
		{"Parallelism", relay.Config{Parallelism: -1}},
		{"Parallelism", relay.Config{Parallelism: relay.ParallelismMax + 1}},
		{"PipelineDepth", relay.Config{PipelineDepth: -1}},
		{"PipelineDepth", relay.Config{PipelineDepth: relay.PipelineDepthMax + 1}},
		{"PollInterval", relay.Config{PollInterval: -time.Second}},
		{"LeaseDuration", relay.Config{LeaseDuration: time.Millisecond, LeaseRenewInterval: time.Millisecond}},
		{"BackoffMax", relay.Config{BackoffMin: time.Minute, BackoffMax: time.Second}},
		{"RelayID", relay.Config{RelayID: strings.Repeat("x", 129)}},
		{"ReleaseTimeout", relay.Config{ReleaseTimeout: -time.Second}},
	} {
		_, err := relay.New(newFakeStore(8), relay.PublisherFunc(nil), tc.cfg)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, tc.field)
		require.Equal(t, tc.field, ce.Field)
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
	}
	_, err := relay.New(nil, relay.PublisherFunc(nil), relay.Config{})
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
	_, err = relay.New(newFakeStore(8), nil, relay.Config{})
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
}

// hangingRelease is a store whose ReleaseLeases waits for its context to
// end, and reports how long it waited.
type hangingRelease struct {
	*fakeStore
	waited chan time.Duration
}

func (h hangingRelease) ReleaseLeases(ctx context.Context, _ string, _ []relay.Lease) error {
	start := time.Now()
	<-ctx.Done()
	h.waited <- time.Since(start)
	return ctx.Err()
}

// Config.ReleaseTimeout bounds the release of the leases at stop, even
// when the store never answers.
func TestReleaseTimeout(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := hangingRelease{newFakeStore(8), make(chan time.Duration, 1)}
		cfg := config("a")
		cfg.ReleaseTimeout = 1500 * time.Millisecond
		var log pubLog
		r, err := relay.New(s, log.publisher(nil), cfg)
		require.NoError(t, err)
		require.NoError(t, r.Start(t.Context()))
		synctest.Wait()
		require.Len(t, r.Leases(), 8)
		require.NoError(t, r.Stop(t.Context()))
		require.Equal(t, cfg.ReleaseTimeout, <-s.waited)
	})
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		var log pubLog
		r, err := relay.New(s, log.publisher(nil), config("a"))
		require.NoError(t, err)

		require.NoError(t, r.Stop(t.Context()), "stop before start")
		require.NoError(t, r.Start(t.Context()))
		require.NoError(t, r.Start(t.Context()), "second start is a no-op")
		_, err = r.DrainOnce(t.Context())
		require.ErrorIs(t, err, relay.ErrBusy)
		synctest.Wait()
		require.Len(t, r.Leases(), 8)

		stop(t, r)
		stop(t, r)
		<-r.Stopped()
		require.NoError(t, r.Err())
		require.Empty(t, r.Leases())
		require.Equal(t, "", s.owner(0), "leases released")
		require.ErrorIs(t, r.Start(t.Context()), relay.ErrStopped)
		_, err = r.DrainOnce(t.Context())
		require.ErrorIs(t, err, relay.ErrStopped)

		// Cancelling the Start context stops the relay too.
		ctx, cancel := context.WithCancel(t.Context())
		r2, err := relay.New(s, log.publisher(nil), config("b"))
		require.NoError(t, err)
		require.NoError(t, r2.Start(ctx))
		synctest.Wait()
		require.Len(t, r2.Leases(), 8)
		cancel()
		<-r2.Stopped()
		require.NoError(t, r2.Err())
		require.Equal(t, "", s.owner(0), "leases released after cancellation too")
	})
}

// A relay owning no buckets heartbeats at LeaseRenewInterval and does not
// poll for pending rows.
func TestNoBucketsNoPolling(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.allowed = func(string, int) bool { return false }
		s.add(3, 5)
		var log pubLog
		r := start(t, s, log.publisher(nil), config("a"))
		time.Sleep(10 * time.Second)
		stop(t, r)
		require.Zero(t, s.count("pending"))
		require.Zero(t, s.count("batch"))
		require.InDelta(t, 11, s.count("acquire"), 2, "one acquisition per LeaseRenewInterval")
	})
}

// Polling is the floor: an unhinted row is found within PollInterval, and
// an idle relay polls about once per PollInterval.
func TestPollingFloor(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		var log pubLog
		r := start(t, s, log.publisher(nil), config("a"))
		synctest.Wait()
		s.add(5, 1)
		added := time.Now()
		for log.n() == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		require.LessOrEqual(t, log.time(0).Sub(added), time.Second)
		polls := s.count("pending")
		time.Sleep(10 * time.Second)
		stop(t, r)
		require.InDelta(t, 10, s.count("pending")-polls, 2)
	})
}

// Hints wake the relay at once for owned buckets and are ignored for
// buckets owned elsewhere.
func TestHintsRespectOwnership(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.allowed = func(_ string, b int) bool { return b < 4 }
		hints := newFakeHints()
		cfg := config("a")
		cfg.PollInterval = time.Hour
		cfg.LeaseDuration = 2 * time.Hour
		cfg.LeaseRenewInterval = time.Hour
		cfg.Hints = hints
		var log pubLog
		r := start(t, s, log.publisher(nil), cfg)
		synctest.Wait()
		require.Len(t, r.Leases(), 4)
		reads := s.count("batch")

		s.add(6, 1) // not ours
		hints.notify(6)
		synctest.Wait()
		require.Equal(t, reads, s.count("batch"), "a hint never bypasses ownership")

		s.add(2, 3)
		hinted := time.Now()
		hints.notify(2)
		synctest.Wait()
		require.Equal(t, 1, log.n())
		require.Equal(t, hinted, log.time(0), "woken at once, no polling delay")
		require.Equal(t, 1, s.count("pending"), "exact hints need no discovery query")

		// A commit whose buckets are unknown makes the relay look.
		s.add(3, 1)
		hints.mu.Lock()
		hints.unknown = true
		hints.mu.Unlock()
		hints.notify()
		synctest.Wait()
		require.Equal(t, 2, s.count("pending"))
		require.Equal(t, 2, log.n())
		require.Equal(t, 3, log.call(1)[0].Bucket)
		stop(t, r)
	})
}

// A full batch keeps its bucket ready without another discovery query,
// and a busy bucket does not starve another one.
func TestBoundedSweeps(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(0, 50) // five full batches
		s.add(1, 1)
		cfg := config("a")
		cfg.PollInterval = time.Hour
		cfg.LeaseDuration = 2 * time.Hour
		cfg.LeaseRenewInterval = time.Hour
		// One drainer: the order of the batches is the queue's alone, not
		// also the goroutines' scheduling.
		cfg.Parallelism = 1
		r, err := relay.New(s, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil }), cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 51, n)
		require.Equal(t, 2, s.count("pending"), "one discovery, one final check over every bucket")
		require.Equal(t, []int{0, 1, 0, 0, 0, 0, 0}, s.batches, "one batch per ready bucket per sweep")
	})
}

// A failing bucket backs off exponentially and retries the same messages
// in order; other buckets keep flowing.
func TestBackoffKeepsOrder(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(4, 3)
		s.add(5, 1)
		var log pubLog
		fails := 0
		var failures []relay.Failure
		cfg := config("a")
		cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
			failures = append(failures, f)
			return relay.FailureBackoff, nil
		})
		r := start(t, s, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
			if msgs[0].Bucket == 4 && fails < 4 {
				fails++
				return 0, errors.New("unavailable")
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)

		var attempts []time.Time
		for i, c := range log.calls {
			if c[0].Bucket == 4 {
				require.Equal(t, "4/0", string(c[0].Value), "retries start at the same message")
				require.Len(t, c, 3)
				attempts = append(attempts, log.at[i])
			}
		}
		require.Len(t, attempts, 5)
		for i := 1; i < len(attempts); i++ {
			gap := attempts[i].Sub(attempts[i-1])
			want := min(cfg.BackoffMin<<(i-1), cfg.BackoffMax)
			require.GreaterOrEqual(t, gap, want/2, "attempt %d", i)
			require.LessOrEqual(t, gap, want, "attempt %d", i)
		}
		require.Len(t, failures, 4)
		for i, f := range failures {
			require.Equal(t, i+1, f.Message.Attempts, "attempts recorded before the handler runs")
		}
		// Bucket 5's drainer may publish before or after bucket 4's first
		// attempt (they run at once), but never after its backoff.
		var healthy []time.Time
		for i, c := range log.calls {
			if c[0].Bucket == 5 {
				healthy = append(healthy, log.at[i])
			}
		}
		require.Len(t, healthy, 1)
		require.True(t, healthy[0].Before(attempts[1]), "the healthy bucket did not wait for the failing one")
	})
}

// A store with no optional capability drains through the fallbacks New
// puts in their place: a failure is recorded nowhere, so the handler sees
// Attempts 0 every time; without a FailureHandler the bucket backs off and
// retries the same messages in order; with nothing read ahead, every
// batch after a full one is read by NextBatch.
func TestWithoutCapabilities(t *testing.T) {
	t.Parallel()
	// drain publishes n messages of bucket 2 from a store without any
	// capability, failing the first two publishes if failing.
	drain := func(t *testing.T, cfg relay.Config, n int, failing bool) (*fakeStore, *pubLog) {
		s := newFakeStore(8)
		s.add(2, n)
		var log pubLog
		fails := 0
		r := start(t, basicStore{s}, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
			if failing && fails < 2 {
				fails++
				return 0, errors.New("broker hiccup")
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)
		return s, &log
	}
	t.Run("recorder", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var attempts []int
			cfg := config("a")
			cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
				attempts = append(attempts, f.Message.Attempts)
				return relay.FailureBackoff, nil
			})
			drain(t, cfg, 3, true)
			require.Equal(t, []int{0, 0}, attempts, "no FailureRecorder: nothing counted")
		})
	})
	t.Run("handler", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cfg := config("a")
			_, log := drain(t, cfg, 3, true)
			require.Len(t, log.calls, 3)
			for i, c := range log.calls {
				require.Len(t, c, 3, "call %d", i)
				for j, m := range c {
					require.Equal(t, fmt.Sprintf("2/%d", j), string(m.Value), "call %d", i)
				}
			}
			for i := 1; i < 3; i++ {
				require.GreaterOrEqual(t, log.at[i].Sub(log.at[i-1]), cfg.BackoffMin/2, "retry %d waited for its backoff", i)
			}
		})
	})
	t.Run("advancer", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			s, log := drain(t, config("a"), 25, false)
			require.Len(t, log.calls, 3, "batches of 10, 10 and 5")
			require.Equal(t, log.at[0], log.at[2], "a full batch is followed at once by the next read, not at the next poll")
			require.Equal(t, 3, s.count("batch"), "each batch read by NextBatch")
		})
	})
}

// A publish longer than LeaseDuration keeps its lease by renewal running
// alongside it.
func TestRenewalDuringPublish(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 1)
		cfg := config("a")
		var pubErr error
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			select {
			case <-time.After(5 * cfg.LeaseDuration):
				return len(msgs), nil
			case <-ctx.Done():
				pubErr = ctx.Err()
				return 0, ctx.Err()
			}
		}), cfg)
		synctest.Wait()
		time.Sleep(4 * cfg.LeaseDuration)
		require.Equal(t, "a", s.owner(1), "still held after four lease durations")
		time.Sleep(2 * cfg.LeaseDuration)
		stop(t, r)
		require.NoError(t, pubErr)
		require.Zero(t, s.pending())
		require.GreaterOrEqual(t, s.count("renew"), 14)
	})
}

// A renewal that reports the lease lost cancels the publish; the rows stay
// for the new owner.
func TestLeaseLostDuringPublish(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 2)
		// Another relay took the bucket over (after a stall, say).
		s.renew = func([]relay.Lease) []relay.Lease {
			s.leases[1] = fakeLease{owner: "b", term: s.leases[1].term + 1, expires: time.Now().Add(time.Hour)}
			return nil
		}
		cfg := config("a")
		causes := make(chan error, 1)
		var calls atomic.Int32
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if calls.Add(1) > 1 {
				return len(msgs), nil
			}
			<-ctx.Done()
			causes <- context.Cause(ctx)
			return 0, ctx.Err()
		}), cfg)
		require.ErrorIs(t, <-causes, relay.ErrLeaseLost)
		synctest.Wait()
		require.Zero(t, s.count("mark"))
		require.Zero(t, s.count("record"), "a lost lease is not a publish failure")
		require.EqualValues(t, 1, calls.Load(), "the bucket is not published again")
		require.NotContains(t, r.Leases(), relay.Lease{Bucket: 1, Term: 1})
		require.Len(t, r.Leases(), 7)
		stop(t, r)
	})
}

// Without a LeaseRenewer the publish is bounded by the local lease
// deadline.
func TestNoRenewerBoundsPublish(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 1)
		cfg := config("a")
		type seen struct {
			deadline time.Time
			cause    error
		}
		observed := make(chan seen, 1)
		var calls atomic.Int32
		started := time.Now()
		r := start(t, basicStore{s}, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if calls.Add(1) > 1 {
				return len(msgs), nil
			}
			deadline, _ := ctx.Deadline()
			<-ctx.Done()
			observed <- seen{deadline, context.Cause(ctx)}
			return 0, ctx.Err()
		}), cfg)
		got := <-observed
		require.ErrorIs(t, got.cause, relay.ErrLeaseLost)
		deadline := got.deadline
		trust := cfg.LeaseDuration - (cfg.LeaseDuration-cfg.LeaseRenewInterval)/2
		require.Equal(t, started.Add(trust), deadline)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)
	})
}

// When the store stops answering, the relay stops publishing once its
// local lease deadline passes, before the stored leases expire.
func TestTrustWindow(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		cfg := config("a")
		var log pubLog
		r := start(t, s, log.publisher(nil), cfg)
		synctest.Wait()
		require.Len(t, r.Leases(), 8)
		s.failLeases(errors.New("database unreachable"))
		time.Sleep(cfg.LeaseDuration - 500*time.Millisecond)
		require.Empty(t, r.Leases(), "no longer trusted, though the leases have not expired yet")
		require.Equal(t, "a", s.owner(0))
		s.add(3, 1)
		time.Sleep(5 * time.Second)
		require.Zero(t, log.n(), "nothing published on untrusted leases")

		s.failLeases(nil)
		for log.n() == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)
	})
}

// Stop lets the in-flight batch finish and deletes what it acknowledged.
func TestStopFinishesBatch(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 3)
		inFlight := make(chan struct{})
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			close(inFlight)
			select {
			case <-time.After(2 * time.Second):
				return len(msgs), nil
			case <-ctx.Done():
				return 0, ctx.Err()
			}
		}), config("a"))
		<-inFlight
		stop(t, r)
		require.Zero(t, s.pending())
		require.Equal(t, "", s.owner(1))
	})
}

// A Stop whose context ends cancels the in-flight publish, still releases
// the leases, and says so.
func TestStopAbandonsBatch(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 3)
		inFlight := make(chan struct{})
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			close(inFlight)
			<-ctx.Done()
			return 1, ctx.Err()
		}), config("a"))
		<-inFlight
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		err := r.Stop(ctx)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, r.Err())
		require.Equal(t, 2, s.pending(), "the acknowledged message was still deleted")
		require.Equal(t, "", s.owner(1), "leases released despite the expired context")
		require.Zero(t, s.count("record"), "cancellation by Stop is not a failure")
	})
}

// A misconfiguration stops the relay with the typed error.
func TestMisconfigurationStops(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(16) // the relay says 8
		r := start(t, s, relay.PublisherFunc(nil), config("a"))
		<-r.Stopped()
		var me *relay.MisconfigurationError
		require.ErrorAs(t, r.Err(), &me)
		require.ErrorIs(t, r.Err(), relay.ErrMisconfigured)
		require.NoError(t, r.Stop(t.Context()))
		_, err := r.DrainOnce(t.Context())
		require.ErrorIs(t, err, relay.ErrStopped)
	})
}

// A publisher's misconfiguration (a publisher that was never started, an
// unauthorized identity) stops the relay with it: the message is not at
// fault, so no failure is recorded against it and nothing is deleted, by
// the running relay and by DrainOnce.
func TestPublisherMisconfigurationStops(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		notStarted := &relay.MisconfigurationError{Setting: "Kafka publisher", Reason: "call Start before the relay publishes"}
		var calls atomic.Int32
		pub := relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
			calls.Add(1)
			return 0, notStarted
		})
		s := newFakeStore(8)
		s.add(2, 1)
		r := start(t, s, pub, config("a"))
		<-r.Stopped()
		require.ErrorIs(t, r.Err(), notStarted)
		require.EqualValues(t, 1, calls.Load(), "the relay stops at the first such error")
		require.Equal(t, 1, s.pending())
		require.Zero(t, s.count("record"), "no failure recorded against the message")

		d, err := relay.New(s, pub, config("b"))
		require.NoError(t, err)
		_, err = d.DrainOnce(t.Context())
		require.ErrorIs(t, err, notStarted)
		require.Equal(t, 1, s.pending())
		require.Zero(t, s.count("record"))
	})
}

// Store errors are retried with backoff, not fatal.
func TestStoreErrorsRetry(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 1)
		failures := 3
		s.fail = func(op string) error {
			if op == "acquire" && failures > 0 {
				failures--
				return errors.New("connection refused")
			}
			return nil
		}
		var log pubLog
		r := start(t, s, log.publisher(nil), config("a"))
		for log.n() == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)
		require.NoError(t, r.Err())
		require.GreaterOrEqual(t, s.count("acquire"), 4)
	})
}

func TestFairShare(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ buckets, live, want int }{
		{8, 1, 8}, {8, 2, 4}, {8, 3, 3}, {8, 0, 8}, {8, 9, 1}, {1, 3, 1}, {4096, 7, 586},
	} {
		require.Equal(t, tc.want, relay.FairShare(tc.buckets, tc.live))
		require.GreaterOrEqual(t, relay.FairShare(tc.buckets, tc.live)*max(tc.live, 1), tc.buckets)
	}
}

// A relay that stopped trusting its leases (the store stopped answering
// renewals, which also ended a publish in flight) releases them when it
// stops all the same: peers take the buckets at once rather than after
// the leases expire.
func TestStopReleasesUntrustedLeases(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 1)
		cfg := config("a")
		blocked := make(chan struct{}, 1)
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			blocked <- struct{}{}
			<-ctx.Done()
			return 0, context.Cause(ctx)
		}), cfg)
		<-blocked
		s.failLeases(errors.New("database unreachable"))
		for len(r.Leases()) > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		synctest.Wait() // the cancelled publish has returned
		for b := range 8 {
			require.Equal(t, "a", s.owner(b), "bucket %d: the stored lease outlives the trust window", b)
		}
		stop(t, r)
		for b := range 8 {
			require.Empty(t, s.owner(b), "bucket %d released at stop", b)
		}
		require.Equal(t, 1, s.pending())
	})
}

// A claim that committed while its caller gave up on the reply (the
// relay's context ended with the statement in flight, or the connection
// broke after the commit) leaves leases the relay never learned it holds.
// Stopping releases them all the same, so peers take the buckets at once
// rather than after the leases expire.
func TestStopReleasesUnlearnedLeases(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.lostReply = func() error { return errors.New("connection reset after commit") }
		var log pubLog
		r := start(t, s, log.publisher(nil), config("a"))
		for s.count("acquire") < 2 {
			time.Sleep(10 * time.Millisecond)
		}
		require.Empty(t, r.Leases(), "the relay learned of no lease")
		for b := range 8 {
			require.Equal(t, "a", s.owner(b), "bucket %d: the claims committed", b)
		}
		stop(t, r)
		for b := range 8 {
			require.Empty(t, s.owner(b), "bucket %d released at stop", b)
		}
	})
}
