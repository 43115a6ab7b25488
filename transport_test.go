package outbox_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// ---------------------------------------------------------------------
// The bridge alone, over a scripted transport.

// fakeTransport records every Publish and Listen call. publish, if set,
// decides a Publish call's result (call counts from 1). Each Listen call
// is handed to the test, which ends it by sending on its end channel.
type fakeTransport struct {
	publish   func(ctx context.Context, call int, buckets []int) error
	publishes chan []int
	starts    chan time.Time
	listens   chan *fakeListen
	calls     atomic.Int32
}

type fakeListen struct {
	ctx context.Context
	fn  func(int)
	end chan error
}

func newFakeTransport() *fakeTransport {
	return &fakeTransport{
		publishes: make(chan []int, 100),
		starts:    make(chan time.Time, 100),
		listens:   make(chan *fakeListen, 100),
	}
}

func (f *fakeTransport) Publish(ctx context.Context, buckets []int) error {
	call := int(f.calls.Add(1))
	f.starts <- time.Now()
	f.publishes <- slices.Clone(buckets)
	if f.publish != nil {
		return f.publish(ctx, call, buckets)
	}
	return nil
}

func (f *fakeTransport) Listen(ctx context.Context, fn func(int)) error {
	l := &fakeListen{ctx: ctx, fn: fn, end: make(chan error)}
	f.listens <- l
	select {
	case err := <-l.end:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fakeTransport) nextPublish(t *testing.T) ([]int, time.Time) {
	t.Helper()
	select {
	case b := <-f.publishes:
		return b, <-f.starts
	case <-time.After(5 * time.Second):
		t.Fatal("no Publish call")
		return nil, time.Time{}
	}
}

func (f *fakeTransport) nextListen(t *testing.T) *fakeListen {
	t.Helper()
	select {
	case l := <-f.listens:
		return l
	case <-time.After(5 * time.Second):
		t.Fatal("no Listen call")
		return nil
	}
}

func startBridge(t *testing.T, n *outbox.Notifier, tr outbox.Transport, cfg outbox.HintBridgeConfig) *outbox.HintBridge {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = dbtest.Logger(t)
	}
	b, err := outbox.StartHintBridge(context.Background(), n, tr, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, b.Stop(ctx))
	})
	return b
}

func TestHintBridgeSendsCommits(t *testing.T) {
	t.Parallel()
	f := newFakeTransport()
	n := outbox.NewNotifier(8)
	b := startBridge(t, n, f, outbox.HintBridgeConfig{SendOnly: true})

	n.Notify([]int{5, 2})
	got, _ := f.nextPublish(t)
	require.Equal(t, []int{2, 5}, got)
	n.NotifyUnknown()
	got, _ = f.nextPublish(t)
	require.Equal(t, []int{outbox.UnknownBucket}, got)
	n.Notify([]int{1, outbox.BucketCountMax, -5})
	got, _ = f.nextPublish(t)
	require.Equal(t, []int{outbox.UnknownBucket, 1}, got, "out-of-range buckets travel as unknown")

	require.NoError(t, b.Stop(context.Background()))
	require.Equal(t, uint64(3), b.Stats().Sent)
	require.Empty(t, f.listens, "SendOnly does not listen")
}

// Commits never wait for a send; what they commit while one is in flight
// goes out in one batch right after it, with no debounce delay.
func TestHintBridgeCoalesces(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	f := newFakeTransport()
	f.publish = func(ctx context.Context, call int, _ []int) error {
		if call == 1 {
			<-release
		}
		return nil
	}
	n := outbox.NewNotifier(16)
	b := startBridge(t, n, f, outbox.HintBridgeConfig{})

	n.Notify([]int{1})
	got, _ := f.nextPublish(t) // in flight, blocked
	require.Equal(t, []int{1}, got)
	for i := range 1000 {
		n.Notify([]int{2 + i%8, 3})
	}
	require.Empty(t, f.publishes, "nothing sent while the first send is in flight")
	close(release)
	got, _ = f.nextPublish(t)
	require.Equal(t, []int{2, 3, 4, 5, 6, 7, 8, 9}, got, "1000 commits, one send")

	// Nothing else was pending: the next send carries only the next commit.
	n.Notify([]int{0})
	got, _ = f.nextPublish(t)
	require.Equal(t, []int{0}, got)
	require.Eventually(t, func() bool { return b.Stats().Sent == 3 }, 5*time.Second, time.Millisecond)
}

