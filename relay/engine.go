package relay

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	ibackoff "github.com/gorm-outbox/outbox/internal/backoff"
)

// outcome is what one batch of one bucket came to.
type outcome int

const (
	outEmpty   outcome = iota // the bucket had no pending rows
	outDrained                // a partial batch was published: the bucket is empty as far as we know
	outFull                   // a full batch was published: more rows are probably waiting
	outFailed                 // the publish or a store call failed: back off
	outRetry                  // the failure handler cleared the way: read again at once
	outLost                   // the lease is gone: leave the rows to the new owner
	outStopped                // the relay is stopping and the publish was cancelled
)

// worker is one run of the relay engine (Start) or one DrainOnce. It
// joins the three parts of the engine: the lease keeper (keeper.go), the
// scheduler (scheduler.go) and a pool of drainers (drainer.go). Its
// control loop (run) owns acquisition, announcements to a LeaseAware
// publisher, hints and discovery.
type worker struct {
	r       *Relay
	cfg     Config
	log     *slog.Logger
	oneShot bool // DrainOnce: failures are reported, not retried

	k     *keeper
	sched *scheduler

	kickC     chan struct{} // wakes the control loop: a batch ended, a lease was lost
	published atomic.Int64

	mu        sync.Mutex
	fatal     error // a misconfiguration a drainer or the renewal met
	drainErrs []error

	hintBuf []int
	// announced is what a LeaseAware publisher was last told the relay
	// holds, by bucket: the keeper's lease, so that a bucket dropped and
	// found held again, even under the same term, is announced released
	// and then acquired (see syncLeases). Control loop only.
	announced map[int]*heldLease
	// deferred: syncLeases left a change for after a batch in flight.
	// Control loop only.
	deferred bool
}

func newWorker(r *Relay) *worker {
	w := &worker{
		r:     r,
		cfg:   r.cfg,
		log:   r.cfg.Logger,
		kickC: make(chan struct{}, 1),
	}
	w.sched = newScheduler(r.cfg.BucketCount, w.kick)
	w.k = newKeeper(w)
	return w
}

// kick wakes the control loop.
func (w *worker) kick() {
	select {
	case w.kickC <- struct{}{}:
	default:
	}
}

// setFatal records the first misconfiguration met off the control loop
// and stops the drainers.
func (w *worker) setFatal(err error) {
	w.mu.Lock()
	if w.fatal == nil {
		w.fatal = err
	}
	w.mu.Unlock()
	w.sched.close()
	w.kick()
}

func (w *worker) fatalErr() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.fatal
}

// init sets the context the leases' contexts derive from. It runs on the
// goroutine that acquires, before the first acquisition.
func (w *worker) init(ctx context.Context) {
	w.k.base = ctx
}

// startPool starts the drainers and returns the function that closes the
// scheduler and waits for them to finish their batches.
func (w *worker) startPool(ctx context.Context) (wait func(), stop func()) {
	n := min(w.cfg.Parallelism, w.cfg.BucketCount)
	w.sched.start(w.oneShot)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { w.drain(ctx) })
	}
	// A cancelled context stops handing out batches; the drainers' batches
	// see the cancellation themselves.
	unwatch := context.AfterFunc(ctx, w.sched.close)
	wait = func() {
		wg.Wait()
		unwatch()
	}
	stop = func() {
		w.sched.close()
		wait()
	}
	return wait, stop
}

// startRenewal starts renewing the leases in the background when the
// store can (LeaseRenewer), and returns the function that stops it.
func (w *worker) startRenewal(ctx context.Context) (stop func()) {
	return w.r.caps.renewal.start(ctx, w.k)
}

