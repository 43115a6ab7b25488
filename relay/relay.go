package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox/internal/startstop"
)

// StopOverrun is the longest Relay.Stop waits for the relay after its
// context ended: the bound on Stop overrunning its context.
const StopOverrun = 5 * time.Second

type runState int

const (
	stateIdle runState = iota
	stateRunning
	stateDraining // DrainOnce in progress
	stateStopped
)

// Relay publishes an outbox's pending messages: it leases its fair share of
// buckets, drains them oldest-first through a Publisher, and deletes what
// the publisher acknowledged. See the package documentation for the model.
//
// A Relay runs once: Start, then Stop. DrainOnce is a one-shot alternative
// to Start for jobs and tests.
type Relay struct {
	parts // resolved by New, shared by every run
	// ready checks the publisher at start; nil if it does not implement
	// ReadyChecker.
	ready ReadyChecker
	// owned is the publisher's lifecycle when the relay owns it
	// (Config.OwnPublisher); nil otherwise.
	owned PublisherService

	// startMu serializes Start and Run: an owned publisher is started
	// and, on a failed start, stopped by one of them at a time.
	startMu sync.Mutex
	// pubLife ends the context an owned publisher was started with, once
	// it has been stopped.
	pubLife context.CancelFunc

	mu         sync.Mutex
	state      runState
	stopping   chan struct{} // closed by Stop: stop claiming, finish the batch
	cancelHard context.CancelCauseFunc
	stopped    chan struct{} // closed when the run loop has ended
	err        error
	eng        *engine // the current run, for Leases
}

// New returns a relay draining store through publisher. cfg is completed
// with WithDefaults and validated; an invalid field is reported as a
// *ConfigError. Optional store capabilities (LeaseRenewer, FailureRecorder,
// StartChecker, and FailureHandler as the default Config.FailureHandler),
// the failure handler's BatchFilter and the publisher's LeaseAware,
// ReadyChecker and, with Config.OwnPublisher, PublisherService are
// detected here.
func New(store Store, publisher Publisher, cfg Config) (*Relay, error) {
	if store == nil {
		return nil, &ConfigError{Field: "store", Value: nil, Reason: "a Store is required"}
	}
	if publisher == nil {
		return nil, &ConfigError{Field: "publisher", Value: nil, Reason: "a Publisher is required"}
	}
	if err := takeBucketCount(store, &cfg); err != nil {
		return nil, err
	}
	if _, ok := publisher.(Reconciler); ok && cfg.BatchSize == 0 {
		cfg.BatchSize = BatchSizeReconcilerDefault
	}
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cfg.Logger = cfg.Logger.With("relay_id", cfg.RelayID)
	r := &Relay{parts: resolveParts(store, publisher, cfg), stopped: make(chan struct{})}
	r.ready, _ = publisher.(ReadyChecker)
	if cfg.OwnPublisher {
		svc, ok := publisher.(PublisherService)
		if !ok {
			return nil, &ConfigError{Field: "OwnPublisher", Value: true,
				Reason: fmt.Sprintf("the publisher (%T) has no Start and Stop (PublisherService) for the relay to own", publisher)}
		}
		r.owned = svc
	}
	return r, nil
}

// ID returns the relay's id, as written to lease owners and heartbeats.
func (r *Relay) ID() string { return r.cfg.RelayID }

// Publisher returns the publisher the relay publishes through: the one
// given to New, or the one a constructor built for it
// (gormrelay.NewKafka), for its own metrics and state.
func (r *Relay) Publisher() Publisher { return r.publisher }

// Start checks the store and the publisher and starts the relay in the
// background. Run is the blocking form, and the one to prefer: it cannot
// stop on an error that nobody reads.
//
// Start fails synchronously, bounded by ctx, on what it can know before
// running:
//   - if the Store implements StartChecker (the GORM store does), a
//     *MisconfigurationError it reports: missing or outdated tables, a
//     BucketCount that differs from the store's, rows or leases outside
//     the buckets. Any other check failure (the database down or slow) is
//     logged and the relay starts anyway, retrying in the background;
//   - with Config.OwnPublisher, the publisher's Start error (no broker
//     answers);
//   - if the Publisher implements ReadyChecker (the Kafka publishers do),
//     a *MisconfigurationError it reports, such as a publisher that was
//     never started (errors.Is(err, publisher.ErrNotStarted)).
//
// The relay then runs until Stop is called, ctx is cancelled, or it meets
// a misconfiguration later (see Err); a relay that stops on one releases
// its leases like Stop. Cancelling ctx is an abrupt stop: the in-flight
// publish is cancelled, then leases are released as with Stop. A publisher
// the relay owns is stopped after the relay stopped, before Stopped is
// closed.
//
// Start on a running relay does nothing; on a stopped relay it returns
// ErrStopped; during DrainOnce it returns ErrBusy.
func (r *Relay) Start(ctx context.Context) error { return r.start(ctx, ctx) }

