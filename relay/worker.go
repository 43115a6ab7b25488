package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
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

// worker is the state of one run of the relay loop (Start) or of one
// DrainOnce. The loop goroutine owns everything except the lease fields,
// which the renewal goroutine also writes while a publish is in flight.
type worker struct {
	r       *Relay
	cfg     Config
	log     *slog.Logger
	oneShot bool // DrainOnce: failures are reported, not retried

	mu           sync.Mutex
	leases       map[int]int64 // bucket -> term
	trustedUntil time.Time     // local monotonic deadline for trusting leases
	renewedAt    time.Time     // start of the last successful acquisition or renewal
	renewTriedAt time.Time     // start of the last attempt
	needAcquire  bool          // a lease was lost: run the full acquisition soon
	needDiscover bool          // leases were gained: look for their pending rows

	ready         []bool      // bucket may hold pending rows
	failures      []int       // consecutive failures per bucket
	retryAt       []time.Time // backoff end per bucket
	hintBuf       []int
	storeFailures int
	published     int
	drainErrs     []error
	waitingFor    string           // the Acquired.Waiting last logged, to log a change once
	failedOnce    map[int]struct{} // DrainOnce: buckets whose publish failed

	// announced is what a LeaseAware publisher was last told the relay
	// holds, bucket -> term (see syncLeases).
	announced map[int]int64
	// shrink caps a bucket's next batch at the messages before the one a
	// publisher named as the cause of the last failure.
	shrink map[int]int
}

func newWorker(r *Relay) *worker {
	n := r.cfg.BucketCount
	return &worker{
		r:        r,
		cfg:      r.cfg,
		log:      r.cfg.Logger,
		leases:   map[int]int64{},
		ready:    make([]bool, n),
		failures: make([]int, n),
		retryAt:  make([]time.Time, n),
	}
}