// run is the control loop of a started relay. It returns nil when stopped
// and an error only for a misconfiguration. Before it returns, the
// drainers have finished their batches. Each turn maintains the leases,
// takes hints, starts a discovery when one is due, and sleeps until the
// next thing to do (see sleep).
func (w *worker) run(ctx context.Context, stopping <-chan struct{}) error {
	w.init(ctx)
	defer w.k.close()
	// Deferred in this order, the drainers finish their batches while the
	// leases are still being renewed.
	defer w.startRenewal(ctx)()
	_, stopPool := w.startPool(ctx)
	defer stopPool()
	// Discovery runs beside the loop, so that hints are taken while the
	// store looks for pending rows; deferred last, it ends first.
	l := &loop{discovered: make(chan error, 1), timer: time.NewTimer(time.Hour), hintsC: w.r.caps.hints.Ready()}
	defer l.timer.Stop()
	defer l.discovery.Wait()
	for {
		if isStopping(ctx, stopping) {
			return nil
		}
		if err := w.fatalErr(); err != nil {
			return err
		}
		now := time.Now()
		worked, done, err := w.maintainLeases(ctx, l, now)
		if done {
			return err
		}
		owned := w.k.ownedCount()
		w.takeHints(l, owned, now)
		w.startDiscovery(ctx, l, owned, now)
		retry, retrying := w.sched.promote(time.Now())
		if worked {
			w.observeCycle(now)
		}
		if done, err := w.sleep(ctx, stopping, l, retry, retrying); done {
			return err
		}
	}
}

// loop is the control loop's state between its turns.
type loop struct {
	nextAcquire   time.Time // zero: acquire at once
	nextPoll      time.Time
	storeFailures int  // consecutive failed acquisitions
	discover      bool // a hint or a gained lease asks for a discovery
	discovering   bool // a discovery runs; its result comes on discovered
	discovered    chan error
	discovery     sync.WaitGroup
	timer         *time.Timer
	hintsC        <-chan struct{}
}

// maintainLeases acquires when acquisition is due or a lost lease asks
// for it, and announces lease changes to a LeaseAware publisher. worked
// says it acquired; done says the loop ends, with err.
func (w *worker) maintainLeases(ctx context.Context, l *loop, now time.Time) (worked, done bool, err error) {
	w.k.expireTrust()
	if now.Before(l.nextAcquire) && !w.k.takeNeedAcquire() {
		if w.deferred {
			// A change met during a bucket's batch, announced once that
			// batch ended (its drainer woke the loop).
			err = w.syncLeases(ctx)
		}
		return false, err != nil, err
	}
	// First announce the leases lost since the last acquisition, so a
	// bucket acquired again under its old term is announced anew.
	if err := w.syncLeases(ctx); err != nil {
		return true, true, err
	}
	// No new batch starts during the store call; the batches in flight go
	// on, and the store keeps their buckets (Busy), so a surplus lease is
	// released only between batches of its bucket.
	err = w.k.acquire(ctx, w.sched.hold())
	w.sched.resume()
	switch {
	case err == nil:
		l.storeFailures = 0
		l.nextAcquire = now.Add(jitter(w.cfg.LeaseRenewInterval))
	case IsMisconfiguration(err):
		return true, true, err
	case isStop(ctx, err):
		return true, true, nil
	default:
		l.storeFailures++
		d := backoff(w.cfg, l.storeFailures)
		w.log.Warn("relay: acquire leases failed", "err", err, "retry_in", d)
		l.nextAcquire = now.Add(d)
	}
	w.k.expireTrust()
	err = w.syncLeases(ctx)
	return true, err != nil, err
}

// takeHints marks the hinted buckets the relay holds ready. An
// unknown-bucket hint asks for a discovery. A relay owning nothing drops
// its hints.
func (w *worker) takeHints(l *loop, owned int, now time.Time) {
	var unknown bool
	w.hintBuf, unknown = w.r.caps.hints.Take(w.hintBuf[:0])
	if owned == 0 {
		return
	}
	for _, b := range w.hintBuf {
		if b < 0 || b >= w.cfg.BucketCount {
			continue
		}
		if _, ok := w.k.lease(b); ok {
			w.sched.mark(b, now)
		}
	}
	l.discover = l.discover || unknown
}

// startDiscovery starts a discovery beside the loop when one was asked
// for or the poll is due, unless one runs. A hint or a gained lease
// asking for discovery meanwhile asks for the next one: this one may
// have read before their rows.
func (w *worker) startDiscovery(ctx context.Context, l *loop, owned int, now time.Time) {
	if w.k.takeNeedDiscover() {
		l.discover = true
	}
	if owned == 0 || l.discovering || (!l.discover && now.Before(l.nextPoll)) {
		return
	}
	l.discover, l.discovering = false, true
	l.discovery.Go(func() {
		start := time.Now()
		err := w.discover(ctx)
		w.observeCycle(start)
		l.discovered <- err
	})
}