// A failed send drops its hints and pauses the sender with growing
// backoff; hints committed meanwhile are sent after the pause.
func TestHintBridgeFailedSendDropsAndBacksOff(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	f := newFakeTransport()
	f.publish = func(ctx context.Context, call int, _ []int) error {
		if call <= 2 {
			return boom
		}
		return nil
	}
	const minBackoff = 100 * time.Millisecond
	n := outbox.NewNotifier(8)
	b := startBridge(t, n, f, outbox.HintBridgeConfig{BackoffMin: minBackoff, BackoffMax: time.Second})

	n.Notify([]int{1})
	got, first := f.nextPublish(t)
	require.Equal(t, []int{1}, got)
	n.Notify([]int{2}) // during the failing send and its backoff
	got, second := f.nextPublish(t)
	require.Equal(t, []int{2}, got, "bucket 1 was dropped, not retried")
	n.Notify([]int{3})
	got, third := f.nextPublish(t)
	require.Equal(t, []int{3}, got)

	// Backoff with jitter: at least half of BackoffMin, then of twice it.
	require.GreaterOrEqual(t, second.Sub(first), minBackoff/2)
	require.GreaterOrEqual(t, third.Sub(second), minBackoff)
	require.Eventually(t, func() bool {
		s := b.Stats()
		return s.SendFailures == 2 && s.Sent == 1
	}, 5*time.Second, time.Millisecond)
}

// A subscription that fails or ends is restarted with backoff; received
// ids wake the local relay and are never sent on.
func TestHintBridgeListenRestartsAndNeverRebroadcasts(t *testing.T) {
	t.Parallel()
	f := newFakeTransport()
	n := outbox.NewNotifier(8)
	b := startBridge(t, n, f, outbox.HintBridgeConfig{BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond})

	f.nextListen(t).end <- errors.New("connection lost")
	f.nextListen(t).end <- nil // ended without an error: restarted too
	l := f.nextListen(t)

	l.fn(5)
	l.fn(5) // duplicates coalesce
	l.fn(outbox.UnknownBucket)
	select {
	case <-n.Ready():
	default:
		t.Fatal("received hint did not wake the relay")
	}
	got, unknown := n.Take(nil)
	require.Equal(t, []int{5}, got)
	require.True(t, unknown)

	// Had the received ids been passed on, they would be pending in the
	// sender before this commit and go out with it.
	n.Notify([]int{6})
	sent, _ := f.nextPublish(t)
	require.Equal(t, []int{6}, sent)
	s := b.Stats()
	require.Equal(t, uint64(3), s.Received)
	require.Equal(t, uint64(2), s.ListenRestarts)
}