// run is the relay loop. It returns nil when stopped and an error only for
// a misconfiguration.
func (w *worker) run(ctx context.Context, stopping <-chan struct{}) error {
	var (
		nextAcquire time.Time // zero: acquire at once
		nextPoll    time.Time
		discover    bool
		hintsC      <-chan struct{}
	)
	if w.cfg.Hints != nil {
		hintsC = w.cfg.Hints.Ready()
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()

	for {
		if isStopping(ctx, stopping) {
			return nil
		}
		now := time.Now()
		if !now.Before(nextAcquire) || w.takeNeedAcquire() {
			err := w.acquire(ctx)
			switch {
			case err == nil:
				w.storeFailures = 0
				nextAcquire = now.Add(jitter(w.cfg.LeaseRenewInterval))
			case IsMisconfiguration(err):
				return err
			case isStop(ctx, err):
				return nil
			default:
				w.storeFailures++
				d := backoff(w.cfg, w.storeFailures)
				w.log.Warn("relay: acquire leases failed", "err", err, "retry_in", d)
				nextAcquire = now.Add(d)
			}
		}
		w.expireTrust()
		if err := w.syncLeases(ctx); err != nil {
			return err
		}
		owned := w.ownedCount()

		if w.cfg.Hints != nil {
			var unknown bool
			w.hintBuf, unknown = w.cfg.Hints.Take(w.hintBuf[:0])
			if owned > 0 {
				for _, b := range w.hintBuf {
					if _, ok := w.lease(b); ok {
						w.ready[b] = true
					}
				}
				discover = discover || unknown
			}
		}

		if w.needDiscover {
			w.needDiscover, discover = false, true
		}
		if owned > 0 && (discover || !now.Before(nextPoll)) {
			err := w.discover(ctx)
			switch {
			case err == nil:
				discover = false
				nextPoll = now.Add(jitter(w.cfg.PollInterval))
			case IsMisconfiguration(err):
				return err
			case isStop(ctx, err):
				return nil
			default:
				w.log.Warn("relay: find pending buckets failed", "err", err)
				discover = false
				nextPoll = now.Add(backoff(w.cfg, 1))
			}
		}

		if owned > 0 {
			if err := w.sweep(ctx, stopping); err != nil {
				return err
			}
			if w.runnable(time.Now()) {
				w.observeCycle(now)
				continue
			}
		}
		w.observeCycle(now)

		// Idle: sleep until the next lease refresh, poll or backoff end, or
		// a hint. A relay owning nothing waits for its next lease refresh
		// only.
		wake := nextAcquire
		if w.ownedCount() > 0 {
			wake = earliest(wake, nextPoll)
			if t, ok := w.nextRetry(); ok {
				wake = earliest(wake, t)
			}
		}
		timer.Reset(time.Until(wake))
		select {
		case <-ctx.Done():
			return nil
		case <-stopping:
			return nil
		case <-timer.C:
		case <-hintsC:
		}
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
func (w *worker) drainAll(ctx context.Context) (int, error) {
	all := make([]int, w.cfg.BucketCount)
	for b := range all {
		all[b] = b
	}
	for round := 1; ; round++ {
		if err := w.acquire(ctx); err != nil {
			return w.published, err
		}
		if err := w.syncLeases(ctx); err != nil {
			return w.published, err
		}
		if err := w.discover(ctx); err != nil {
			return w.published, err
		}
		before := w.published
		for w.anyReady() {
			if err := ctx.Err(); err != nil {
				return w.published, errors.Join(append(w.drainErrs, err)...)
			}
			if err := w.sweep(ctx, nil); err != nil {
				return w.published, err
			}
		}
		pending, err := w.r.store.PendingBuckets(ctx, all)
		if err != nil {
			return w.published, errors.Join(append(w.drainErrs, err)...)
		}
		var unowned []int
		for _, b := range pending {
			if _, failed := w.failedOnce[b]; failed {
				continue // reported with its error
			}
			if _, ok := w.lease(b); !ok {
				unowned = append(unowned, b)
			}
		}
		if len(unowned) == 0 {
			break
		}
		// Stop after a round that acquired again and still made no
		// progress: peers hold those buckets.
		if round == drainRoundsMax || (round > 1 && w.published == before) {
			w.drainErrs = append(w.drainErrs, &NotOwnedError{Buckets: unowned})
			break
		}
	}
	return w.published, errors.Join(w.drainErrs...)
}

// sweep publishes at most one batch of every ready bucket that is not
// backing off, so a hot bucket cannot starve the others. It returns an
// error only for a misconfiguration.
func (w *worker) sweep(ctx context.Context, stopping <-chan struct{}) error {
	for b := range w.ready {
		if !w.ready[b] || w.retryAt[b].After(time.Now()) {
			continue
		}
		if isStopping(ctx, stopping) {
			return nil
		}
		if err := w.maybeRenew(ctx); err != nil {
			return err
		}
		if err := w.syncLeases(ctx); err != nil {
			return err
		}
		lease, ok := w.lease(b)
		if !ok {
			w.forget(b)
			continue
		}
		out, err := w.drainBatch(ctx, lease)
		if IsMisconfiguration(err) {
			return err
		}
		w.apply(b, out, err)
		if err := w.syncLeases(ctx); err != nil {
			return err
		}
	}
	return nil
}

func (w *worker) apply(b int, out outcome, err error) {
	switch out {
	case outEmpty, outDrained:
		w.ready[b] = false
		w.failures[b] = 0
		w.retryAt[b] = time.Time{}
	case outFull, outRetry:
		w.ready[b] = true
		w.failures[b] = 0
		w.retryAt[b] = time.Time{}
	case outFailed:
		if w.oneShot {
			w.ready[b] = false
			if w.failedOnce == nil {
				w.failedOnce = map[int]struct{}{}
			}
			w.failedOnce[b] = struct{}{}
			w.drainErrs = append(w.drainErrs, fmt.Errorf("bucket %d: %w", b, err))
			return
		}
		w.failures[b]++
		w.retryAt[b] = time.Now().Add(backoff(w.cfg, w.failures[b]))
	case outLost:
		// DrainOnce acquires again in its next round and reports the
		// buckets it could not get back (NotOwnedError).
		w.dropLease(b)
		w.forget(b)
		if w.oneShot {
			w.log.Info("relay: drain lost a bucket; acquiring again", "bucket", b, "err", err)
		}
	case outStopped:
	}
}

// drainBatch reads, publishes and deletes one batch of a bucket.
func (w *worker) drainBatch(ctx context.Context, lease Lease) (outcome, error) {
	b := lease.Bucket
	limit := w.cfg.BatchSize
	if w.r.limiter != nil {
		limit = min(limit, w.r.limiter.Burst())
	}
	if n := w.shrink[b]; n > 0 {
		limit = min(limit, n) // see the failure path below
		delete(w.shrink, b)
	}
	msgs, err := w.r.store.NextBatch(ctx, b, limit)
	if err != nil {
		if isStop(ctx, err) {
			return outStopped, nil
		}
		if !IsMisconfiguration(err) {
			w.log.Warn("relay: read batch failed", "bucket", b, "err", err)
		}
		return outFailed, err
	}
	if len(msgs) == 0 {
		return outEmpty, nil
	}
	if len(msgs) > limit {
		msgs = msgs[:limit]
	}
	full := len(msgs) == limit
	if w.r.filter != nil {
		var out outcome
		if msgs, out, err = w.filterBatch(ctx, lease, msgs); msgs == nil {
			return out, err
		}
	}
	if w.r.limiter != nil && !w.waitTokens(ctx, len(msgs)) {
		return outStopped, nil
	}
	// The read may have been slow: check the lease is still trusted before
	// handing anything to the publisher.
	if _, ok := w.lease(b); !ok {
		return outLost, fmt.Errorf("%w: bucket %d: lease no longer trusted", ErrLeaseLost, b)
	}

	publishStart := time.Now()
	acked, perr, lost := w.publish(ctx, lease, msgs)
	if acked < 0 || acked > len(msgs) {
		w.log.Error("relay: publisher reported an acknowledged count outside the batch; deleting nothing",
			"bucket", b, "acked", acked, "batch", len(msgs))
		perr = fmt.Errorf("relay: publisher acknowledged %d of a batch of %d", acked, len(msgs))
		acked = 0
	}
	w.observePublish(ctx, b, len(msgs), acked, perr, lost, time.Since(publishStart))
	if IsFenced(perr) {
		// The sink refused the bucket's writes: another relay owns its
		// identity there now. The rows are the new owner's; delete none.
		w.log.Warn("relay: publisher fenced; leaving the bucket to its new owner without deleting anything",
			"bucket", b, "term", lease.Term, "err", perr)
		return outLost, perr
	}
	if acked > 0 {
		// Acknowledged rows are deleted even when the relay is stopping:
		// leaving them would only publish them again.
		if err := w.r.store.MarkPublished(context.WithoutCancel(ctx), w.cfg.RelayID, lease, msgs[:acked]); err != nil {
			if errors.Is(err, ErrLeaseLost) {
				w.log.Info("relay: lease lost before delete; the new owner publishes the rows again", "bucket", b, "term", lease.Term, "acked", acked)
				return outLost, err
			}
			if !IsMisconfiguration(err) {
				w.log.Warn("relay: delete published messages failed; they will be published again", "bucket", b, "acked", acked, "err", err)
			}
			return outFailed, err
		}
		w.published += acked
	}
	if lost {
		w.log.Warn("relay: lease lost during publish; leaving the rest of the batch to the new owner", "bucket", b, "term", lease.Term, "acked", acked)
		return outLost, fmt.Errorf("%w: bucket %d during publish", ErrLeaseLost, b)
	}
	if perr == nil && acked < len(msgs) {
		perr = fmt.Errorf("relay: publisher acknowledged %d of %d messages without an error", acked, len(msgs))
	}
	if perr != nil {
		if ctx.Err() != nil {
			return outStopped, nil
		}
		if i, ok := FailedIndex(perr); ok && i > acked && i < len(msgs) {
			// The publisher names a later message as the cause (a
			// transactional one aborts the whole batch): publish the
			// messages before it on their own, at once, so that the failure
			// policy meets the culprit at the head of the bucket.
			if w.shrink == nil {
				w.shrink = map[int]int{}
			}
			w.shrink[b] = i - acked
			w.log.Debug("relay: batch failed at a later message; publishing the messages before it first",
				"bucket", b, "acked", acked, "failed_index", i, "err", perr)
			return outRetry, nil
		}
		if rest := len(msgs) - acked; rest > 1 && IsBatchRejected(perr) {
			// The sink refused several messages at once for what one of
			// them may have caused: publish the first half on its own, at
			// once, until the refused batch is a single message. Only that
			// message meets the failure policy.
			if w.shrink == nil {
				w.shrink = map[int]int{}
			}
			w.shrink[b] = rest / 2
			w.log.Info("relay: the sink rejected the batch as a whole; splitting it to find the message that caused it",
				"bucket", b, "acked", acked, "rejected", rest, "next_batch", rest/2, "err", perr)
			return outRetry, nil
		}
		return w.fail(ctx, lease, msgs[acked], acked, perr)
	}
	if full {
		return outFull, nil
	}
	return outDrained, nil
}

// filterBatch hands a batch to the failure handler's BatchFilter and
// returns the messages to publish. A nil result means the batch ends with
// the returned outcome: the filter failed, or took every message out and
// the bucket is read again.
func (w *worker) filterBatch(ctx context.Context, lease Lease, msgs []Message) ([]Message, outcome, error) {
	kept, err := w.r.filter.FilterBatch(ctx, w.cfg.RelayID, lease, msgs)
	switch {
	case err == nil:
	case isStop(ctx, err):
		return nil, outStopped, nil
	case errors.Is(err, ErrLeaseLost):
		return nil, outLost, err
	case IsMisconfiguration(err):
		return nil, outFailed, err
	default:
		w.log.Warn("relay: batch filter failed", "bucket", lease.Bucket, "err", err)
		return nil, outFailed, err
	}
	if removed := len(msgs) - len(kept); removed > 0 {
		w.cfg.Observer.MessagesDeadLettered(removed, true)
	}
	if len(kept) == 0 {
		return nil, outRetry, nil
	}
	return kept, outFull, nil
}

// waitTokens waits until the rate limiter grants n messages, renewing the
// leases on schedule meanwhile so a long wait keeps them. It reports false,
// giving the tokens back, when ctx ends first or on a misconfiguration
// (which the loop meets again at its next acquisition).
func (w *worker) waitTokens(ctx context.Context, n int) bool {
	res := w.r.limiter.ReserveN(time.Now(), n)
	if !res.OK() {
		return true // n above the burst cannot happen: batches are capped by it
	}
	until := time.Now().Add(res.Delay())
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		d := time.Until(until)
		if d <= 0 {
			return true
		}
		t.Reset(min(d, w.cfg.LeaseRenewInterval/4))
		select {
		case <-t.C:
		case <-ctx.Done():
			res.Cancel()
			return false
		}
		if err := w.maybeRenew(ctx); err != nil {
			res.Cancel()
			return false
		}
	}
}

// fail runs the failure policy for the first unacknowledged message. A
// failure that is not about the message (IsUnavailable) only backs off: it
// is neither recorded against the message nor handed to the failure
// handler, so an outage of any length dead-letters nothing.
func (w *worker) fail(ctx context.Context, lease Lease, msg Message, acked int, perr error) (outcome, error) {
	if IsUnavailable(perr) {
		w.log.Warn("relay: publish failed: the sink is unavailable; retrying after backoff, not counted against the message",
			"bucket", lease.Bucket, "acked", acked, "message_id", msg.MessageID, "err", perr)
		return outFailed, perr
	}
	if w.r.recorder != nil {
		err := w.r.recorder.RecordFailure(ctx, w.cfg.RelayID, lease, msg, perr)
		switch {
		case err == nil:
			msg.Attempts++
		case errors.Is(err, ErrLeaseLost):
			return outLost, err
		case !isStop(ctx, err):
			w.log.Warn("relay: record publish failure failed", "bucket", lease.Bucket, "err", err)
		}
	}
	action := FailureBackoff
	if h := w.cfg.FailureHandler; h != nil {
		a, err := h.HandleFailure(ctx, Failure{RelayID: w.cfg.RelayID, Lease: lease, Message: msg, Acked: acked, Err: perr})
		switch {
		case IsMisconfiguration(err):
			return outFailed, err
		case errors.Is(err, ErrLeaseLost):
			return outLost, err
		case err != nil:
			if !isStop(ctx, err) { // a stop cancelling the handler is no failure
				w.log.Warn("relay: failure handler failed", "bucket", lease.Bucket, "message_id", msg.MessageID, "err", err)
			}
		default:
			action = a
		}
	}
	w.log.Warn("relay: publish failed", "bucket", lease.Bucket, "acked", acked,
		"message_id", msg.MessageID, "attempts", msg.Attempts, "permanent", IsPermanent(perr), "err", perr)
	if action == FailureRetry {
		// The handler took the message out of the bucket.
		w.cfg.Observer.MessagesDeadLettered(1, false)
		return outRetry, nil
	}
	return outFailed, perr
}

// publish runs the publisher with the lease kept alive: with a
// LeaseRenewer, a goroutine renews the leases while the publisher works and
// cancels it if the bucket's lease is lost or can no longer be trusted;
// without one, the publish is bounded by the local lease deadline. No
// transaction or row lock is held meanwhile.
func (w *worker) publish(ctx context.Context, lease Lease, msgs []Message) (acked int, err error, lost bool) {
	pctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var renewDone chan struct{}
	if w.r.renewer != nil {
		renewDone = make(chan struct{})
		go func() {
			defer close(renewDone)
			w.renewDuring(pctx, cancel, lease.Bucket)
		}()
	} else {
		var cancelDeadline context.CancelFunc
		pctx, cancelDeadline = context.WithDeadlineCause(pctx, w.trustDeadline(),
			fmt.Errorf("%w: bucket %d: local lease deadline passed during publish", ErrLeaseLost, lease.Bucket))
		defer cancelDeadline()
	}

	tctx, cancelTimeout := context.WithTimeoutCause(pctx, w.cfg.PublishTimeout, errPublishTimedOut)
	start := time.Now()
	acked, err = w.r.publisher.Publish(tctx, msgs)
	timedOut := errors.Is(context.Cause(tctx), errPublishTimedOut) && ctx.Err() == nil
	cancelTimeout()
	lost = errors.Is(context.Cause(pctx), ErrLeaseLost)
	if timedOut && !lost && (err != nil || acked < len(msgs)) {
		// Not about the messages: the sink (or the publisher) stopped
		// answering. The bucket backs off like after any outage.
		err = Unavailable(fmt.Errorf("%w: bucket %d: %s with %d of %d messages acknowledged",
			ErrPublishTimeout, lease.Bucket, time.Since(start).Round(time.Millisecond), acked, len(msgs)))
	}
	cancel(nil)
	if renewDone != nil {
		<-renewDone
	}
	return acked, err, lost
}

// renewDuring renews the leases on schedule while a publish is in flight.
func (w *worker) renewDuring(ctx context.Context, cancel context.CancelCauseFunc, bucket int) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var retryAt time.Time
	for {
		w.mu.Lock()
		due, until := w.renewedAt.Add(w.cfg.LeaseRenewInterval), w.trustedUntil
		w.mu.Unlock()
		due = later(due, retryAt)
		t.Reset(time.Until(earliest(due, until)))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		if !now.Before(until) {
			w.log.Warn("relay: lease deadline passed during publish; cancelling the publish", "bucket", bucket)
			cancel(fmt.Errorf("%w: bucket %d: local lease deadline passed during publish", ErrLeaseLost, bucket))
			return
		}
		if now.Before(due) {
			continue
		}
		err := w.renewLeases(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			w.log.Warn("relay: renew leases during publish failed", "err", err)
			retryAt = time.Now().Add(w.cfg.LeaseRenewInterval / 4)
			continue
		}
		retryAt = time.Time{}
		if _, ok := w.lease(bucket); !ok {
			cancel(fmt.Errorf("%w: bucket %d taken over during publish", ErrLeaseLost, bucket))
			return
		}
	}
}

// maybeRenew renews the leases between batches when the renewal is due,
// so a long sweep keeps them. It returns an error only for a
// misconfiguration.
func (w *worker) maybeRenew(ctx context.Context) error {
	now := time.Now()
	w.mu.Lock()
	due := !now.Before(w.renewedAt.Add(w.cfg.LeaseRenewInterval)) &&
		!now.Before(w.renewTriedAt.Add(w.cfg.LeaseRenewInterval/4)) &&
		len(w.leases) > 0
	w.mu.Unlock()
	if !due {
		return nil
	}
	var err error
	if w.r.renewer != nil {
		err = w.renewLeases(ctx)
	} else {
		err = w.acquire(ctx)
	}
	if IsMisconfiguration(err) {
		return err
	}
	if err != nil && !isStop(ctx, err) {
		w.log.Warn("relay: renew leases failed", "err", err)
	}
	return nil
}

// acquire runs the store's lease maintenance and adopts its result. When
// it gained buckets, the next loop iteration runs discovery: one query for
// their pending rows rather than a batch read per bucket.
func (w *worker) acquire(ctx context.Context) error {
	start := time.Now()
	w.mu.Lock()
	w.renewTriedAt = start
	w.mu.Unlock()
	res, err := w.r.store.AcquireLeases(ctx, AcquireRequest{
		RelayID:       w.cfg.RelayID,
		BucketCount:   w.cfg.BucketCount,
		LeaseDuration: w.cfg.LeaseDuration,
	})
	if err != nil {
		return err
	}
	next := make(map[int]int64, len(res.Leases))
	for _, l := range res.Leases {
		if l.Bucket < 0 || l.Bucket >= w.cfg.BucketCount {
			w.log.Error("relay: store returned a lease outside the bucket range; ignoring it", "bucket", l.Bucket)
			continue
		}
		next[l.Bucket] = l.Term
	}
	w.mu.Lock()
	prev := w.leases
	w.leases = next
	w.trustedUntil = start.Add(w.cfg.trustWindow())
	w.renewedAt = start
	w.mu.Unlock()

	var gained, released []int
	for b, t := range next {
		if pt, ok := prev[b]; !ok || pt != t {
			gained = append(gained, b)
			if !ok {
				w.failures[b], w.retryAt[b] = 0, time.Time{}
			}
			w.needDiscover = true
		}
	}
	for b := range prev {
		if _, ok := next[b]; !ok {
			released = append(released, b)
			w.forget(b)
		}
	}
	if len(gained) > 0 || len(released) > 0 {
		slices.Sort(gained)
		slices.Sort(released)
		w.log.Info("relay: leases changed", "owned", len(next), "acquired", gained, "released", released,
			"live_relays", res.LiveRelays, "fair_share", res.FairShare)
	}
	w.logWaiting(res.Waiting)
	w.observeAcquired(len(gained))
	return nil
}

// logWaiting says, once per change, which buckets the relay waits for and
// until when: after an unclean exit the restarted relay (a new relay id)
// cannot take its predecessor's buckets before their leases expire.
func (w *worker) logWaiting(waiting []HeldLease) {
	byOwner := map[string][]HeldLease{}
	var owners []string
	for _, h := range waiting {
		if byOwner[h.Owner] == nil {
			owners = append(owners, h.Owner)
		}
		byOwner[h.Owner] = append(byOwner[h.Owner], h)
	}
	slices.Sort(owners)
	key := ""
	for _, o := range owners {
		key += fmt.Sprint(o, bucketsOf(byOwner[o]), ";")
	}
	if key == w.waitingFor {
		return
	}
	w.waitingFor = key
	for _, o := range owners {
		until := byOwner[o][0].ExpiresAt
		for _, h := range byOwner[o][1:] {
			if h.ExpiresAt.After(until) {
				until = h.ExpiresAt
			}
		}
		w.log.Info("relay: waiting for buckets another relay holds beyond its fair share; "+
			"it releases them at its next renewal, or, if it exited without releasing them, they are taken over when its leases expire",
			"owner", o, "buckets", bucketsOf(byOwner[o]), "until", until)
	}
}

func bucketsOf(hs []HeldLease) []int {
	bs := make([]int, len(hs))
	for i, h := range hs {
		bs[i] = h.Bucket
	}
	slices.Sort(bs)
	return bs
}

// renewLeases extends the held leases through the LeaseRenewer.
func (w *worker) renewLeases(ctx context.Context) error {
	w.mu.Lock()
	held, until := sortedLeases(w.leases), w.trustedUntil
	start := time.Now()
	w.renewTriedAt = start
	w.mu.Unlock()
	if len(held) == 0 {
		return nil
	}
	// A renewal that completes after the trust window is of no use.
	rctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	still, err := w.r.renewer.RenewLeases(rctx, w.cfg.RelayID, held, w.cfg.LeaseDuration)
	if err != nil {
		return fmt.Errorf("relay: renew leases: %w", err)
	}
	kept := make(map[Lease]bool, len(still))
	for _, l := range still {
		kept[l] = true
	}
	var lost []int
	w.mu.Lock()
	for _, l := range held {
		if !kept[l] {
			if t, ok := w.leases[l.Bucket]; ok && t == l.Term {
				delete(w.leases, l.Bucket)
			}
			lost = append(lost, l.Bucket)
		}
	}
	w.trustedUntil = start.Add(w.cfg.trustWindow())
	w.renewedAt = start
	if len(lost) > 0 {
		w.needAcquire = true
	}
	w.mu.Unlock()
	if len(lost) > 0 {
		w.log.Warn("relay: leases lost at renewal", "buckets", lost)
	}
	w.observeLost(len(lost))
	return nil
}

// discover asks the store which owned buckets hold pending rows.
func (w *worker) discover(ctx context.Context) error {
	owned := w.trustedLeases()
	if len(owned) == 0 {
		return nil
	}
	buckets := make([]int, len(owned))
	for i, l := range owned {
		buckets[i] = l.Bucket
	}
	pending, err := w.r.store.PendingBuckets(ctx, buckets)
	if err != nil {
		return err
	}
	for _, b := range pending {
		if _, ok := w.lease(b); ok {
			w.ready[b] = true
		}
	}
	return nil
}

// releaseAll gives up every lease; it runs when the loop ends, under
// context.WithoutCancel so a cancelled or expired stop context still lets
// peers take over at once.
func (w *worker) releaseAll(ctx context.Context) {
	w.mu.Lock()
	held := sortedLeases(w.leases)
	w.leases = map[int]int64{}
	w.mu.Unlock()
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

// expireTrust drops the leases once the local trust window has ended
// without a successful renewal.
func (w *worker) expireTrust() {
	w.mu.Lock()
	expired := len(w.leases) > 0 && !time.Now().Before(w.trustedUntil)
	var dropped []int
	if expired {
		for b := range w.leases {
			dropped = append(dropped, b)
		}
		w.leases = map[int]int64{}
	}
	w.mu.Unlock()
	if !expired {
		return
	}
	for _, b := range dropped {
		w.forget(b)
	}
	w.log.Warn("relay: lease deadline passed without a successful renewal; stopped publishing until leases are acquired again", "buckets", len(dropped))
	w.observeLost(len(dropped))
}

// lease returns the lease of bucket b if the relay holds it and still
// trusts it.
func (w *worker) lease(b int) (Lease, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := w.leases[b]
	if !ok || !time.Now().Before(w.trustedUntil) {
		return Lease{}, false
	}
	return Lease{Bucket: b, Term: t}, true
}

func (w *worker) trustedLeases() []Lease {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !time.Now().Before(w.trustedUntil) {
		return nil
	}
	return sortedLeases(w.leases)
}

func (w *worker) ownedCount() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !time.Now().Before(w.trustedUntil) {
		return 0
	}
	return len(w.leases)
}

func (w *worker) trustDeadline() time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.trustedUntil
}