// sleep waits until the next lease refresh, poll or backoff end, a hint,
// a discovery's end or a drainer's news. A relay owning nothing waits for
// its next lease refresh only. done says the loop ends, with err.
func (w *worker) sleep(ctx context.Context, stopping <-chan struct{}, l *loop, retry time.Time, retrying bool) (done bool, err error) {
	wake := l.nextAcquire
	if w.k.ownedCount() > 0 {
		if !l.discovering {
			wake = earliest(wake, l.nextPoll)
		}
		if retrying {
			wake = earliest(wake, retry)
		}
	}
	l.timer.Reset(time.Until(wake))
	select {
	case <-ctx.Done():
		return true, nil
	case <-stopping:
		return true, nil
	case <-l.timer.C:
	case <-l.hintsC:
	case <-w.kickC:
	case err := <-l.discovered:
		return w.discovered(ctx, l, err)
	}
	return false, nil
}

// discovered takes a discovery's result and sets the next poll.
func (w *worker) discovered(ctx context.Context, l *loop, err error) (done bool, _ error) {
	l.discovering = false
	switch {
	case err == nil:
		l.nextPoll = time.Now().Add(jitter(w.cfg.PollInterval))
	case IsMisconfiguration(err):
		return true, err
	case isStop(ctx, err):
		return true, nil
	default:
		w.log.Warn("relay: find pending buckets failed", "err", err)
		l.nextPoll = time.Now().Add(backoff(w.cfg, 1))
	}
	return false, nil
}

// drainRoundsMax bounds DrainOnce's rounds: a round acquires, drains
// every owned bucket, and looks for pending rows in buckets it did not
// own; a lease that lapsed mid-drain (a slow database) is acquired again
// in the next round.
const drainRoundsMax = 4

// drainAll is DrainOnce: acquire, drain every owned bucket until empty or
// failed, again while buckets with pending rows were lost and progress is
// made, and report the buckets with pending rows it could not own.
func (w *worker) drainAll(ctx context.Context) (int, error) {
	w.init(ctx)
	defer w.k.close()
	defer w.startRenewal(ctx)()
	all := make([]int, w.cfg.BucketCount)
	for b := range all {
		all[b] = b
	}
	published := func() int { return int(w.published.Load()) }
	joined := func(extra ...error) error {
		w.mu.Lock()
		defer w.mu.Unlock()
		return errors.Join(append(slices.Clone(w.drainErrs), extra...)...)
	}
	for round := 1; ; round++ {
		if err := w.k.acquire(ctx, nil); err != nil { // no batch in flight between rounds
			return published(), err
		}
		if err := w.syncLeases(ctx); err != nil {
			return published(), err
		}
		w.k.takeNeedDiscover()
		if err := w.discover(ctx); err != nil {
			return published(), err
		}
		before := published()
		wait, _ := w.startPool(ctx)
		wait()
		if err := w.fatalErr(); err != nil {
			return published(), err
		}
		if err := ctx.Err(); err != nil {
			return published(), joined(err)
		}
		w.k.expireTrust()
		if err := w.syncLeases(ctx); err != nil {
			return published(), err
		}
		pending, err := w.r.store.PendingBuckets(ctx, all)
		if err != nil {
			return published(), joined(err)
		}
		var unowned []int
		for _, b := range pending {
			if w.sched.failedBucket(b) {
				continue // reported with its error
			}
			if _, ok := w.k.lease(b); !ok {
				unowned = append(unowned, b)
			}
		}
		if len(unowned) == 0 {
			break
		}
		// Stop after a round that acquired again and still made no
		// progress: peers hold those buckets.
		if round == drainRoundsMax || (round > 1 && published() == before) {
			w.mu.Lock()
			w.drainErrs = append(w.drainErrs, &NotOwnedError{Buckets: unowned})
			w.mu.Unlock()
			break
		}
	}
	return published(), joined()
}

// discover asks the store which owned buckets hold pending rows, of those
// neither ready nor in flight (see scheduler.toProbe).
func (w *worker) discover(ctx context.Context) error {
	owned := w.k.trustedLeases()
	if len(owned) == 0 {
		return nil
	}
	buckets := make([]int, len(owned))
	for i, l := range owned {
		buckets[i] = l.Bucket
	}
	// Called even when nothing is left to probe: the store checks for
	// rows beyond BucketCount at every discovery.
	buckets = w.sched.toProbe(buckets)
	pending, err := w.r.store.PendingBuckets(ctx, buckets)
	if err != nil {
		return err
	}
	now := time.Now()
	for _, b := range pending {
		if _, ok := w.k.lease(b); ok {
			w.sched.mark(b, now)
		}
	}
	return nil
}

