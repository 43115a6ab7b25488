package startstop

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLifecycle(t *testing.T) {
	t.Parallel()
	var s Service
	ctx := context.Background()
	require.NoError(t, s.Stop(ctx), "stop before start")
	select {
	case <-s.Stopped():
		t.Fatal("Stopped closed before Start")
	default:
	}

	var runs atomic.Int32
	run := func(ctx context.Context) error { runs.Add(1); <-ctx.Done(); return nil }
	require.NoError(t, s.Start(ctx, run))
	require.NoError(t, s.Start(ctx, run), "start while running")
	require.NoError(t, s.Stop(ctx))
	<-s.Stopped()
	require.NoError(t, s.Err())
	require.EqualValues(t, 1, runs.Load())
	require.NoError(t, s.Stop(ctx), "double stop")
	require.ErrorIs(t, s.Start(ctx, run), ErrStopped)
}

func TestErrAndStartContext(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	var s Service
	require.NoError(t, s.Start(context.Background(), func(context.Context) error { return boom }))
	<-s.Stopped()
	require.ErrorIs(t, s.Err(), boom)

	var c Service
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, c.Start(ctx, func(ctx context.Context) error { <-ctx.Done(); return nil }))
	cancel()
	<-c.Stopped() // the Start context ends it too
	require.NoError(t, c.Err())

	var d Service
	require.ErrorIs(t, d.Start(ctx, func(context.Context) error { return nil }), context.Canceled)
}

func TestStopBounded(t *testing.T) {
	t.Parallel()
	var s Service
	release := make(chan struct{})
	require.NoError(t, s.Start(context.Background(), func(context.Context) error { <-release; return nil }))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, s.Stop(ctx), context.DeadlineExceeded, "a function ignoring cancellation bounds Stop by ctx")
	close(release)
	<-s.Stopped()
	require.NoError(t, s.Stop(context.Background()))
}
