package relay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// runAsync runs r.Run(ctx) on a goroutine and returns its result channel.
func runAsync(ctx context.Context, r *relay.Relay) <-chan error {
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return done
}

// Run blocks while the relay runs; the end of its context is a graceful
// stop: the in-flight batch finishes and is deleted, the leases are
// released, and Run returns nil.
func TestRunStopsGracefullyAtContextEnd(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 3)
		inFlight := make(chan struct{})
		r, err := relay.New(s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			close(inFlight)
			select {
			case <-time.After(2 * time.Second):
				return len(msgs), nil
			case <-ctx.Done():
				return 0, ctx.Err()
			}
		}), config("a"))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		done := runAsync(ctx, r)
		<-inFlight
		synctest.Wait()
		select {
		case err := <-done:
			t.Fatalf("Run returned while the relay runs: %v", err)
		default:
		}
		cancel()
		require.NoError(t, <-done)
		require.Zero(t, s.pending(), "the in-flight batch finished and was deleted")
		require.Equal(t, "", s.owner(1), "leases released")
		<-r.Stopped()
		require.NoError(t, r.Err())
		require.ErrorIs(t, r.Run(t.Context()), relay.ErrStopped, "a relay runs once")
	})
}

// A relay that stops on its own makes Run return its error at once.
func TestRunReturnsTheRelaysError(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		fatal := &relay.MisconfigurationError{Setting: "Kafka publisher", Reason: "topic authorization failed"}
		s := newFakeStore(8)
		s.add(2, 1)
		r, err := relay.New(s, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
			return 0, fatal
		}), config("a"))
		require.NoError(t, err)
		err = r.Run(t.Context())
		require.ErrorIs(t, err, fatal)
		require.Equal(t, r.Err(), err)
		require.Equal(t, 1, s.pending())
		require.Equal(t, "", s.owner(2), "leases released")
	})
}

// A graceful stop longer than ShutdownTimeout cancels the in-flight
// publish, and Run says so.
func TestRunShutdownTimeout(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 3)
		inFlight := make(chan struct{})
		cfg := config("a")
		cfg.ShutdownTimeout = 3 * time.Second
		r, err := relay.New(s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			close(inFlight)
			<-ctx.Done()
			return 0, ctx.Err()
		}), cfg)
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		done := runAsync(ctx, r)
		<-inFlight
		cancel()
		began := time.Now()
		err = <-done
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorContains(t, err, "ShutdownTimeout (3s)")
		require.Equal(t, 3*time.Second, time.Since(began), "bounded by ShutdownTimeout (synctest's clock)")
		require.Equal(t, 3, s.pending())
		require.Equal(t, "", s.owner(1), "leases released")

		cfg.ShutdownTimeout = -time.Second
		_, err = relay.New(s, relay.PublisherFunc(nil), cfg)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "ShutdownTimeout", ce.Field)
	})
}

// readyPublisher is a publisher with a ReadyChecker and, optionally, a
// lifecycle the relay may own. It records the order of events.
type readyPublisher struct {
	mu       sync.Mutex
	events   []string
	started  bool
	stopped  bool
	startErr error
}

func (p *readyPublisher) event(e string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.events = append(p.events, e)
}

func (p *readyPublisher) log() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.events...)
}

func (p *readyPublisher) Publish(_ context.Context, msgs []relay.Message) (int, error) {
	if err := p.CheckReady(context.Background()); err != nil {
		return 0, err
	}
	p.event("publish")
	return len(msgs), nil
}

var errNotStarted = errors.New("not started")

func (p *readyPublisher) CheckReady(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started || p.stopped {
		return &relay.MisconfigurationError{Setting: "test publisher", Reason: "call Start first", Err: errNotStarted}
	}
	return nil
}

func (p *readyPublisher) Start(ctx context.Context) error {
	if p.startErr != nil {
		return p.startErr
	}
	p.mu.Lock()
	p.started = true
	p.mu.Unlock()
	p.event("start")
	return nil
}

func (p *readyPublisher) Stop(context.Context) error {
	p.mu.Lock()
	p.stopped = true
	p.mu.Unlock()
	p.event("stop")
	return nil
}

// A publisher whose ReadyChecker reports a misconfiguration (never
// started) fails Start, Run and DrainOnce synchronously; nothing is
// published or leased, and the relay can start once the publisher is.
func TestStartChecksThePublisher(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 2)
		p := &readyPublisher{}
		r, err := relay.New(s, p, config("a"))
		require.NoError(t, err)
		for name, err := range map[string]error{
			"Start":     r.Start(t.Context()),
			"Run":       r.Run(t.Context()),
			"DrainOnce": second(r.DrainOnce(t.Context())),
		} {
			require.ErrorIs(t, err, errNotStarted, name)
			require.True(t, relay.IsMisconfiguration(err), name)
		}
		require.Zero(t, s.count("acquire"), "nothing leased")
		require.Equal(t, 2, s.pending())

		require.NoError(t, p.Start(t.Context()))
		require.NoError(t, r.Start(t.Context()))
		synctest.Wait()
		require.Zero(t, s.pending())
		stop(t, r)
	})
}

// A relay that owns its publisher starts it before the relay runs and
// stops it after the relay stopped, before Stopped; a publisher that
// cannot start fails Start, leaving the relay idle.
func TestOwnPublisher(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 2)
		cfg := config("a")
		cfg.OwnPublisher = true

		refused := errors.New("no broker answered")
		failing := &readyPublisher{startErr: refused}
		r, err := relay.New(s, failing, cfg)
		require.NoError(t, err)
		require.ErrorIs(t, r.Run(t.Context()), refused)
		require.Zero(t, s.count("acquire"), "nothing leased")
		require.Empty(t, failing.log(), "a publisher that failed to start is left unstarted: Start may be tried again")

		p := &readyPublisher{}
		r, err = relay.New(s, p, cfg)
		require.NoError(t, err)
		_, err = r.DrainOnce(t.Context())
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "OwnPublisher", ce.Field)

		ctx, cancel := context.WithCancel(t.Context())
		done := runAsync(ctx, r)
		synctest.Wait()
		require.Zero(t, s.pending())
		require.Equal(t, []string{"start", "publish"}, p.log())
		cancel()
		require.NoError(t, <-done)
		<-r.Stopped()
		require.Equal(t, []string{"start", "publish", "stop"}, p.log(), "stopped once, after the relay")
		require.Equal(t, "", s.owner(1))

		// Start (not Run): the end of its context is an abrupt stop, and
		// the publisher is stopped too.
		p2 := &readyPublisher{}
		r2, err := relay.New(s, p2, cfg)
		require.NoError(t, err)
		ctx2, cancel2 := context.WithCancel(t.Context())
		require.NoError(t, r2.Start(ctx2))
		synctest.Wait()
		cancel2()
		<-r2.Stopped()
		require.Equal(t, []string{"start", "stop"}, p2.log())

		// A publisher without a lifecycle cannot be owned.
		_, err = relay.New(s, relay.PublisherFunc(nil), cfg)
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "OwnPublisher", ce.Field)
	})
}

func second[T any](_ T, err error) error { return err }
