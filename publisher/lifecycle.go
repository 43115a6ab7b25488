package publisher

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gorm-outbox/outbox/internal/startstop"
	"github.com/gorm-outbox/outbox/relay"
)

// ErrNotStarted is wrapped by the error Publish returns, and
// Transactional.LeasesAcquired, before Start connected the publisher. The
// error is a *relay.MisconfigurationError (relay.IsMisconfiguration reports
// true), so a relay running with a publisher that was never started stops
// with it instead of retrying.
var ErrNotStarted = errors.New("publisher: not started")

// ErrStopped is wrapped by the error Start returns on a publisher that
// was stopped or closed: a publisher runs once.
var ErrStopped = startstop.ErrStopped

var errStopped = fmt.Errorf("publisher: start: %w", ErrStopped)

// notStarted is the error of a publisher named name used before Start.
func notStarted(name string) error {
	return &relay.MisconfigurationError{Setting: name, Reason: "call Start before the relay publishes", Err: ErrNotStarted}
}

// closedAtStart is CheckReady's error for a publisher named name that was
// stopped or closed.
func closedAtStart(name string) error {
	return &relay.MisconfigurationError{Setting: name, Reason: "the publisher was stopped or closed; a publisher runs once, create a new one", Err: ErrClosed}
}

// lifecycle gives a Kafka publisher the shape of the module's other
// background services: the constructor connects nothing; Start(ctx)
// connects, bounded by ctx, and ties the publisher to ctx (its end closes
// the publisher); Stop(ctx) closes it synchronously, bounded by ctx;
// Stopped and Err report the end. Stop before Start and a second Stop are
// harmless; Start after Stop fails with ErrStopped.
//
// A Start that fails (the connect failed, or ctx ended first) leaves the
// publisher unstarted: Start may be called again.
type lifecycle struct {
	starting chan struct{} // held by the Start in progress; see newLifecycle

	mu      sync.Mutex
	running bool // a Start succeeded
	stopped bool // Stop or Close was called
	life    startstop.Service
}

func newLifecycle() lifecycle {
	return lifecycle{starting: make(chan struct{}, 1)}
}

// start connects with connect, one Start at a time, then runs a goroutine
// that closes the publisher with closeFn when ctx ends or Stop is called.
// connect must be bounded by ctx; it returns errStopped when the
// publisher closed meanwhile.
func (l *lifecycle) start(ctx context.Context, connect func(context.Context) error, closeFn func() error) error {
	select {
	case l.starting <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("publisher: start: %w", ctx.Err())
	}
	defer func() { <-l.starting }()

	l.mu.Lock()
	stopped, running := l.stopped, l.running
	l.mu.Unlock()
	switch {
	case stopped:
		return errStopped
	case running:
		select {
		case <-l.life.Stopped():
			return errStopped
		default:
			return nil
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("publisher: start: %w", err)
	}
	if err := connect(ctx); err != nil {
		return err // it says what failed
	}

	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stopped {
		// Stop ran while connecting: its close closed what connect
		// installed.
		return errStopped
	}
	// Connected: from here the publisher is started, and the end of ctx
	// closes it, even if ctx ended a moment ago. The service's own context
	// ends with Stop only, so that its Start cannot fail now.
	if err := l.life.Start(context.WithoutCancel(ctx), func(stop context.Context) error {
		select {
		case <-stop.Done():
		case <-ctx.Done():
		}
		return closeFn()
	}); err != nil {
		return fmt.Errorf("publisher: start: %w", err)
	}
	l.running = true
	return nil
}

// stop seals the publisher and waits for its close and for a started
// lifecycle to end, or for ctx: the close then finishes in the
// background, and Stopped closes when it has. seal runs at once, before
// stop can return: it refuses new batches (Publish fails with ErrClosed
// from then on, even when ctx ended first) and returns the rest of the
// close, which may wait for the broker. Both are idempotent: a later
// seal's close waits for the first.
func (l *lifecycle) stop(ctx context.Context, seal func() (finish func() error)) error {
	l.mu.Lock()
	l.stopped = true
	l.mu.Unlock()
	finish := seal()
	done := make(chan error, 1)
	go func() { done <- finish() }()
	select {
	case err := <-done:
		if err != nil {
			return err
		}
	case <-ctx.Done():
		// Still tell a started lifecycle to end: its goroutine's close
		// waits for this one, so Stopped closes once the close finished.
		_ = l.life.Stop(ctx)
		return fmt.Errorf("publisher: stop: %w", ctx.Err())
	}
	if err := l.life.Stop(ctx); err != nil {
		return fmt.Errorf("publisher: stop: %w", err)
	}
	return nil
}

// guard is what connect needs of a publisher: its mutex, the closed flag
// it guards, and the wait group its close waits on.
type guard struct {
	mu     *sync.Mutex
	closed *bool
	wg     *sync.WaitGroup
}

// connect runs open on a goroutine of its own, counted in g.wg, and hands
// what it opened to install, with g.mu held, unless ctx ends first: connect
// then returns (wraps) ctx's error at once, and whatever open returns
// later goes to discard. If the publisher is closed before or when open
// returns, connect returns errStopped and discards what was opened. The
// count ends after install or discard, so that a close waiting on g.wg
// also waits for what was opened to be installed or discarded. sarama's
// constructors take no context; this is what bounds them by one.
func connect[T any](ctx context.Context, g guard, open func() (T, error), install func(T), discard func(T)) error {
	g.mu.Lock()
	if *g.closed {
		g.mu.Unlock()
		return errStopped
	}
	g.wg.Add(1)
	g.mu.Unlock()

	type opened struct {
		v   T
		err error
	}
	got := make(chan opened)
	abandoned := make(chan struct{})
	go func() {
		v, err := open()
		select {
		case got <- opened{v, err}:
			// connect owns v and the count now.
		case <-abandoned:
			if err == nil {
				discard(v)
			}
			g.wg.Done()
		}
	}()
	select {
	case o := <-got:
		defer g.wg.Done()
		if o.err != nil {
			return o.err
		}
		g.mu.Lock()
		if *g.closed {
			g.mu.Unlock()
			discard(o.v)
			return errStopped
		}
		install(o.v)
		g.mu.Unlock()
		return nil
	case <-ctx.Done():
		close(abandoned)
		return fmt.Errorf("publisher: start: %w", ctx.Err())
	}
}