// Run starts the relay as Start does, with the same synchronous checks,
// and blocks until it has stopped. When ctx ends, Run stops the relay
// gracefully, as Stop does (stop claiming, finish the in-flight batch,
// delete what was acknowledged, release the leases), bounded by
// Config.ShutdownTimeout, and then stops a publisher the relay owns. Run
// returns:
//   - nil after a clean stop at the end of ctx (or by a Stop called
//     elsewhere);
//   - the error Start would return, if the relay could not start;
//   - the relay's fatal error (what Err reports, a *MisconfigurationError)
//     if it stopped on its own, at once;
//   - an error wrapping context.DeadlineExceeded if the graceful stop took
//     longer than ShutdownTimeout: the in-flight publish was cancelled and
//     its rows stay pending for the next owner.
//
// Run is the recommended way to run a relay: under errgroup (or beside an
// HTTP server) a relay that stops on error ends the process's wait instead
// of stopping silently.
//
//	g, ctx := errgroup.WithContext(ctx)
//	g.Go(func() error { return r.Run(ctx) })
//	g.Go(func() error { return serveHTTP(ctx) })
//	return g.Wait()
func (r *Relay) Run(ctx context.Context) error {
	// The relay's life is not ctx: the end of ctx is a graceful stop
	// below, not the abrupt one of a cancelled Start context.
	if err := r.start(ctx, context.WithoutCancel(ctx)); err != nil {
		return err
	}
	select {
	case <-r.stopped:
		return r.Err()
	case <-ctx.Done():
	}
	stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ShutdownTimeout)
	defer cancel()
	stopErr := r.Stop(stopCtx)
	if err := r.Err(); err != nil {
		return err
	}
	if stopErr != nil {
		return fmt.Errorf("relay: run: graceful stop exceeded ShutdownTimeout (%s): %w", r.cfg.ShutdownTimeout, stopErr)
	}
	return nil
}

// start runs Start's checks bounded by ctx and starts the relay, whose
// run ends with life (abruptly) or Stop (gracefully).
func (r *Relay) start(ctx, life context.Context) error {
	r.startMu.Lock()
	defer r.startMu.Unlock()
	r.mu.Lock()
	state := r.state
	r.mu.Unlock()
	switch state {
	case stateRunning:
		return nil
	case stateDraining:
		return ErrBusy
	case stateStopped:
		return ErrStopped
	}
	err := r.startChecked(ctx, life)
	if err != nil && !errors.Is(err, ErrBusy) && !errors.Is(err, ErrStopped) {
		// Err reports a failed start until a later start succeeds
		// (launch clears it): a liveness probe reading Err must fail
		// for a relay that never ran, not only for one that stopped.
		r.mu.Lock()
		r.err = err
		r.mu.Unlock()
	}
	return err
}

// startChecked runs start's checks and launches the relay.
func (r *Relay) startChecked(ctx, life context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("relay: start: %w", err)
	}
	if err := r.checkStore(ctx); err != nil {
		return err
	}
	if r.owned != nil {
		if err := r.startPublisher(ctx); err != nil {
			return err
		}
	}
	err := r.checkReady(ctx)
	if err == nil {
		err = r.launch(ctx, life)
	}
	if err != nil && r.owned != nil {
		r.stopPublisher()
	}
	return err
}

