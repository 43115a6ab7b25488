package relay

import (
	"sync"
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

// bucketState is the scheduler's state of one bucket.
type bucketState struct {
	ready    bool      // may hold pending rows
	queued   bool      // in the ready FIFO
	busy     bool      // a drainer holds it: its batches in flight
	marks    uint64    // hints and discoveries so far, to notice one during a batch
	failures int       // consecutive failures
	retryAt  time.Time // backoff end
	// shrink caps the next batch at the messages before the one a
	// publisher named as the cause of the last failure.
	shrink int
	// next is a batch read ahead with the delete of the previous one
	// (BatchAdvancer), under term nextTerm: the next batch of the bucket,
	// read from its head.
	next     []Message
	nextTerm int64
	failed   bool // DrainOnce: its publish failed; not retried
	// settled: under term settledTerm the bucket was reconciled
	// (Reconciler) and no batch ended in doubt since.
	settled     bool
	settledTerm int64
	// wake asks done to wake the control loop: a lease announcement waits
	// for this bucket's batch to end.
	wake bool
	// down: the outage the bucket's last batch failed on (a store call
	// of its drainer, a publish that failed as unavailable); its backoff
	// may end early when a probe sees that outage end.
	down outage
}

// batchResult is what a drainer reports after one batch.
type batchResult struct {
	out    outcome
	err    error
	shrink int       // > 0: cap the bucket's next batch (FailedIndex, BatchRejected)
	next   []Message // read ahead under the same lease (BatchAdvancer)
	term   int64
	// settled: the bucket is reconciled under settledTerm and the batch
	// left no doubt (see bucketState.settled).
	settled     bool
	settledTerm int64
	marks       uint64 // the bucket's marks the batch's last read covered
	// store: the batch failed at a store call (a read or a delete), an
	// outage a probe of the store can see end (Prober).
	store bool
}

// drawn is a bucket a drainer took from the scheduler, with its state at
// the start of the batch.
type drawn struct {
	bucket int
	st     bucketState
}

// scheduler hands ready buckets to drainers in a fair FIFO: a bucket
// that had a full batch goes to the back of the queue, so a busy bucket
// cannot starve the others, and a bucket is never handed to two drainers
// at once. Hints and discovery mark buckets ready; a failed bucket waits
// out its own backoff outside the queue. While the keeper acquires (hold)
// no new batch starts; the batches in flight go on.
//
// The scheduler knows nothing of leases: the caller marks only buckets it
// holds, and a drainer hands back at once a bucket whose lease went away
// (done with outLost). It signals the control loop on a one-slot channel
// (wakeups) when no batch is left in flight, or when a batch ends that a
// lease announcement waited for.
type scheduler struct {
	backoffMin, backoffMax time.Duration

	wake chan struct{} // one slot

	mu       sync.Mutex
	cond     *sync.Cond
	buckets  []bucketState
	fifo     []int
	inFlight int
	// watchers signal (one slot) the drainer pipelining a bucket's
	// batches that the bucket was marked (watch); nil when none does.
	watchers []chan struct{}
	paused   bool // acquiring: hand out nothing
	closed   bool // stopping: hand out nothing, drainers exit
	oneShot  bool // DrainOnce: drainers exit when nothing is ready or in flight

	// failed counts, by outage, the batches that failed on it; down the
	// buckets whose last batch did. wakeOn: such a failure wakes the
	// control loop, which probes the store or the sink.
	failed [outageKinds]uint64
	down   [outageKinds]int
	wakeOn [outageKinds]bool
}

func newScheduler(cfg Config) *scheduler {
	s := &scheduler{buckets: make([]bucketState, cfg.BucketCount), watchers: make([]chan struct{}, cfg.BucketCount),
		backoffMin: cfg.BackoffMin, backoffMax: cfg.BackoffMax, wake: make(chan struct{}, 1)}
	s.cond = sync.NewCond(&s.mu)
	return s
}

// wakeups is signalled when the control loop has something to look at:
// no batch is in flight, or a batch ended that an announcement waited for.
func (s *scheduler) wakeups() <-chan struct{} { return s.wake }

// mark makes bucket b ready (a hint or a discovery found rows). The
// caller checked that the relay holds it.
func (s *scheduler) mark(b int, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.buckets[b]
	st.marks++
	s.signalLocked(b)
	if st.failed {
		return
	}
	st.ready = true
	s.enqueueLocked(b, now)
}

// toProbe returns, of buckets, the ones a discovery must ask the store
// about: those neither ready nor in flight. A ready bucket will be read
// anyway. A bucket in flight is marked instead of probed, so it is read
// again after its batch, as a probe's mark would have it: a probe would
// only find the batch's own rows, not deleted yet.
func (s *scheduler) toProbe(buckets []int) []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	probe := buckets[:0]
	for _, b := range buckets {
		st := &s.buckets[b]
		switch {
		case st.busy:
			st.marks++
			s.signalLocked(b)
		case st.ready || st.failed:
		default:
			probe = append(probe, b)
		}
	}
	return probe
}

