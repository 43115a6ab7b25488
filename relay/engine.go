package relay

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	ibackoff "github.com/gorm-outbox/outbox/internal/backoff"
)

// engine is one run of the relay (Start) or one DrainOnce. It builds the
// three parts of the engine, the lease keeper (keeper.go), the scheduler
// (scheduler.go) and the drainers (drainer.go), which are tied one way:
// drainers read the keeper and hand buckets back to the scheduler; the
// keeper and the scheduler call nobody and report through channels. Its
// control loop (run) is the only place that joins them: it takes the
// keeper's lease events and applies them to the scheduler, acquires,
// announces lease changes to a LeaseAware publisher, and turns hints and
// discovery into ready buckets.
type engine struct {
	parts
	log   *slog.Logger
	k     *keeper
	sched *scheduler
	pool  *drainers

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

// newEngine returns the engine of one run under ctx, the parent of every
// lease's context.
func newEngine(ctx context.Context, p parts, oneShot bool) *engine {
	e := &engine{parts: p, log: p.cfg.Logger}
	e.k = newKeeper(ctx, p.cfg, p.store, p.leaseAware != nil)
	e.sched = newScheduler(p.cfg)
	e.sched.wakeOn[sinkOutage] = p.sinkProber != nil && !oneShot
	e.sched.wakeOn[storeOutage] = p.caps.prober != nil && !oneShot
	e.pool = newDrainers(p, e.k, e.sched, oneShot)
	return e
}

// applyLeaseEvents takes the keeper's lease events and applies them: the
// scheduler forgets a bucket whose lease ended (unless the relay holds it
// again) and starts a newly held one afresh; the loop notes an
// acquisition or discovery asked for. It returns a misconfiguration the
// renewal met.
func (e *engine) applyLeaseEvents(l *loop) error {
	ev := e.k.take()
	for _, b := range ev.ended {
		if !e.k.holds(b) {
			e.sched.forget(b)
		}
	}
	for _, b := range ev.gained {
		e.sched.reset(b)
	}
	l.acquireNow = l.acquireNow || ev.acquire
	l.discover = l.discover || ev.discover
	return ev.fatal
}

// startRenewal starts renewing the leases in the background when the
// store can (LeaseRenewer), and returns the function that stops it.
func (e *engine) startRenewal(ctx context.Context) (stop func()) {
	return e.caps.renewal.start(ctx, e.k)
}

// run is the control loop of a started relay. It returns nil when stopped
// and an error only for a misconfiguration. Before it returns, the
// drainers have finished their batches. Each turn maintains the leases,
// takes hints, starts a discovery when one is due, and sleeps until the
// next thing to do (see sleep).
func (e *engine) run(ctx context.Context, stopping <-chan struct{}) error {
	defer e.k.close()
	// Deferred in this order, the drainers finish their batches while the
	// leases are still being renewed.
	defer e.startRenewal(ctx)()
	waitPool := e.pool.start(ctx)
	defer func() {
		e.sched.close()
		waitPool()
	}()
	// Discovery and the probes of the store and the sink run beside the
	// loop, so that hints are taken while the store looks for pending
	// rows; deferred last, they end first (a probe is cancelled).
	l := &loop{discovered: make(chan error, 1), timer: time.NewTimer(time.Hour), hintsC: e.caps.hints.Ready()}
	e.watchOutages(l)
	defer l.timer.Stop()
	defer l.discovery.Wait()
	defer l.probes.Wait()
	probeCtx, cancelProbes := context.WithCancel(ctx)
	defer cancelProbes()
	for {
		if isStopping(ctx, stopping) {
			return nil
		}
		if err := e.pool.err(); err != nil {
			return err
		}
		if err := e.applyLeaseEvents(l); err != nil {
			return err
		}
		now := time.Now()
		worked, done, err := e.maintainLeases(ctx, l, now)
		if done {
			return err
		}
		if err := e.applyLeaseEvents(l); err != nil {
			return err
		}
		owned := e.k.ownedCount()
		e.takeHints(l, owned, now)
		e.startDiscovery(ctx, l, owned, now)
		e.probeOutages(probeCtx, l, time.Now())
		retry, retrying := e.sched.promote(time.Now())
		if worked {
			e.cfg.Observer.CycleFinished(time.Since(now))
		}
		if done, err := e.sleep(ctx, stopping, l, retry, retrying); done {
			return err
		}
	}
}

// loop is the control loop's state between its turns.
type loop struct {
	nextAcquire   time.Time // zero: acquire at once
	nextPoll      time.Time
	storeFailures int  // consecutive failed acquisitions
	acquireNow    bool // a lost lease asks for an acquisition
	discover      bool // a hint or a gained lease asks for a discovery
	discovering   bool // a discovery runs; its result comes on discovered
	discovered    chan error
	discovery     sync.WaitGroup
	timer         *time.Timer
	hintsC        <-chan struct{}

	discoverFailed bool   // the last discovery failed
	callsFailed    uint64 // failed acquisitions and discoveries so far

	// The outages of the store (Prober) and of the sink (SinkProber):
	// while a failed acquisition or discovery waits for its retry, or
	// buckets back off after a store call of their drainer failed, the
	// loop probes the store; while buckets back off after unavailable
	// publishes, it probes the publisher (watch.go).
	store, sink outageWatch
	probes      sync.WaitGroup
}

// backingOff reports whether a failed store call of the loop waits for
// its retry.
func (l *loop) backingOff() bool { return l.storeFailures > 0 || l.discoverFailed }

// maintainLeases acquires when acquisition is due or a lost lease asks
// for it, and announces lease changes to a LeaseAware publisher. worked
// says it acquired; done says the loop ends, with err.
func (e *engine) maintainLeases(ctx context.Context, l *loop, now time.Time) (worked, done bool, err error) {
	e.k.expireTrust()
	if err := e.applyLeaseEvents(l); err != nil {
		return false, true, err
	}
	if now.Before(l.nextAcquire) && !l.acquireNow {
		if e.deferred {
			// A change met during a bucket's batch, announced once that
			// batch ended (its drainer woke the loop).
			err = e.syncLeases(ctx)
		}
		return false, err != nil, err
	}
	// First announce the leases lost since the last acquisition, so a
	// bucket acquired again under its old term is announced anew.
	if err := e.syncLeases(ctx); err != nil {
		return true, true, err
	}
	// No new batch starts during the store call; the batches in flight go
	// on, and the store keeps their buckets (Busy), so a surplus lease is
	// released only between batches of its bucket.
	l.acquireNow = false
	err = e.k.acquire(ctx, e.sched.hold())
	if ferr := e.applyLeaseEvents(l); ferr != nil {
		e.sched.resume()
		return true, true, ferr
	}
	e.sched.resume()
	switch {
	case err == nil:
		l.storeFailures = 0
		l.nextAcquire = now.Add(jitter(e.cfg.LeaseRenewInterval))
	case IsMisconfiguration(err):
		return true, true, err
	case isStop(ctx, err):
		return true, true, nil
	default:
		l.storeFailures++
		d := backoff(e.cfg, l.storeFailures)
		e.log.Warn("relay: acquire leases failed", "err", err, "retry_in", d)
		l.nextAcquire = now.Add(d)
		l.callsFailed++
	}
	e.k.expireTrust()
	err = e.syncLeases(ctx)
	return true, err != nil, err
}

// takeHints marks the hinted buckets the relay holds ready. An
// unknown-bucket hint asks for a discovery. A relay owning nothing drops
// its hints.
func (e *engine) takeHints(l *loop, owned int, now time.Time) {
	var unknown bool
	e.hintBuf, unknown = e.caps.hints.Take(e.hintBuf[:0])
	if owned == 0 {
		return
	}
	for _, b := range e.hintBuf {
		if b < 0 || b >= e.cfg.BucketCount {
			continue
		}
		if _, ok := e.k.lease(b); ok {
			e.sched.mark(b, now)
		}
	}
	l.discover = l.discover || unknown
}

// startDiscovery starts a discovery beside the loop when one was asked
// for or the poll is due, unless one runs. A hint or a gained lease
// asking for discovery meanwhile asks for the next one: this one may
// have read before their rows.
func (e *engine) startDiscovery(ctx context.Context, l *loop, owned int, now time.Time) {
	if owned == 0 {
		l.discoverFailed = false // nothing to retry: the next lease gained asks for a discovery
		return
	}
	if l.discovering || (!l.discover && now.Before(l.nextPoll)) {
		return
	}
	l.discover, l.discovering = false, true
	l.discovery.Go(func() {
		start := time.Now()
		err := e.discover(ctx)
		e.cfg.Observer.CycleFinished(time.Since(start))
		l.discovered <- err
	})
}

// sleep waits until the next lease refresh, poll or backoff end, a hint,
// a discovery's end or a drainer's news. A relay owning nothing waits for
// its next lease refresh only. done says the loop ends, with err.
func (e *engine) sleep(ctx context.Context, stopping <-chan struct{}, l *loop, retry time.Time, retrying bool) (done bool, err error) {
	wake := l.nextAcquire
	if e.k.ownedCount() > 0 {
		if !l.discovering {
			wake = earliest(wake, l.nextPoll)
		}
		if retrying {
			wake = earliest(wake, retry)
		}
	}
	if l.store.due() {
		wake = earliest(wake, l.store.probeAt)
	}
	if l.sink.due() {
		wake = earliest(wake, l.sink.probeAt)
	}
	l.timer.Reset(time.Until(wake))
	select {
	case <-ctx.Done():
		return true, nil
	case <-stopping:
		return true, nil
	case <-l.timer.C:
	case <-l.hintsC:
	case <-e.k.changes():
	case <-e.sched.wakeups():
	case <-e.pool.failed():
	case err := <-l.discovered:
		return e.discovered(ctx, l, err)
	case err := <-l.store.probed:
		e.storeProbeAnswered(ctx, l, err)
	case err := <-l.sink.probed:
		e.sinkProbeAnswered(ctx, l, err)
	}
	return false, nil
}

// discovered takes a discovery's result and sets the next poll.
func (e *engine) discovered(ctx context.Context, l *loop, err error) (done bool, _ error) {
	l.discovering = false
	switch {
	case err == nil:
		l.nextPoll = time.Now().Add(jitter(e.cfg.PollInterval))
		l.discoverFailed = false
	case IsMisconfiguration(err):
		return true, err
	case isStop(ctx, err):
		return true, nil
	default:
		e.log.Warn("relay: find pending buckets failed", "err", err)
		now := time.Now()
		l.nextPoll = now.Add(backoff(e.cfg, 1))
		l.discoverFailed = true
		l.callsFailed++
	}
	return false, nil
}

// probeEvery is the interval of the probes during an outage.
func (e *engine) probeEvery() time.Duration { return max(e.cfg.BackoffMin, ProbeIntervalMin) }

// watchOutages readies the loop's watches of the store's and the sink's
// outages: a store or publisher that cannot be probed is not watched.
func (e *engine) watchOutages(l *loop) {
	var probeStore, probeSink func(context.Context) error
	if e.caps.prober != nil {
		probeStore = e.caps.prober.Probe
	}
	if e.sinkProber != nil {
		probeSink = e.sinkProber.ProbeSink
	}
	l.store = newOutageWatch(storeOutage, probeStore, e.probeEvery(), "relay: the store answers again; retrying now", &l.probes)
	l.sink = newOutageWatch(sinkOutage, probeSink, e.probeEvery(), "relay: the sink answers again; retrying now", &l.probes)
}

// probeOutages takes the failures since the last turn and starts the
// probes that are due. The store is down while a failed acquisition or
// discovery waits for its retry, or a bucket backs off after a store
// call of its drainer failed (a read, a delete); the sink while a bucket
// backs off after an unavailable publish.
func (e *engine) probeOutages(ctx context.Context, l *loop, now time.Time) {
	n, down := e.sched.outages(storeOutage)
	l.store.update(n+l.callsFailed, down || l.backingOff(), now)
	l.store.start(ctx, now)
	n, down = e.sched.outages(sinkOutage)
	l.sink.update(n, down, now)
	l.sink.start(ctx, now)
}

// storeProbeAnswered takes a probe of the store. A store that answers
// after it was seen down ends the backoffs of the loop's failed calls
// and of the buckets backing off after a store call failed: they are
// retried at once.
func (e *engine) storeProbeAnswered(ctx context.Context, l *loop, err error) {
	now := time.Now()
	if !l.store.answered(ctx, e.log, err, now) {
		return
	}
	if l.storeFailures > 0 {
		l.nextAcquire = now
	}
	if l.discoverFailed {
		l.nextPoll = now
	}
	e.sched.retryNow(storeOutage, now)
}

// sinkProbeAnswered takes a probe of the sink. A sink that answers after
// it was seen down ends the backoffs of the buckets backing off after an
// unavailable publish: they are retried at once.
func (e *engine) sinkProbeAnswered(ctx context.Context, l *loop, err error) {
	now := time.Now()
	if l.sink.answered(ctx, e.log, err, now) {
		e.sched.retryNow(sinkOutage, now)
	}
}

// drainRoundsMax bounds DrainOnce's rounds: a round acquires, drains
// every owned bucket, and looks for pending rows in buckets it did not
// own; a lease that lapsed mid-drain (a slow database) is acquired again
// in the next round.
const drainRoundsMax = 4

// drainAll is DrainOnce: acquire, drain every owned bucket until empty or
// failed, again while buckets with pending rows were lost and progress is
// made, and report the buckets with pending rows it could not own.
func (e *engine) drainAll(ctx context.Context) (int, error) {
	defer e.k.close()
	defer e.startRenewal(ctx)()
	all := make([]int, e.cfg.BucketCount)
	for b := range all {
		all[b] = b
	}
	l := &loop{}
	var notOwned error
	published := func() int { return int(e.pool.published.Load()) }
	joined := func(extra ...error) error {
		return errors.Join(append(append(e.pool.errs(), notOwned), extra...)...)
	}
	for round := 1; ; round++ {
		if err := e.k.acquire(ctx, nil); err != nil { // no batch in flight between rounds
			return published(), err
		}
		if err := e.syncLeases(ctx); err != nil {
			return published(), err
		}
		if err := e.applyLeaseEvents(l); err != nil {
			return published(), err
		}
		if err := e.discover(ctx); err != nil {
			return published(), err
		}
		before := published()
		if err := e.drainRound(ctx, l); err != nil {
			return published(), err
		}
		if err := ctx.Err(); err != nil {
			return published(), joined(err)
		}
		e.k.expireTrust()
		if err := e.syncLeases(ctx); err != nil {
			return published(), err
		}
		pending, err := e.store.PendingBuckets(ctx, all)
		if err != nil {
			return published(), joined(err)
		}
		var unowned []int
		for _, b := range pending {
			if e.sched.failedBucket(b) {
				continue // reported with its error
			}
			if _, ok := e.k.lease(b); !ok {
				unowned = append(unowned, b)
			}
		}
		if len(unowned) == 0 {
			break
		}
		// Stop after a round that acquired again and still made no
		// progress: peers hold those buckets.
		if round == drainRoundsMax || (round > 1 && published() == before) {
			notOwned = &NotOwnedError{Buckets: unowned}
			break
		}
	}
	return published(), joined()
}

// drainRound runs the drainers until every ready bucket is drained or
// failed, applying the keeper's lease events meanwhile, and returns a
// misconfiguration a batch or the renewal met, which closes the
// scheduler at once.
func (e *engine) drainRound(ctx context.Context, l *loop) error {
	wait := e.pool.start(ctx)
	finished := make(chan struct{})
	go func() {
		wait()
		close(finished)
	}()
	var fatal error
	for {
		select {
		case <-finished:
			if fatal != nil {
				return fatal
			}
			return e.pool.err()
		case <-e.k.changes():
			if err := e.applyLeaseEvents(l); err != nil && fatal == nil {
				fatal = err
				e.sched.close()
			}
		}
	}
}

// discover asks the store which owned buckets hold pending rows, of those
// neither ready nor in flight (see scheduler.toProbe).
func (e *engine) discover(ctx context.Context) error {
	owned := e.k.trustedLeases()
	if len(owned) == 0 {
		return nil
	}
	buckets := make([]int, len(owned))
	for i, l := range owned {
		buckets[i] = l.Bucket
	}
	// Called even when nothing is left to probe: the store checks for
	// rows beyond BucketCount at every discovery.
	buckets = e.sched.toProbe(buckets)
	pending, err := e.store.PendingBuckets(ctx, buckets)
	if err != nil {
		return err
	}
	now := time.Now()
	for _, b := range pending {
		if _, ok := e.k.lease(b); ok {
			e.sched.mark(b, now)
		}
	}
	return nil
}

// releaseAll gives up every lease; it runs when the loop ends, after the
// drainers finished, under context.WithoutCancel so a cancelled or
// expired stop context still lets peers take over at once.
func (e *engine) releaseAll(ctx context.Context) {
	held := e.k.releaseAll()
	e.cfg.Observer.OwnedBuckets(0)
	_ = e.syncLeases(context.WithoutCancel(ctx)) // tell the publisher first; never a misconfiguration here
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.ReleaseTimeout)
	defer cancel()
	if err := e.store.ReleaseLeases(rctx, e.cfg.RelayID, held); err != nil {
		e.log.Warn("relay: release leases failed; peers take the buckets over when the leases expire", "err", err)
		return
	}
	if len(held) > 0 {
		e.log.Info("relay: released leases", "buckets", len(held))
	}
}