// launch moves an idle relay to running and starts its loop.
func (r *Relay) launch(ctx, life context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch r.state {
	case stateDraining:
		return ErrBusy
	case stateStopped:
		return ErrStopped
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("relay: start: %w", err)
	}
	hard, cancel := context.WithCancelCause(life)
	r.state = stateRunning
	r.err = nil // a failed earlier start
	r.stopping = make(chan struct{})
	r.cancelHard = cancel
	r.eng = newEngine(hard, r.parts, false)
	go r.run(hard, r.eng, r.stopping)
	return nil
}

// checkStore runs the store's StartChecker, if it has one: a
// misconfiguration (or the end of ctx) fails the start, anything else is
// logged.
func (r *Relay) checkStore(ctx context.Context) error {
	sc, ok := r.store.(StartChecker)
	if !ok {
		return nil
	}
	err := sc.CheckStart(ctx, r.cfg.BucketCount)
	switch {
	case err == nil:
	case IsMisconfiguration(err) || ctx.Err() != nil:
		return fmt.Errorf("relay: start: %w", err)
	default:
		// The database is down or slow: not a misconfiguration. The
		// loop retries with backoff and meets any misconfiguration at
		// its first acquisition.
		r.cfg.Logger.Warn("relay: start check failed; starting anyway and retrying in the background", "err", err)
	}
	return nil
}

// checkReady runs the publisher's ReadyChecker, if it has one, like
// checkStore.
func (r *Relay) checkReady(ctx context.Context) error {
	if r.ready == nil {
		return nil
	}
	err := r.ready.CheckReady(ctx)
	switch {
	case err == nil:
	case IsMisconfiguration(err) || ctx.Err() != nil:
		return fmt.Errorf("relay: start: publisher: %w", err)
	default:
		r.cfg.Logger.Warn("relay: publisher check failed; starting anyway", "err", err)
	}
	return nil
}

// startPublisher starts the owned publisher, bounded by ctx, under a
// context of its own that ends only once the relay stopped it: the end of
// ctx must not close the publisher of a relay that stops gracefully.
func (r *Relay) startPublisher(ctx context.Context) error {
	end, err := startstop.StartOwned(ctx, r.owned.Start)
	if err != nil {
		return fmt.Errorf("relay: start the publisher: %w", err)
	}
	r.pubLife = end
	return nil
}

// stopPublisher stops the owned publisher, bounded by ShutdownTimeout,
// and logs a failure: the relay's own outcome does not depend on it, as
// every publish has returned by now.
func (r *Relay) stopPublisher() {
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.ShutdownTimeout)
	defer cancel()
	if err := r.owned.Stop(ctx); err != nil {
		r.cfg.Logger.Warn("relay: the publisher did not stop cleanly", "err", err)
	}
	if r.pubLife != nil {
		r.pubLife()
	}
}

func (r *Relay) run(ctx context.Context, e *engine, stopping <-chan struct{}) {
	log := r.cfg.Logger
	log.Debug("relay: started")
	stopSampler := r.startSampler(ctx, e.k)
	err := e.run(ctx, stopping)
	stopSampler()
	e.releaseAll(ctx)
	if r.owned != nil {
		// Every publish has returned: flush and close the publisher
		// before Stopped reports the relay stopped.
		r.stopPublisher()
	}
	r.mu.Lock()
	r.err = err
	r.state = stateStopped
	cancel := r.cancelHard
	r.mu.Unlock()
	cancel(nil)
	if err != nil {
		log.Error("relay: stopped on error", "err", err)
	} else {
		log.Debug("relay: stopped")
	}
	close(r.stopped)
}

// Stop stops the relay and waits until it has stopped: it stops claiming
// batches, lets the in-flight batch finish, deletes what was acknowledged,
// and releases its leases so a peer takes the buckets over at its next
// acquisition instead of after the leases expire. If ctx ends first, the
// in-flight publish is cancelled (its rows stay pending for the next owner),
// the leases are still released, and Stop returns ctx's error once the
// relay has stopped, or at most StopOverrun after ctx ended: a publisher
// that ignores its context, or a database that does not answer the final
// delete and release (each bounded by its own timeout), can hold the
// relay longer, and it then finishes stopping in the background (watch
// Stopped). The worst-case overrun of Stop past ctx is StopOverrun (5s).
//
// Stop before Start and a second Stop do nothing and return nil.
func (r *Relay) Stop(ctx context.Context) error {
	r.mu.Lock()
	if r.state != stateRunning {
		r.mu.Unlock()
		return nil
	}
	select {
	case <-r.stopping:
	default:
		close(r.stopping)
	}
	cancel := r.cancelHard
	r.mu.Unlock()

	select {
	case <-r.stopped:
		return nil
	case <-ctx.Done():
	}
	cancel(fmt.Errorf("relay: stop: %w", context.Cause(ctx)))
	t := time.NewTimer(StopOverrun)
	defer t.Stop()
	select {
	case <-r.stopped:
		return fmt.Errorf("relay: stop: in-flight batch abandoned: %w", ctx.Err())
	case <-t.C:
		return fmt.Errorf("relay: stop: still stopping %s after the stop context ended (a publish or store call ignoring cancellation); it finishes in the background: %w", StopOverrun, ctx.Err())
	}
}