// enqueueLocked puts a ready, idle bucket that is not backing off at the
// back of the FIFO.
func (s *scheduler) enqueueLocked(b int, now time.Time) {
	st := &s.buckets[b]
	if !st.ready || st.queued || st.busy || st.retryAt.After(now) {
		return
	}
	st.queued = true
	s.fifo = append(s.fifo, b)
	s.cond.Signal()
}

// promote queues the ready buckets whose backoff ended by now and returns
// the earliest backoff end still ahead.
func (s *scheduler) promote(now time.Time) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var next time.Time
	for b := range s.buckets {
		st := &s.buckets[b]
		if !st.ready || st.queued || st.busy {
			continue
		}
		if st.retryAt.After(now) {
			if next.IsZero() || st.retryAt.Before(next) {
				next = st.retryAt
			}
			continue
		}
		s.enqueueLocked(b, now)
	}
	return next, !next.IsZero()
}

// next blocks until a queued bucket can be drained and hands out the
// one at the head of the FIFO, with its state for the batch; it reports
// false when the scheduler is closed, or in one-shot mode when nothing is
// left to do. The bucket is busy until done takes it back, so it never
// has two batches in flight.
func (s *scheduler) next() (drawn, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.closed {
			return drawn{}, false
		}
		if !s.paused && len(s.fifo) > 0 {
			b := s.fifo[0]
			s.fifo = s.fifo[1:]
			return s.takeLocked(b), true
		}
		if s.oneShot && len(s.fifo) == 0 && s.inFlight == 0 {
			return drawn{}, false
		}
		s.cond.Wait()
	}
}

// takeLocked marks bucket b, just taken off the FIFO, busy, and returns
// it with its state for the batch.
func (s *scheduler) takeLocked(b int) drawn {
	cur := &s.buckets[b]
	cur.queued = false
	cur.busy = true
	s.inFlight++
	d := drawn{bucket: b, st: *cur}
	cur.shrink = 0
	cur.next = nil
	return d
}