// syncLeases tells a LeaseAware publisher how the held leases changed
// since it was last told: first the released ones (a bucket re-acquired
// under a new term counts as released, then acquired), then the acquired
// ones, which drainers take only once announced. It runs on the control
// loop, or after the drainers finished, and never announces a bucket
// whose batch is in flight: that bucket's change is announced once the
// batch ends (the scheduler wakes the loop). It returns an error only for
// a misconfiguration.
func (e *engine) syncLeases(ctx context.Context) error {
	la := e.leaseAware
	if la == nil {
		return nil
	}
	cur := e.k.trustedHeld()
	next := make(map[int]*heldLease, len(cur))
	var acquired, released []Lease
	var gained []*heldLease
	e.deferred = false
	for _, hl := range cur {
		prev, ok := e.announced[hl.Bucket]
		switch {
		case ok && prev == hl:
			next[hl.Bucket] = hl
		case e.sched.busyWake(hl.Bucket):
			e.deferred = true
			if ok {
				next[hl.Bucket] = prev // still announced as before
			}
		default:
			acquired = append(acquired, hl.Lease)
			gained = append(gained, hl)
			next[hl.Bucket] = hl
		}
	}
	for b, prev := range e.announced {
		if next[b] == prev {
			continue
		}
		if e.sched.busyWake(b) {
			e.deferred = true
			next[b] = prev
			continue
		}
		released = append(released, prev.Lease)
	}
	e.announced = next
	if len(released) > 0 {
		slices.SortFunc(released, func(a, b Lease) int { return a.Bucket - b.Bucket })
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.ReleaseTimeout)
		la.LeasesReleased(rctx, released)
		cancel()
	}
	if len(acquired) > 0 {
		actx, cancel := context.WithDeadline(ctx, e.k.trustDeadline())
		err := la.LeasesAcquired(actx, acquired)
		cancel()
		if IsMisconfiguration(err) {
			return err
		}
		if err != nil && !isStop(ctx, err) {
			e.log.Warn("relay: publisher could not prepare for acquired leases", "buckets", len(acquired), "err", err)
		}
		e.k.announced(gained)
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