func TestHintBridgeLifecycle(t *testing.T) {
	t.Parallel()

	t.Run("StopCancelsSendAndListen", func(t *testing.T) {
		t.Parallel()
		f := newFakeTransport()
		f.publish = func(ctx context.Context, _ int, _ []int) error {
			<-ctx.Done()
			return ctx.Err()
		}
		n := outbox.NewNotifier(8)
		b, err := outbox.StartHintBridge(context.Background(), n, f, outbox.HintBridgeConfig{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		l := f.nextListen(t)
		n.Notify([]int{1})
		f.nextPublish(t)
		require.NoError(t, b.Stop(context.Background()))
		require.Error(t, l.ctx.Err())
		<-b.Stopped()
		require.NoError(t, b.Stop(context.Background()), "second Stop")
		require.Zero(t, b.Stats().SendFailures, "cancellation is not a failure")
		n.Notify([]int{2}) // unsubscribed: no effect, no panic
		require.Empty(t, f.publishes)
	})

	t.Run("StartContextCancelled", func(t *testing.T) {
		t.Parallel()
		f := newFakeTransport()
		ctx, cancel := context.WithCancel(context.Background())
		b, err := outbox.StartHintBridge(ctx, outbox.NewNotifier(8), f, outbox.HintBridgeConfig{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		f.nextListen(t)
		cancel()
		select {
		case <-b.Stopped():
		case <-time.After(5 * time.Second):
			t.Fatal("bridge did not stop with its context")
		}
		require.NoError(t, b.Stop(context.Background()))

		_, err = outbox.StartHintBridge(ctx, outbox.NewNotifier(8), f, outbox.HintBridgeConfig{})
		require.ErrorIs(t, err, context.Canceled)
	})

	t.Run("StopBoundedByContext", func(t *testing.T) {
		t.Parallel()
		release := make(chan struct{})
		tr := &stubbornTransport{release: release, listening: make(chan struct{})}
		b, err := outbox.StartHintBridge(context.Background(), outbox.NewNotifier(8), tr, outbox.HintBridgeConfig{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		<-tr.listening
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		require.ErrorIs(t, b.Stop(ctx), context.DeadlineExceeded)
		close(release)
		require.NoError(t, b.Stop(context.Background()))
	})

	// NewHintBridge starts nothing: no subscription, no Listen, no send
	// until Start; Stop before Start and a second Stop are harmless; a
	// stopped bridge does not start again.
	t.Run("ConstructorStartsNothing", func(t *testing.T) {
		t.Parallel()
		f := newFakeTransport()
		n := outbox.NewNotifier(8)
		b, err := outbox.NewHintBridge(n, f, outbox.HintBridgeConfig{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		ctx := context.Background()
		require.NoError(t, b.Stop(ctx), "Stop before Start")
		n.Notify([]int{3}) // not subscribed yet
		select {
		case <-b.Stopped():
			t.Fatal("Stopped closed for a bridge never started")
		default:
		}
		require.NoError(t, b.Start(ctx))
		require.NoError(t, b.Start(ctx), "Start on a running bridge")
		f.nextListen(t)
		require.Zero(t, f.calls.Load(), "the commit before Start was not sent")
		n.Notify([]int{4})
		got, _ := f.nextPublish(t)
		require.Equal(t, []int{4}, got)
		require.NoError(t, b.Stop(ctx))
		<-b.Stopped()
		require.NoError(t, b.Err())
		require.NoError(t, b.Stop(ctx), "second Stop")
		require.Error(t, b.Start(ctx), "a bridge runs once")
	})

	t.Run("NilBridge", func(t *testing.T) {
		t.Parallel()
		var b *outbox.HintBridge
		require.NoError(t, b.Stop(context.Background()))
	})

	t.Run("Config", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		for _, tc := range []struct {
			field string
			n     *outbox.Notifier
			tr    outbox.Transport
			cfg   outbox.HintBridgeConfig
		}{
			{"notifier", nil, newFakeTransport(), outbox.HintBridgeConfig{}},
			{"transport", outbox.NewNotifier(8), nil, outbox.HintBridgeConfig{}},
			{"BackoffMin", outbox.NewNotifier(8), newFakeTransport(), outbox.HintBridgeConfig{BackoffMin: -1}},
			{"BackoffMax", outbox.NewNotifier(8), newFakeTransport(), outbox.HintBridgeConfig{BackoffMin: time.Second, BackoffMax: time.Millisecond}},
			{"PublishTimeout", outbox.NewNotifier(8), newFakeTransport(), outbox.HintBridgeConfig{PublishTimeout: -1}},
		} {
			_, err := outbox.StartHintBridge(ctx, tc.n, tc.tr, tc.cfg)
			var ce *outbox.ConfigError
			require.ErrorAs(t, err, &ce, tc.field)
			require.Equal(t, tc.field, ce.Field)
		}
		cfg := outbox.HintBridgeConfig{BackoffMin: 20 * time.Second}.WithDefaults()
		require.Equal(t, 20*time.Second, cfg.BackoffMax, "BackoffMax defaults to at least BackoffMin")
		require.NoError(t, cfg.Validate())
	})
}

// stubbornTransport's Listen ignores its context until released.
type stubbornTransport struct {
	release   chan struct{}
	listening chan struct{}
	once      sync.Once
}

func (s *stubbornTransport) Publish(context.Context, []int) error { return nil }

func (s *stubbornTransport) Listen(ctx context.Context, _ func(int)) error {
	s.once.Do(func() { close(s.listening) })
	<-s.release
	return ctx.Err()
}