// releaseAll gives up every lease; it runs when the loop ends, after the
// drainers finished, under context.WithoutCancel so a cancelled or
// expired stop context still lets peers take over at once.
func (w *worker) releaseAll(ctx context.Context) {
	held := w.k.releaseAll()
	w.cfg.Observer.OwnedBuckets(0)
	_ = w.syncLeases(context.WithoutCancel(ctx)) // tell the publisher first; never a misconfiguration here
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	if err := w.r.store.ReleaseLeases(rctx, w.cfg.RelayID, held); err != nil {
		w.log.Warn("relay: release leases failed; peers take the buckets over when the leases expire", "err", err)
		return
	}
	if len(held) > 0 {
		w.log.Info("relay: released leases", "buckets", len(held))
	}
}

// trustedLeases is Relay.Leases.
func (w *worker) trustedLeases() []Lease {
	return w.k.trustedLeases()
}

// lease returns the trusted lease of bucket b.
func (w *worker) lease(b int) (Lease, bool) {
	hl, ok := w.k.lease(b)
	if !ok {
		return Lease{}, false
	}
	return hl.Lease, true
}

func (w *worker) ownedCount() int {
	return w.k.ownedCount()
}

// syncLeases tells a LeaseAware publisher how the held leases changed
// since it was last told: first the released ones (a bucket re-acquired
// under a new term counts as released, then acquired), then the acquired
// ones, which drainers take only once announced. It runs on the control
// loop, or after the drainers finished, and never announces a bucket
// whose batch is in flight: that bucket's change is announced once the
// batch ends (the scheduler wakes the loop). It returns an error only for
// a misconfiguration.
func (w *worker) syncLeases(ctx context.Context) error {
	la := w.r.leaseAware
	if la == nil {
		return nil
	}
	cur := w.k.trustedHeld()
	next := make(map[int]*heldLease, len(cur))
	var acquired, released []Lease
	var gained []*heldLease
	w.deferred = false
	for _, hl := range cur {
		prev, ok := w.announced[hl.Bucket]
		switch {
		case ok && prev == hl:
			next[hl.Bucket] = hl
		case w.sched.busyWake(hl.Bucket):
			w.deferred = true
			if ok {
				next[hl.Bucket] = prev // still announced as before
			}
		default:
			acquired = append(acquired, hl.Lease)
			gained = append(gained, hl)
			next[hl.Bucket] = hl
		}
	}
	for b, prev := range w.announced {
		if next[b] == prev {
			continue
		}
		if w.sched.busyWake(b) {
			w.deferred = true
			next[b] = prev
			continue
		}
		released = append(released, prev.Lease)
	}
	w.announced = next
	if len(released) > 0 {
		slices.SortFunc(released, func(a, b Lease) int { return a.Bucket - b.Bucket })
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		la.LeasesReleased(rctx, released)
		cancel()
	}
	if len(acquired) > 0 {
		actx, cancel := context.WithDeadline(ctx, w.k.trustDeadline())
		err := la.LeasesAcquired(actx, acquired)
		cancel()
		if IsMisconfiguration(err) {
			return err
		}
		if err != nil && !isStop(ctx, err) {
			w.log.Warn("relay: publisher could not prepare for acquired leases", "buckets", len(acquired), "err", err)
		}
		w.k.announced(gained)
	}
	return nil
}

func isStopping(ctx context.Context, stopping <-chan struct{}) bool {
	if ctx.Err() != nil {
		return true
	}
	select {
	case <-stopping:
		return true
	default:
		return false
	}
}

// backoff returns the wait after the n-th consecutive failure: BackoffMin
// doubled n-1 times, capped at BackoffMax, with the upper half jittered.
func backoff(cfg Config, n int) time.Duration {
	return ibackoff.Exponential(cfg.BackoffMin, cfg.BackoffMax, n)
}

// jitter shortens d by up to a tenth, so relays started together spread
// their queries.
func jitter(d time.Duration) time.Duration {
	if d < 10 {
		return d
	}
	return d - rand.N(d/10)
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