// Stopped returns a channel closed when the relay has stopped, whether by
// Stop, by its Start context, or by an error reported by Err. It is never
// closed for a relay that was never started.
func (r *Relay) Stopped() <-chan struct{} { return r.stopped }

// Err returns why the relay stopped or could not start: nil after Stop
// or a cancelled Start context, a *MisconfigurationError when it met a
// problem retrying cannot fix while running, and the error the last
// Start or Run returned when the relay could not start (Stopped is then
// not closed: the relay never ran). It returns nil while the relay runs
// and before its first start. DrainOnce updates it too: a
// *MisconfigurationError it returns is reported here, and a DrainOnce
// that ran without one (its ctx alive to the end) clears the error of an
// earlier failed start or drain.
func (r *Relay) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Leases returns the leases the relay currently holds and trusts, by
// bucket. It is a local view, refreshed at every acquisition and renewal,
// not a database query.
func (r *Relay) Leases() []Lease {
	r.mu.Lock()
	e := r.eng
	r.mu.Unlock()
	if e == nil {
		return nil
	}
	return e.k.trustedLeases()
}

// DrainOnce acquires the relay's fair share of buckets, drains each owned
// bucket until it is empty, releases the leases and returns how many
// messages were published and deleted. It is meant for jobs and tests;
// with other relays running it drains only the buckets it could lease.
//
// A bucket whose publish fails is not retried: DrainOnce moves on to the
// other buckets and returns the failures joined into its error, together
// with the count of what did succeed. A *MisconfigurationError ends it at
// once.
//
// DrainOnce returns ErrBusy while the relay is started and ErrStopped after
// it was stopped. It may be called repeatedly. Like Start, it first runs
// the publisher's ReadyChecker, and fails at once on a publisher that was
// never started. A relay that owns its publisher (Config.OwnPublisher)
// refuses it with a *ConfigError.
func (r *Relay) DrainOnce(ctx context.Context) (int, error) {
	if r.owned != nil {
		return 0, &ConfigError{Field: "OwnPublisher", Value: true,
			Reason: "DrainOnce neither starts nor stops a publisher: use Run or Start, or start the publisher yourself and leave OwnPublisher false"}
	}
	r.mu.Lock()
	switch r.state {
	case stateRunning, stateDraining:
		r.mu.Unlock()
		return 0, ErrBusy
	case stateStopped:
		r.mu.Unlock()
		return 0, ErrStopped
	}
	r.state = stateDraining
	r.mu.Unlock()
	var err error
	defer func() {
		r.mu.Lock()
		r.state = stateIdle
		r.noteDrain(ctx, err)
		r.mu.Unlock()
	}()
	if err = r.checkReady(ctx); err != nil {
		return 0, err
	}
	e := newEngine(ctx, r.parts, true)
	r.mu.Lock()
	r.eng = e
	r.mu.Unlock()

	n, err := e.drainAll(ctx)
	e.releaseAll(ctx)
	return n, err
}

// noteDrain keeps what Err reports in step with a DrainOnce that ended
// with err: a misconfiguration (from the publisher's ReadyChecker or
// met while draining) is reported like a failed start; a drain that ran
// without one clears an earlier failed start's error, as a successful
// Start does. A drain whose ctx ended tells nothing and changes nothing.
// r.mu must be held.
func (r *Relay) noteDrain(ctx context.Context, err error) {
	switch {
	case IsMisconfiguration(err):
		r.err = err
	case ctx.Err() == nil:
		r.err = nil
	}
}