// done takes back bucket b after a batch drawn with marks and applies its
// result.
func (s *scheduler) done(b int, marks uint64, r batchResult, now time.Time) {
	s.mu.Lock()
	st := &s.buckets[b]
	st.busy = false
	s.inFlight--
	hinted := st.marks != marks // a hint arrived during the batch
	st.settled, st.settledTerm = r.settled, r.settledTerm
	outageWake := s.noteOutageLocked(st, r)
	switch r.out {
	case outEmpty, outDrained:
		st.ready = hinted
		st.failures, st.retryAt = 0, time.Time{}
	case outFull, outRetry:
		st.ready = true
		st.failures, st.retryAt = 0, time.Time{}
		if r.shrink > 0 {
			st.shrink = r.shrink
		}
		if r.next != nil {
			st.next, st.nextTerm = r.next, r.term
		}
	case outFailed:
		if s.oneShot {
			st.ready, st.failed = false, true
			break
		}
		st.failures++
		st.retryAt = now.Add(ibackoff.Exponential(s.backoffMin, s.backoffMax, st.failures))
	case outLost:
		s.forgetLocked(b)
	case outStopped:
	}
	s.enqueueLocked(b, now)
	quiet := s.inFlight == 0
	if quiet && s.oneShot && len(s.fifo) == 0 {
		s.cond.Broadcast() // the other drainers exit
	}
	wake := st.wake || outageWake
	st.wake = false
	s.mu.Unlock()
	if quiet || wake {
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

// watch returns the channel that tells the drainer holding bucket b, one
// signal at a time, that the bucket was marked, until unwatch.
func (s *scheduler) watch(b int) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := make(chan struct{}, 1)
	s.watchers[b] = c
	return c
}

// unwatch ends watch.
func (s *scheduler) unwatch(b int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.watchers[b] = nil
}

// signalLocked tells the drainer watching bucket b, if any, that it was
// marked.
func (s *scheduler) signalLocked(b int) {
	if c := s.watchers[b]; c != nil {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// pipeline reports whether the drainer holding bucket b, with batches of
// it in flight (inFlight) or not, and past maxTurns batches in its turn
// (over) or not, may send the bucket's next batch: the scheduler is open,
// no acquisition holds it and no lease announcement waits for the
// bucket, as for keep; other buckets waiting in the FIFO stop the
// drainer once nothing is in flight or the turn is over. Unlike keep, a
// turn goes on past maxTurns while no other bucket waits: ending it
// would stall the bucket until its batches in flight are acknowledged.
// It returns the bucket's marks so far.
func (s *scheduler) pipeline(b int, inFlight, over bool) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.buckets[b]
	return st.marks, !s.closed && !s.paused && !st.wake && (len(s.fifo) == 0 || inFlight && !over)
}

// keep reports whether the drainer holding bucket b may go on with its
// next batch rather than hand it back: no other bucket waits in the FIFO,
// no acquisition holds the scheduler, no lease announcement waits for the
// bucket, and the scheduler is open. It returns the bucket's marks so
// far, which a read started after it covers.
func (s *scheduler) keep(b int) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.buckets[b]
	return st.marks, !s.closed && !s.paused && len(s.fifo) == 0 && !st.wake
}

// forget clears a bucket's state after its lease went away.
func (s *scheduler) forget(b int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forgetLocked(b)
}

func (s *scheduler) forgetLocked(b int) {
	st := &s.buckets[b]
	s.setDownLocked(st, noOutage)
	st.ready = false
	st.failures, st.retryAt = 0, time.Time{}
	st.shrink = 0
	st.next = nil
	st.settled = false
	// A queued entry stays in the FIFO; next skips it since the bucket is
	// no longer held, and a bucket marked again meanwhile is not queued
	// twice.
}

// reset clears the backoff of a bucket acquired anew.
func (s *scheduler) reset(b int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.buckets[b]
	st.failures, st.retryAt = 0, time.Time{}
	st.failed = false
	s.setDownLocked(st, noOutage)
}

// noteOutageLocked notes the outage batch r of bucket st failed on, if
// any, and reports whether that wakes the control loop.
func (s *scheduler) noteOutageLocked(st *bucketState, r batchResult) bool {
	o := noOutage
	switch {
	case r.out != outFailed || s.oneShot:
	case r.store:
		o = storeOutage
	case IsUnavailable(r.err):
		o = sinkOutage
	}
	s.setDownLocked(st, o)
	if o == noOutage {
		return false
	}
	s.failed[o]++
	return s.wakeOn[o]
}

func (s *scheduler) setDownLocked(st *bucketState, o outage) {
	if st.down != noOutage {
		s.down[st.down]--
	}
	if o != noOutage {
		s.down[o]++
	}
	st.down = o
}

// outages returns how many batches failed so far on outage o, and
// whether a bucket's last batch did.
func (s *scheduler) outages(o outage) (uint64, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed[o], s.down[o] > 0
}

// retryNow ends the backoff of every bucket backing off after its last
// batch failed on outage o, and queues the ready ones: the store or the
// sink answers again. Their failure counts stay, so a bucket that fails
// again backs off longer.
func (s *scheduler) retryNow(o outage, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for b := range s.buckets {
		st := &s.buckets[b]
		if st.down == o && st.retryAt.After(now) {
			st.retryAt = time.Time{}
			s.enqueueLocked(b, now)
		}
	}
}

// hold stops handing out batches while the keeper acquires, and returns
// the buckets whose batch is in flight, in ascending order: the store
// keeps those leases (AcquireRequest.Busy). It does not wait for them.
func (s *scheduler) hold() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = true
	var busy []int
	for b := range s.buckets {
		if s.buckets[b].busy {
			busy = append(busy, b)
		}
	}
	return busy
}

// busyWake reports whether bucket b has a batch in flight; if so, done wakes
// the control loop when it ends.
func (s *scheduler) busyWake(b int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.buckets[b]
	if st.busy {
		st.wake = true
	}
	return st.busy
}

// resume hands out batches again after hold.
func (s *scheduler) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = false
	s.cond.Broadcast()
}

// close makes the drainers exit once their batch is done.
func (s *scheduler) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.cond.Broadcast()
}

// start readies the scheduler for a pool of drainers.
func (s *scheduler) start(oneShot bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed, s.paused, s.oneShot = false, false, oneShot
}

// anyQueued reports whether a bucket waits in the FIFO or is in flight.
func (s *scheduler) anyQueued() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.fifo) > 0 || s.inFlight > 0
}

// runnable reports whether a bucket waits in the FIFO.
func (s *scheduler) runnable() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.fifo) > 0
}

// failedBucket reports whether DrainOnce saw bucket b fail.
func (s *scheduler) failedBucket(b int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buckets[b].failed
}