// syncLeases tells a LeaseAware publisher how the held leases changed
// since it was last told: first the released ones (a bucket re-acquired
// under a new term counts as released, then acquired), then the acquired
// ones. It runs on the loop goroutine only, so never while a publish is in
// flight, and returns an error only for a misconfiguration.
func (w *worker) syncLeases(ctx context.Context) error {
	la := w.r.leaseAware
	if la == nil {
		return nil
	}
	w.mu.Lock()
	cur := sortedLeases(w.leases)
	w.mu.Unlock()
	var acquired, released []Lease
	for _, l := range cur {
		if t, ok := w.announced[l.Bucket]; !ok || t != l.Term {
			acquired = append(acquired, l)
		}
	}
	if len(acquired) == 0 && len(cur) == len(w.announced) {
		return nil
	}
	next := make(map[int]int64, len(cur))
	for _, l := range cur {
		next[l.Bucket] = l.Term
	}
	for b, t := range w.announced {
		if nt, ok := next[b]; !ok || nt != t {
			released = append(released, Lease{Bucket: b, Term: t})
		}
	}
	w.announced = next
	if len(released) > 0 {
		slices.SortFunc(released, func(a, b Lease) int { return a.Bucket - b.Bucket })
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		la.LeasesReleased(rctx, released)
		cancel()
	}
	if len(acquired) > 0 {
		actx, cancel := context.WithDeadline(ctx, w.trustDeadline())
		err := la.LeasesAcquired(actx, acquired)
		cancel()
		if IsMisconfiguration(err) {
			return err
		}
		if err != nil && !isStop(ctx, err) {
			w.log.Warn("relay: publisher could not prepare for acquired leases", "buckets", len(acquired), "err", err)
		}
	}
	return nil
}

func (w *worker) dropLease(b int) {
	w.mu.Lock()
	_, held := w.leases[b]
	delete(w.leases, b)
	w.needAcquire = true
	w.mu.Unlock()
	if held {
		w.observeLost(1)
	}
}

func (w *worker) takeNeedAcquire() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	v := w.needAcquire
	w.needAcquire = false
	return v
}

// forget clears a bucket's loop state after its lease went away.
func (w *worker) forget(b int) {
	w.ready[b] = false
	w.failures[b] = 0
	w.retryAt[b] = time.Time{}
	delete(w.shrink, b)
}

// runnable reports whether a ready bucket can be drained now.
func (w *worker) runnable(now time.Time) bool {
	for b, r := range w.ready {
		if r && !w.retryAt[b].After(now) {
			return true
		}
	}
	return false
}

func (w *worker) anyReady() bool { return slices.Contains(w.ready, true) }

// nextRetry returns the earliest backoff end among ready buckets.
func (w *worker) nextRetry() (time.Time, bool) {
	var t time.Time
	for b, r := range w.ready {
		if r && !w.retryAt[b].IsZero() && (t.IsZero() || w.retryAt[b].Before(t)) {
			t = w.retryAt[b]
		}
	}
	return t, !t.IsZero()
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
