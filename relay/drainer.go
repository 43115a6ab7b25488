package relay

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// drain is one drainer of the pool: it takes ready buckets from the
// scheduler, drains one batch of them under their leases (one bucket's,
// or a set's: see drainSet), hands them back, and repeats until the
// scheduler closes. The scheduler never hands one bucket to two drainers,
// so at most one batch per bucket is in flight.
func (w *worker) drain(ctx context.Context) {
	maxSet := 1
	if w.r.setter != nil {
		maxSet = w.cfg.MaxBatchBuckets
	}
	var (
		set     []drawn
		results []batchResult
		ok      bool
	)
	for {
		if set, ok = w.sched.nextSet(w.k, maxSet, set[:0]); !ok {
			return
		}
		if len(set) == 1 {
			d := set[0]
			w.finish(d, w.drainBatch(ctx, d.hl, d.st))
		} else {
			results = w.drainSet(ctx, set, results[:0])
			for i, d := range set {
				w.finish(d, results[i])
			}
		}
		w.sched.finished()
	}
}

// finish applies the result of a bucket's batch and hands the bucket back
// to the scheduler.
func (w *worker) finish(d drawn, r batchResult) {
	b := d.bucket
	switch {
	case IsMisconfiguration(r.err):
		w.setFatal(r.err)
	case r.out == outLost:
		w.k.drop(d.hl.Lease, r.err)
		if w.oneShot {
			w.log.Info("relay: drain lost a bucket; acquiring again", "bucket", b, "err", r.err)
		}
	case r.out == outFailed && w.oneShot:
		w.mu.Lock()
		w.drainErrs = append(w.drainErrs, fmt.Errorf("bucket %d: %w", b, r.err))
		w.mu.Unlock()
	}
	w.sched.done(b, d.st.marks, r, w.cfg, time.Now())
}

// batchLimit is the largest batch the relay reads.
func (w *worker) batchLimit() int {
	limit := w.cfg.BatchSize
	if w.r.limiter != nil {
		limit = min(limit, w.r.limiter.Burst())
	}
	return limit
}

// drainBatch reads, publishes and deletes one batch of a bucket.
//
// st is the bucket's scheduler state: a shrink cap after a failure, or the
// batch read ahead with the previous delete (BatchAdvancer), which is the
// bucket's head under the same lease.
func (w *worker) drainBatch(ctx context.Context, hl *heldLease, st bucketState) batchResult {
	lease := hl.Lease
	b := lease.Bucket
	limit := w.batchLimit()
	if st.shrink > 0 {
		limit = min(limit, st.shrink) // see the failure path below
	}
	var msgs []Message
	if st.next != nil && st.nextTerm == lease.Term && st.shrink == 0 {
		msgs = st.next
	} else {
		var err error
		msgs, err = w.r.store.NextBatch(ctx, b, limit)
		if err != nil {
			if isStop(ctx, err) {
				return batchResult{out: outStopped}
			}
			if !IsMisconfiguration(err) {
				w.log.Warn("relay: read batch failed", "bucket", b, "err", err)
			}
			return batchResult{out: outFailed, err: err}
		}
	}
	if len(msgs) == 0 {
		return batchResult{out: outEmpty}
	}
	if len(msgs) > limit {
		msgs = msgs[:limit]
	}
	full := len(msgs) == limit
	if w.r.filter != nil {
		var (
			out outcome
			err error
		)
		if msgs, out, err = w.filterBatch(ctx, lease, msgs); msgs == nil {
			return batchResult{out: out, err: err}
		}
	}
	if w.r.limiter != nil {
		if err := w.r.limiter.WaitN(hl.ctx, len(msgs)); err != nil {
			if ctx.Err() != nil {
				return batchResult{out: outStopped}
			}
			return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease ended while waiting for the rate limit: %w", ErrLeaseLost, b, context.Cause(hl.ctx))}
		}
	}
	// The read may have been slow: check the lease is still trusted before
	// handing anything to the publisher.
	if !w.k.trusts(lease) {
		return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease no longer trusted", ErrLeaseLost, b)}
	}

	publishStart := time.Now()
	acked, perr, lost := w.publish(ctx, hl, msgs)
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
		return batchResult{out: outLost, err: perr}
	}
	var next []Message
	if acked > 0 {
		// Acknowledged rows are deleted even when the relay is stopping:
		// leaving them would only publish them again. After a complete
		// full batch the next one is read in the same round trip when the
		// store can (BatchAdvancer).
		var err error
		dctx := context.WithoutCancel(ctx)
		if adv := w.r.advancer; adv != nil && full && acked == len(msgs) && perr == nil && !lost && ctx.Err() == nil {
			next, err = adv.MarkPublishedNext(dctx, w.cfg.RelayID, lease, msgs, w.batchLimit())
		} else {
			err = w.r.store.MarkPublished(dctx, w.cfg.RelayID, lease, msgs[:acked])
		}
		if err != nil {
			if errors.Is(err, ErrLeaseLost) {
				w.log.Info("relay: lease lost before delete; the new owner publishes the rows again", "bucket", b, "term", lease.Term, "acked", acked)
				return batchResult{out: outLost, err: err}
			}
			if !IsMisconfiguration(err) {
				w.log.Warn("relay: delete published messages failed; they will be published again", "bucket", b, "acked", acked, "err", err)
			}
			return batchResult{out: outFailed, err: err}
		}
		w.published.Add(int64(acked))
	}
	if lost {
		w.log.Warn("relay: lease lost during publish; leaving the rest of the batch to the new owner", "bucket", b, "term", lease.Term, "acked", acked)
		return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d during publish: %w", ErrLeaseLost, b, context.Cause(hl.ctx))}
	}
	if perr == nil && acked < len(msgs) {
		perr = fmt.Errorf("relay: publisher acknowledged %d of %d messages without an error", acked, len(msgs))
	}
	if perr != nil {
		if ctx.Err() != nil {
			return batchResult{out: outStopped}
		}
		if IsMisconfiguration(perr) {
			// The publisher cannot work as configured (not started, not
			// authorized): no message is at fault, so nothing is recorded
			// against one, and the relay stops with the error.
			return batchResult{out: outFailed, err: perr}
		}
		if i, ok := FailedIndex(perr); ok && i > acked && i < len(msgs) {
			// The publisher names a later message as the cause (a
			// transactional one aborts the whole batch): publish the
			// messages before it on their own, at once, so that the failure
			// policy meets the culprit at the head of the bucket.
			w.log.Debug("relay: batch failed at a later message; publishing the messages before it first",
				"bucket", b, "acked", acked, "failed_index", i, "err", perr)
			return batchResult{out: outRetry, shrink: i - acked}
		}
		if rest := len(msgs) - acked; rest > 1 && IsBatchRejected(perr) {
			// The sink refused several messages at once for what one of
			// them may have caused: publish the first half on its own, at
			// once, until the refused batch is a single message. Only that
			// message meets the failure policy.
			w.log.Info("relay: the sink rejected the batch as a whole; splitting it to find the message that caused it",
				"bucket", b, "acked", acked, "rejected", rest, "next_batch", rest/2, "err", perr)
			return batchResult{out: outRetry, shrink: rest / 2}
		}
		out, err := w.fail(ctx, lease, msgs[acked], acked, perr)
		return batchResult{out: out, err: err}
	}
	switch {
	case next != nil && len(next) == 0:
		return batchResult{out: outDrained} // read ahead: the bucket is empty
	case next != nil:
		return batchResult{out: outFull, next: next, term: lease.Term}
	case full:
		return batchResult{out: outFull}
	}
	return batchResult{out: outDrained}
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

