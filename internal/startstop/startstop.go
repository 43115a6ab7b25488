// Package startstop is the one lifecycle of the module's background
// services (the hint bridge, the pgnotify transport, the Kafka
// publishers; the relay follows the same contract): a constructor that
// starts nothing, Start(ctx) that backgrounds the work, a synchronous
// Stop(ctx) bounded by its context, Stopped and Err. Stop before Start and
// a second Stop are harmless.
package startstop

import (
	"context"
	"errors"
	"sync"
)

// ErrStopped is returned by Start on a service that has already stopped:
// a service runs once.
var ErrStopped = errors.New("outbox: service already stopped")

// Service runs one background function. The zero value is ready to use.
type Service struct {
	mu      sync.Mutex
	started bool
	stopped chan struct{}
	cancel  context.CancelFunc
	err     error
}

func (s *Service) init() {
	if s.stopped == nil {
		s.stopped = make(chan struct{})
	}
}

// Start runs run on its own goroutine with a context derived from ctx
// that Stop cancels, and returns at once. When run returns, its error is
// kept for Err and Stopped is closed. Start on a running service does
// nothing and returns nil; on a stopped one it returns ErrStopped; with ctx
// already ended it returns ctx's error and starts nothing.
func (s *Service) Start(ctx context.Context, run func(ctx context.Context) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.init()
	if s.started {
		select {
		case <-s.stopped:
			return ErrStopped
		default:
			return nil
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	s.started, s.cancel = true, cancel
	go func() {
		err := run(ctx)
		cancel()
		s.mu.Lock()
		s.err = err
		s.mu.Unlock()
		close(s.stopped)
	}()
	return nil
}

// Stop cancels the running function and waits until it has returned, or
// until ctx ends: it then returns ctx's error and the function finishes in
// the background (watch Stopped). Stop before Start and a second Stop
// return nil once stopped.
func (s *Service) Stop(ctx context.Context) error {
	s.mu.Lock()
	s.init()
	started, cancel := s.started, s.cancel
	s.mu.Unlock()
	if !started {
		return nil
	}
	cancel()
	select {
	case <-s.stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Stopped returns a channel closed when the function has returned, by
// Stop, by the cancellation of the Start context or on its own. It is never
// closed for a service that was never started.
func (s *Service) Stopped() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.init()
	return s.stopped
}

// Err returns the error the function returned; nil while it runs, after a
// clean stop, or if it never started.
func (s *Service) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// StartOwned starts a service its owner stops later (an owned
// publisher): start runs under a context of its own, detached from ctx
// so that the end of ctx does not close a service its owner still stops
// gracefully, while the wait for start is bounded by ctx (its end cancels
// the start, leaving the service unstarted, and is returned). On success
// it returns the cancel of that context, for the owner to call once it
// stopped the service.
func StartOwned(ctx context.Context, start func(context.Context) error) (end context.CancelFunc, err error) {
	life, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- start(life) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		cancel() // ends the connect; the service stays unstarted
		<-done
		err = ctx.Err()
	}
	if err != nil {
		cancel()
		return nil, err
	}
	return cancel, nil
}
