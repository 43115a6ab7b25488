package relay

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"
)

// drainSet reads, publishes and deletes one batch spanning the buckets of
// set, with a SetBatcher store, and appends each bucket's result to dst in
// the order of set.
//
// The batch is the oldest rows of those buckets in id order, so each
// bucket's messages in it are that bucket's head, in order: the same rows,
// in the same order, that a batch of the bucket alone would start with.
// It is published bucket by bucket.
// Every bucket of the set stays busy until the batch ends, so a bucket
// still has at most one batch in flight. The publish runs under every
// lease of the set at once: it is cancelled when any of them ends, and the
// delete is guarded per bucket, so a bucket whose lease was lost deletes
// nothing while the others delete their acknowledged messages.
//
// This is the fast path of healthy batches. When a publish fails, the
// buckets wholly inside the acknowledged prefix are done; every other
// bucket is handed back solo: its next batch is its own, where the
// failure policy (FailedIndex, BatchRejected, FailureRecorder,
// FailureHandler) meets it as it meets any bucket. An outage
// (IsUnavailable) backs them off first, like a failed batch of each.
func (w *worker) drainSet(ctx context.Context, set []drawn, dst []batchResult) []batchResult {
	n := len(set)
	dst = slices.Grow(dst[:0], n)[:n]
	all := func(r batchResult) []batchResult {
		for i := range dst {
			dst[i] = r
		}
		return dst
	}
	buckets := make([]int, n)
	leases := make([]Lease, n)
	for i, d := range set {
		buckets[i] = d.bucket
		leases[i] = d.hl.Lease
	}
	slices.Sort(buckets)
	slots := make(map[int]int, n)
	for i, d := range set {
		slots[d.bucket] = i
	}
	slot := func(b int) int {
		if i, ok := slots[b]; ok {
			return i
		}
		return -1
	}

	limit := w.batchLimit()
	msgs, more, err := w.r.setter.NextSetBatch(ctx, buckets, limit)
	if err != nil {
		if isStop(ctx, err) {
			return all(batchResult{out: outStopped})
		}
		if !IsMisconfiguration(err) {
			w.log.Warn("relay: read batch failed", "buckets", buckets, "err", err)
		}
		return all(batchResult{out: outFailed, err: err})
	}
	if len(msgs) > limit {
		msgs = msgs[:limit]
	}
	full := more || len(msgs) == limit
	// A message of another bucket is a store fault that must not reach the
	// publisher under leases that do not cover it.
	for _, m := range msgs {
		if slot(m.Bucket) < 0 {
			err := fmt.Errorf("relay: store returned message %d of bucket %d for a batch of buckets %v", m.ID, m.Bucket, buckets)
			w.log.Error("relay: set batch read returned a message outside the set; publishing nothing", "err", err)
			return all(batchResult{out: outFailed, err: err})
		}
	}
	// perSlot counts messages by their bucket's place in set.
	perSlot := func(msgs []Message) []int {
		c := make([]int, n)
		for _, m := range msgs {
			c[slot(m.Bucket)]++
		}
		return c
	}
	if len(msgs) == 0 {
		return all(batchResult{out: outEmpty})
	}
	if w.r.filter != nil {
		var done bool
		if msgs, done = w.filterSet(ctx, set, msgs, dst); done {
			return dst
		}
	}
	count := perSlot(msgs)
	// Publish the batch bucket by bucket, each bucket's messages in id
	// order: the acknowledged prefix then covers whole buckets before the
	// first failure, which are done, instead of a part of each.
	slices.SortStableFunc(msgs, func(a, b Message) int { return cmp.Compare(slot(a.Bucket), slot(b.Bucket)) })

	// The publish ends when any lease of the set ends.
	pctx, cancel := context.WithCancelCause(set[0].hl.ctx)
	defer cancel(nil)
	for _, d := range set[1:] {
		stop := context.AfterFunc(d.hl.ctx, func() { cancel(context.Cause(d.hl.ctx)) })
		defer stop()
	}
	if w.r.limiter != nil {
		if err := w.r.limiter.WaitN(pctx, len(msgs)); err != nil {
			if ctx.Err() != nil {
				return all(batchResult{out: outStopped})
			}
			return w.lostOrRetry(set, dst, "while waiting for the rate limit")
		}
	}
	for _, d := range set {
		if !w.k.trusts(d.hl.Lease) {
			return w.lostOrRetry(set, dst, "before the publish: lease no longer trusted")
		}
	}

	publishStart := time.Now()
	acked, perr, lost := w.publishUnder(ctx, pctx, msgs, fmt.Sprintf("buckets %v", buckets))
	if acked < 0 || acked > len(msgs) {
		w.log.Error("relay: publisher reported an acknowledged count outside the batch; deleting nothing",
			"buckets", buckets, "acked", acked, "batch", len(msgs))
		perr = fmt.Errorf("relay: publisher acknowledged %d of a batch of %d", acked, len(msgs))
		acked = 0
	}
	took := time.Since(publishStart)
	ackedOf := perSlot(msgs[:acked])
	for i, d := range set {
		if count[i] > 0 {
			w.observePublish(ctx, d.bucket, count[i], ackedOf[i], perr, lost, took)
		}
	}
	if IsFenced(perr) {
		// Only a LeaseAware publisher fences, and set batches are not
		// used with one; should another, each bucket meets it on its own.
		w.log.Warn("relay: publisher fenced a set batch; deleting nothing, draining the buckets one by one", "buckets", buckets, "err", perr)
		return all(batchResult{out: outRetry, solo: true})
	}

	var lostBuckets []int
	if acked > 0 {
		// Acknowledged rows are deleted even when the relay is stopping,
		// as in a bucket's own batch.
		var err error
		lostBuckets, err = w.r.setter.MarkSetPublished(context.WithoutCancel(ctx), w.cfg.RelayID, leases, msgs[:acked])
		if err != nil {
			if !IsMisconfiguration(err) {
				w.log.Warn("relay: delete published messages failed; they will be published again", "buckets", buckets, "acked", acked, "err", err)
			}
			return all(batchResult{out: outFailed, err: err})
		}
		deleted := acked
		for _, b := range lostBuckets {
			if i := slot(b); i >= 0 {
				deleted -= ackedOf[i]
			}
		}
		w.published.Add(int64(deleted))
	}
	if perr == nil && acked < len(msgs) {
		perr = fmt.Errorf("relay: publisher acknowledged %d of %d messages without an error", acked, len(msgs))
	}
	for i, d := range set {
		whole := count[i] > 0 && ackedOf[i] == count[i] // every message of the bucket acknowledged
		switch {
		case slices.Contains(lostBuckets, d.bucket):
			w.log.Info("relay: lease lost before delete; the new owner publishes the rows again", "bucket", d.bucket, "term", d.hl.Term, "acked", ackedOf[i])
			dst[i] = batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d term %d refused the delete", ErrLeaseLost, d.bucket, d.hl.Term)}
		case lost && w.leaseEnded(d):
			// Its lease ended, or (without a LeaseRenewer) the relay's
			// trust in every lease did.
			w.log.Warn("relay: lease lost during publish; leaving the rest of the batch to the new owner", "bucket", d.bucket, "term", d.hl.Term, "acked", ackedOf[i])
			dst[i] = batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d during publish: %w", ErrLeaseLost, d.bucket, context.Cause(d.hl.ctx))}
		case whole && full:
			dst[i] = batchResult{out: outFull}
		case whole:
			dst[i] = batchResult{out: outDrained}
		case lost:
			// Another bucket's lease ended the publish: read this one again.
			dst[i] = batchResult{out: outRetry}
		case perr != nil && ctx.Err() != nil:
			dst[i] = batchResult{out: outStopped}
		case perr != nil && IsMisconfiguration(perr):
			dst[i] = batchResult{out: outFailed, err: perr}
		case perr != nil && IsUnavailable(perr):
			dst[i] = batchResult{out: outFailed, err: perr, solo: true}
		case perr != nil:
			dst[i] = batchResult{out: outRetry, solo: true}
		case full:
			dst[i] = batchResult{out: outFull}
		case count[i] == 0:
			dst[i] = batchResult{out: outEmpty}
		default:
			dst[i] = batchResult{out: outDrained}
		}
	}
	if perr != nil && !lost && ctx.Err() == nil && !IsMisconfiguration(perr) {
		if IsUnavailable(perr) {
			w.log.Warn("relay: publish failed: the sink is unavailable; retrying after backoff, not counted against the messages",
				"buckets", buckets, "acked", acked, "err", perr)
		} else {
			w.log.Info("relay: set batch publish failed; draining its buckets one by one",
				"buckets", buckets, "acked", acked, "failed_bucket", msgs[acked].Bucket, "err", perr)
		}
	}
	return dst
}