// publish runs the publisher under the bucket's lease context: the lease
// keeper ends it when the lease is lost (a renewal found it taken over)
// or can no longer be trusted (the trust window passed without a renewal;
// without a LeaseRenewer that bounds every publish). Renewal goes on
// meanwhile, on the keeper's own goroutine. No transaction or row lock is
// held.
func (w *worker) publish(ctx context.Context, hl *heldLease, msgs []Message) (acked int, err error, lost bool) {
	return w.publishUnder(ctx, hl.ctx, msgs, fmt.Sprintf("bucket %d", hl.Bucket))
}

// publishUnder runs the publisher under pctx, which ends with the lease
// (or, for a set batch, with any lease of the set); what names the
// bucket or buckets in errors and logs.
func (w *worker) publishUnder(ctx, pctx context.Context, msgs []Message, what string) (acked int, err error, lost bool) {
	if w.r.renewer == nil {
		// No renewal during the publish: it ends with the trust window,
		// and says so to a publisher that looks at its deadline.
		var cancel context.CancelFunc
		pctx, cancel = context.WithDeadlineCause(pctx, w.k.trustDeadline(),
			fmt.Errorf("%w: %s: local lease deadline passed during publish", ErrLeaseLost, what))
		defer cancel()
	}
	tctx, cancelTimeout := context.WithTimeoutCause(pctx, w.cfg.PublishTimeout, errPublishTimedOut)
	start := time.Now()
	acked, err = w.r.publisher.Publish(tctx, msgs)
	timedOut := errors.Is(context.Cause(tctx), errPublishTimedOut) && ctx.Err() == nil
	cancelTimeout()
	lost = pctx.Err() != nil && ctx.Err() == nil
	if lost {
		w.log.Warn("relay: lease ended during publish; cancelled the publish", "batch", what, "cause", context.Cause(pctx))
	}
	if timedOut && !lost && (err != nil || acked < len(msgs)) {
		// Not about the messages: the sink (or the publisher) stopped
		// answering. The bucket backs off like after any outage.
		err = Unavailable(fmt.Errorf("%w: %s: %s with %d of %d messages acknowledged",
			ErrPublishTimeout, what, time.Since(start).Round(time.Millisecond), acked, len(msgs)))
	}
	return acked, err, lost
}