// leaseEnded reports whether the lease of a bucket drawn for a batch ended
// or is no longer trusted.
func (w *worker) leaseEnded(d drawn) bool {
	return d.hl.ctx.Err() != nil || !w.k.trusts(d.hl.Lease)
}

// lostOrRetry ends a set batch before its publish because a lease ended:
// the buckets whose lease ended are lost, the others are read again.
func (w *worker) lostOrRetry(set []drawn, dst []batchResult, when string) []batchResult {
	for i, d := range set {
		if w.leaseEnded(d) {
			dst[i] = batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease ended %s", ErrLeaseLost, d.bucket, when)}
		} else {
			dst[i] = batchResult{out: outRetry}
		}
	}
	return dst
}

// filterSet hands each bucket's part of a set batch to the BatchFilter
// under that bucket's lease, and returns the messages to publish in their
// order. done says the batch ends here, with the results in dst: a filter
// failed (its bucket fails or is lost, the others are read again), or it
// took every message out (every bucket is read again).
func (w *worker) filterSet(ctx context.Context, set []drawn, msgs []Message, dst []batchResult) ([]Message, bool) {
	parts := make(map[int][]Message, len(set))
	for _, m := range msgs {
		parts[m.Bucket] = append(parts[m.Bucket], m)
	}
	keep := make(map[int64]struct{}, len(msgs))
	var failed bool
	for i, d := range set {
		part := parts[d.bucket]
		dst[i] = batchResult{out: outRetry}
		if len(part) == 0 {
			continue
		}
		kept, out, err := w.filterBatch(ctx, d.hl.Lease, part)
		if kept == nil && out != outRetry {
			dst[i] = batchResult{out: out, err: err}
			failed = true
			continue
		}
		for _, m := range kept {
			keep[m.ID] = struct{}{}
		}
	}
	if failed {
		return nil, true
	}
	if len(keep) == len(msgs) {
		return msgs, false
	}
	msgs = slices.DeleteFunc(slices.Clone(msgs), func(m Message) bool {
		_, ok := keep[m.ID]
		return !ok
	})
	if len(msgs) == 0 {
		return nil, true
	}
	return msgs, false
}
