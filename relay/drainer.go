package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// drainers is the relay's pool of Config.Parallelism drainers. Each takes
// a ready bucket from the scheduler, drains one batch of it under its
// lease (drainBatch), hands it back, and repeats until the scheduler
// closes. The scheduler never hands one bucket to two drainers, so one
// drainer at a time has batches of a bucket in flight: one, or up to
// Config.PipelineDepth with a Pipeliner (pipelined).
//
// Drainers read the lease keeper (is this lease still trusted?) and tell
// it of a lease they found lost (drop); they report the end of each batch
// to the scheduler (done). What the engine needs of them it reads here:
// the count published, the failures of a DrainOnce, and a
// misconfiguration that stops the relay (failed).
type drainers struct {
	parts
	log     *slog.Logger
	k       *keeper
	sched   *scheduler
	oneShot bool // DrainOnce: failures are reported, not retried

	published atomic.Int64

	mu       sync.Mutex
	fatal    error         // the first misconfiguration a batch met
	fatalC   chan struct{} // closed with fatal
	failures []error       // DrainOnce: the buckets whose publish failed
}

func newDrainers(p parts, k *keeper, sched *scheduler, oneShot bool) *drainers {
	return &drainers{parts: p, log: p.cfg.Logger, k: k, sched: sched, oneShot: oneShot, fatalC: make(chan struct{})}
}

// start starts the drainers and returns the function that waits for them
// to finish their batches once the scheduler closes (or, in one-shot
// mode, runs out of work). A cancelled ctx closes the scheduler; the
// batches in flight see the cancellation themselves.
func (p *drainers) start(ctx context.Context) (wait func()) {
	n := min(p.cfg.Parallelism, p.cfg.BucketCount)
	p.sched.start(p.oneShot)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { p.drain(ctx) })
	}
	unwatch := context.AfterFunc(ctx, p.sched.close)
	return func() {
		wg.Wait()
		unwatch()
	}
}

// failed is closed when a batch met a misconfiguration (err).
func (p *drainers) failed() <-chan struct{} { return p.fatalC }

// err returns the misconfiguration a batch met, if any.
func (p *drainers) err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fatal
}

// errs returns DrainOnce's failures so far.
func (p *drainers) errs() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.failures)
}

// drain is one drainer: it takes a ready bucket from the scheduler,
// drains one batch of it under its lease, and hands it back, until the
// scheduler closes. A bucket whose lease went away since it was marked
// is handed back at once, as lost.
func (p *drainers) drain(ctx context.Context) {
	for {
		d, ok := p.sched.next()
		if !ok {
			return
		}
		hl, held := p.k.lease(d.bucket)
		if !held {
			p.sched.done(d.bucket, d.st.marks, batchResult{out: outLost}, time.Now())
			continue
		}
		p.finish(d, hl, p.drainBatch(ctx, d, hl))
	}
}

// finish applies the result of a bucket's batch and hands the bucket back
// to the scheduler, which backs a failed bucket off and wakes the control
// loop for a lease announcement that waited for the batch.
func (p *drainers) finish(d drawn, hl *heldLease, r batchResult) {
	b := d.bucket
	switch {
	case IsMisconfiguration(r.err):
		p.mu.Lock()
		if p.fatal == nil {
			p.fatal = r.err
			close(p.fatalC)
		}
		p.mu.Unlock()
		p.sched.close()
	case r.out == outLost:
		p.k.drop(hl.Lease, r.err)
		if p.oneShot {
			p.log.Info("relay: drain lost a bucket; acquiring again", "bucket", b, "err", r.err)
		}
	case r.out == outFailed && p.oneShot:
		p.mu.Lock()
		p.failures = append(p.failures, fmt.Errorf("bucket %d: %w", b, r.err))
		p.mu.Unlock()
	}
	p.sched.done(b, r.marks, r, time.Now())
}

// batchLimit is the largest batch the relay reads.
func (p *drainers) batchLimit() int {
	return min(p.cfg.BatchSize, p.caps.pacer.Burst())
}

// batch is one bucket's batch on its way through drainBatch's steps.
type batch struct {
	hl   *heldLease
	msgs []Message
	full bool // the read filled the batch: more rows probably wait
	// acked is the acknowledged prefix of msgs, perr the publish's error
	// (set too when the publisher acknowledged less than the batch without
	// one), lost that the lease ended during the publish.
	acked int
	perr  error
	lost  bool
	// next is the bucket's next batch, read ahead with the delete
	// (BatchAdvancer): empty, not nil, when the bucket is empty.
	next []Message
	// settled: the bucket is reconciled under the lease (Reconciler);
	// doubt: the batch may have left rows in the store that the sink
	// holds (a publish that failed or was cancelled, a failed delete).
	settled, doubt bool
	// marks are the bucket's hints and discoveries the batch's read
	// covered (scheduler marks).
	marks uint64
}

// drainBatch reads, publishes and deletes one batch of bucket d, and
// goes on with the bucket's next batches while the scheduler has nothing
// else for a drainer (alongside). Each of its steps states one invariant
// of the relay:
//
//   - reconcile: before the first batch under a lease, and after a batch
//     that ended in doubt, the rows the sink already holds (Reconciler)
//     are deleted first;
//   - read: the batch is the bucket's oldest rows, read afresh or read
//     ahead with the previous delete under the same term;
//   - pipelined: with a Pipeliner the batches after the read take
//     the variant that keeps up to PipelineDepth of them in flight, each
//     through filter, admit and a send, ending in order (pipelined);
//   - filter: the failure handler may take messages out before the publish;
//   - admit: the pace is kept, and the lease is still trusted before
//     anything reaches the publisher;
//   - publish: under the lease's context, which ends with the lease; only
//     an acknowledged prefix counts;
//   - awaitDelete: the previous batch's delete, run alongside this
//     batch's publish, ended; one that failed ends the bucket's turn, and
//     this batch is published again later, after the previous one;
//   - fenced: a sink that fenced the bucket makes the rows the new
//     owner's, and nothing is deleted;
//   - alongside: after a batch published completely, not full, of a
//     bucket that was hinted during it, the next batch is
//     read without its rows (BatchSkipper) and published while its delete
//     runs; the next batch is handed to the publisher only after this
//     one's Publish returned, and its own delete waits for this one's;
//   - deleteAcked: the acknowledged prefix is deleted by id, guarded by
//     the lease in the same statement, even when the relay is stopping;
//   - leaseEnded: after a lease lost during the publish, the rest of the
//     batch is the new owner's;
//   - failurePolicy: a failed publish is narrowed to its culprit, or
//     recorded and handed to the failure handler.
//
// Every delete has ended, and every send's wait returned, when drainBatch
// returns. The backoff of a failed bucket and the announcement of lease
// changes that waited for the batch follow in finish.
func (p *drainers) drainBatch(ctx context.Context, d drawn, hl *heldLease) (r batchResult) {
	b := &batch{hl: hl, marks: d.st.marks, settled: p.reconciler == nil || d.st.settled && d.st.settledTerm == hl.Term}
	// The result reports whether the bucket stays reconciled, and the
	// marks the last read covered, so that only a hint after it readies
	// the bucket again.
	defer func() { r.settled, r.settledTerm, r.marks = b.settled && !b.doubt, hl.Term, b.marks }()
	// Each step says whether the batch ends there, and with what.
	if !b.settled {
		if r, done := p.reconcile(ctx, b); done {
			return r
		}
		d.st.next = nil // read afresh what the delete left
	}
	if r, done := p.read(ctx, b, d.st); done {
		return r
	}
	if p.pipeliner != nil {
		return p.pipelined(ctx, b)
	}
	var prev *batch // published, its delete to run alongside b's publish
	for turn := 1; ; turn++ {
		if r, done := p.filter(ctx, b); done {
			return p.settle(p.startDelete(ctx, prev), r)
		}
		if r, done := p.admit(ctx, b); done {
			return p.settle(p.startDelete(ctx, prev), r)
		}
		pending := p.startDelete(ctx, prev)
		p.publish(ctx, b)
		if r, done := p.awaitDelete(pending); done {
			return r
		}
		if r, done := p.fenced(b); done {
			return r
		}
		next, r, done := p.alongside(ctx, b, turn)
		if done {
			return r
		}
		if next == nil {
			break
		}
		b, prev = next, b
	}
	return p.conclude(ctx, b)
}

// conclude ends the bucket's turn with its last batch b, published and
// not fenced: deleteAcked, leaseEnded, failurePolicy.
func (p *drainers) conclude(ctx context.Context, b *batch) batchResult {
	if r, done := p.deleteAcked(ctx, b); done {
		return r
	}
	if r, done := p.leaseEnded(b); done {
		return r
	}
	if b.perr != nil {
		return p.failurePolicy(ctx, b)
	}
	switch {
	case b.next != nil && len(b.next) == 0:
		return batchResult{out: outDrained} // read ahead: the bucket is empty
	case b.next != nil:
		return batchResult{out: outFull, next: b.next, term: b.hl.Term}
	case b.full:
		return batchResult{out: outFull}
	}
	return batchResult{out: outDrained}
}

// maxTurns bounds the batches one drainer publishes of a bucket before
// handing it back to the scheduler.
const maxTurns = 64

// pendingDelete is a batch's delete running alongside the next batch's
// publish.
type pendingDelete struct {
	lease Lease
	acked int
	err   chan error
}

// startDelete starts the delete of batch b (nil: none), published
// completely, guarded by its lease, even when the relay is stopping.
func (p *drainers) startDelete(ctx context.Context, b *batch) *pendingDelete {
	if b == nil {
		return nil
	}
	pd := &pendingDelete{lease: b.hl.Lease, acked: b.acked, err: make(chan error, 1)}
	dctx := context.WithoutCancel(ctx)
	go func() { pd.err <- p.store.MarkPublished(dctx, p.cfg.RelayID, pd.lease, b.msgs) }()
	return pd
}

// alongside takes the delete of batch b, just published completely, off
// the path to the bucket's next publish: it reads the next batch without
// b's rows (BatchSkipper), and b is deleted while that batch is published
// (drainBatch). It does so only for a batch that was not full, of a
// bucket hinted since b was read, and while the scheduler lets the
// drainer keep the bucket; else it returns nothing and b is deleted in
// turn (deleteAcked): a full batch with the next read (BatchAdvancer),
// which drains a backlog faster than the delete alongside did
// (BENCHMARKS.md, "The delete off the critical path"). When the read finds nothing or fails, b is
// deleted at once and the batch ends (done). A drainer thus holds one
// database connection at a time.
func (p *drainers) alongside(ctx context.Context, b *batch, turn int) (next *batch, r batchResult, done bool) {
	if p.caps.skipper == nil || turn >= maxTurns || b.perr != nil || b.lost || b.acked != len(b.msgs) || ctx.Err() != nil {
		return nil, batchResult{}, false
	}
	bucket := b.hl.Bucket
	marks, keep := p.sched.keep(bucket)
	if !keep || b.full || marks == b.marks {
		return nil, batchResult{}, false
	}
	msgs, err := p.caps.skipper.NextBatchExcept(ctx, bucket, p.batchLimit(), b.msgs)
	switch {
	case err != nil && !isStop(ctx, err) && !IsMisconfiguration(err):
		p.log.Warn("relay: read batch failed", "bucket", bucket, "err", err)
		fallthrough
	case err != nil:
		r = batchResult{out: outFailed, err: err, store: true}
		if isStop(ctx, err) {
			r = batchResult{out: outStopped}
		}
		return nil, p.settle(p.startDelete(ctx, b), r), true
	case msgs == nil: // nothing read: read afresh after the delete
		return nil, p.settle(p.startDelete(ctx, b), batchResult{out: outRetry}), true
	case len(msgs) == 0:
		b.marks = marks
		return nil, p.settle(p.startDelete(ctx, b), batchResult{out: outDrained}), true
	}
	limit := p.batchLimit()
	if len(msgs) > limit {
		msgs = msgs[:limit]
	}
	b.marks = marks
	return &batch{hl: b.hl, msgs: msgs, full: len(msgs) == limit, marks: marks, settled: b.settled}, batchResult{}, false
}

// awaitDelete waits for the previous batch's delete (nil: none) and
// reports its failure as the end of the bucket's turn.
func (p *drainers) awaitDelete(pd *pendingDelete) (batchResult, bool) {
	if pd == nil {
		return batchResult{}, false
	}
	return p.deleted(pd.lease, pd.acked, <-pd.err)
}

// settle ends a turn with r once the pending delete ended: a delete that
// failed decides the outcome, unless r is a misconfiguration.
func (p *drainers) settle(pd *pendingDelete, r batchResult) batchResult {
	if dr, failed := p.awaitDelete(pd); failed && !IsMisconfiguration(r.err) {
		return dr
	}
	return r
}

// reconcile deletes the rows of the bucket that the sink already holds,
// as the publisher's Reconciler records them, guarded by the lease: a
// previous owner, or this relay, published them and did not delete them.
// The rows are deleted only when they are all there and hold the
// messages the record's digest names.
func (p *drainers) reconcile(ctx context.Context, b *batch) (batchResult, bool) {
	lease := b.hl.Lease
	c, err := p.reconciler.Reconcile(b.hl.ctx, lease)
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return batchResult{out: outStopped}, true
	case b.hl.ctx.Err() != nil || IsFenced(err) || errors.Is(err, ErrLeaseLost):
		return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease ended while reconciling with the sink: %w", ErrLeaseLost, lease.Bucket, err)}, true
	case IsMisconfiguration(err):
		return batchResult{out: outFailed, err: err}, true
	default:
		p.log.Warn("relay: reconcile with the sink failed; not publishing the bucket until it succeeds", "bucket", lease.Bucket, "err", err)
		return batchResult{out: outFailed, err: err}, true
	}
	if !c.IsZero() {
		held, err := p.committedRows(ctx, lease, c)
		if err == nil && len(held) > 0 {
			err = p.store.MarkPublished(context.WithoutCancel(ctx), p.cfg.RelayID, lease, held)
		}
		switch {
		case err == nil:
		case isStop(ctx, err):
			return batchResult{out: outStopped}, true
		case errors.Is(err, ErrLeaseLost):
			return batchResult{out: outLost, err: err}, true
		case IsMisconfiguration(err):
			return batchResult{out: outFailed, err: err}, true
		default:
			p.log.Warn("relay: delete of rows the sink already holds failed; not publishing the bucket until it succeeds",
				"bucket", lease.Bucket, "ids", len(held), "err", err)
			return batchResult{out: outFailed, err: err, store: true}, true
		}
		if len(held) > 0 {
			p.log.Info("relay: deleted rows the sink already held (a batch committed but not deleted)",
				"bucket", lease.Bucket, "term", lease.Term, "deleted", len(held))
		}
	}
	b.settled = true
	return batchResult{}, false
}

// committedRows returns the rows of the bucket that c records, read from
// the bucket's oldest rows (a batch committed but not deleted is at the
// head, behind at most a batch of rows committed late with smaller ids),
// if every one is there and their digest is c's; otherwise none. Some
// rows missing, or other messages under those ids, is a record that is
// not this store's: it is logged, and nothing is deleted. For a span
// (see Committed), the rows are those with ids from c.First to c.Last,
// which must be exactly c.Count rows from c.First to c.Last with c's
// digest.
func (p *drainers) committedRows(ctx context.Context, lease Lease, c Committed) ([]Message, error) {
	recorded := len(c.IDs)
	if recorded == 0 {
		recorded = c.Count
	}
	rows, err := p.store.NextBatch(ctx, lease.Bucket, min(recorded, BatchSizeMax)+p.batchLimit())
	if err != nil {
		return nil, err
	}
	held := make([]Message, 0, min(recorded, len(rows))) // a Count from the sink bounds nothing
	if len(c.IDs) > 0 {
		byID := make(map[int64]Message, len(rows))
		for _, m := range rows {
			byID[m.ID] = m
		}
		for _, id := range c.IDs {
			if m, ok := byID[id]; ok {
				held = append(held, m)
			}
		}
	} else {
		for _, m := range rows {
			if m.ID >= c.First && m.ID <= c.Last {
				held = append(held, m)
			}
		}
	}
	switch {
	case len(held) == 0:
		return nil, nil // the usual case: the batch was deleted
	case len(held) == recorded && MessagesDigest(held) == c.Digest &&
		(len(c.IDs) > 0 || held[0].ID == c.First && held[len(held)-1].ID == c.Last):
		return held, nil
	case len(c.IDs) == 0 && held[len(held)-1].ID != c.Last:
		// The span's last row, the batch's, is gone: the batch was
		// deleted (the GORM store deletes a batch in id order), and the
		// rows inside its span were committed late by slower
		// transactions. Also the usual case.
		return nil, nil
	}
	if len(c.IDs) == 0 {
		p.log.Warn("relay: the sink's record of the bucket's last batch, a span of ids, does not match the store's rows; deleting none of them, so they may be published again: "+
			"a row the batch did not carry lies inside the span (committed late by a slower transaction), "+
			"another outbox shares the publisher's identity (a strict-mode TransactionalIDPrefix), or row ids were reused (the database recreated or restored)",
			"bucket", lease.Bucket, "recorded", c.Count, "found", len(held), "first", c.First, "last", c.Last)
		return nil, nil
	}
	p.log.Warn("relay: the sink's record of the bucket's last batch does not match the store's rows; deleting none of them, so they may be published again: "+
		"another outbox shares the publisher's identity (a strict-mode TransactionalIDPrefix), or row ids were reused (the database recreated or restored)",
		"bucket", lease.Bucket, "recorded", len(c.IDs), "found", len(held))
	return nil, nil
}

// read takes the bucket's batch: the one read ahead with the previous
// delete, if it was read under the same term and no failure capped the
// batch since (st.shrink), else the bucket's oldest rows, afresh.
func (p *drainers) read(ctx context.Context, b *batch, st bucketState) (batchResult, bool) {
	bucket := b.hl.Bucket
	limit := p.batchLimit()
	if st.shrink > 0 {
		limit = min(limit, st.shrink) // see failurePolicy
	}
	b.msgs = st.next
	if st.next == nil || st.nextTerm != b.hl.Term || st.shrink > 0 {
		var err error
		if b.msgs, err = p.store.NextBatch(ctx, bucket, limit); err != nil {
			if isStop(ctx, err) {
				return batchResult{out: outStopped}, true
			}
			if !IsMisconfiguration(err) {
				p.log.Warn("relay: read batch failed", "bucket", bucket, "err", err)
			}
			return batchResult{out: outFailed, err: err, store: true}, true
		}
	}
	if len(b.msgs) == 0 {
		return batchResult{out: outEmpty}, true
	}
	if len(b.msgs) > limit {
		b.msgs = b.msgs[:limit]
	}
	b.full = len(b.msgs) == limit
	return batchResult{}, false
}

// filter hands the batch to the failure handler's BatchFilter.
func (p *drainers) filter(ctx context.Context, b *batch) (batchResult, bool) {
	kept, out, err := p.filterBatch(ctx, b.hl.Lease, b.msgs)
	if kept == nil {
		// A failed filter met the store's database, as the GORM store's
		// failure policy does.
		return batchResult{out: out, err: err, store: out == outFailed && err != nil && !IsMisconfiguration(err)}, true
	}
	b.msgs = kept
	return batchResult{}, false
}

// admit waits for the pace (Config.RateLimit), then checks that the lease
// is still trusted, since the read and the wait may have been slow,
// before anything is handed to the publisher.
func (p *drainers) admit(ctx context.Context, b *batch) (batchResult, bool) {
	bucket := b.hl.Bucket
	if err := p.caps.pacer.WaitN(b.hl.ctx, len(b.msgs)); err != nil {
		if ctx.Err() != nil {
			return batchResult{out: outStopped}, true
		}
		return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease ended while waiting for the rate limit: %w", ErrLeaseLost, bucket, context.Cause(b.hl.ctx))}, true
	}
	if !p.k.trusts(b.hl.Lease) {
		return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d: lease no longer trusted", ErrLeaseLost, bucket)}, true
	}
	return batchResult{}, false
}

// publish hands the batch to the publisher under the lease and keeps its
// acknowledged prefix: a count outside the batch deletes nothing, and a
// prefix short of the batch without an error is an error.
func (p *drainers) publish(ctx context.Context, b *batch) {
	c := p.startPublish(b.hl)
	acked, err := p.publisher.Publish(c.ctx, b.msgs)
	p.acknowledged(ctx, b, c, acked, err)
}

// acknowledged keeps the acknowledged prefix of batch b's publish c, which
// returned acked and err, and reports the publish.
func (p *drainers) acknowledged(ctx context.Context, b *batch, c *publishCall, acked int, err error) {
	b.acked, b.perr, b.lost = c.end(ctx, acked, err, len(b.msgs))
	if b.acked < 0 || b.acked > len(b.msgs) {
		p.log.Error("relay: publisher reported an acknowledged count outside the batch; deleting nothing",
			"bucket", b.hl.Bucket, "acked", b.acked, "batch", len(b.msgs))
		b.perr = fmt.Errorf("relay: publisher acknowledged %d of a batch of %d", b.acked, len(b.msgs))
		b.acked = 0
	}
	p.observePublish(ctx, b.hl.Bucket, len(b.msgs), b.acked, b.perr, b.lost, time.Since(c.start))
	// Anything short of the whole batch, but a prefix the sink took on
	// purpose (Truncated), may have reached the sink without being
	// acknowledged.
	whole := b.perr == nil && b.acked == len(b.msgs)
	prefix := IsTruncated(b.perr) && b.acked > 0
	b.doubt = !whole && !prefix
	if b.perr == nil && b.acked < len(b.msgs) {
		b.perr = fmt.Errorf("relay: publisher acknowledged %d of %d messages without an error", b.acked, len(b.msgs))
	}
}

// fenced ends a batch the sink refused because another relay owns the
// bucket's identity there now: the rows are the new owner's; none is
// deleted.
func (p *drainers) fenced(b *batch) (batchResult, bool) {
	if !IsFenced(b.perr) {
		return batchResult{}, false
	}
	p.log.Warn("relay: publisher fenced; leaving the bucket to its new owner without deleting anything",
		"bucket", b.hl.Bucket, "term", b.hl.Term, "err", b.perr)
	return batchResult{out: outLost, err: b.perr}, true
}

// deleteAcked deletes the acknowledged prefix, guarded by the lease. The
// rows are deleted even when the relay is stopping: leaving them would
// only publish them again. After a complete full batch the next one is
// read in the same call (BatchAdvancer; without one, nothing is read
// ahead).
func (p *drainers) deleteAcked(ctx context.Context, b *batch) (batchResult, bool) {
	if b.acked == 0 {
		return batchResult{}, false
	}
	lease := b.hl.Lease
	dctx := context.WithoutCancel(ctx)
	var err error
	if b.full && b.acked == len(b.msgs) && b.perr == nil && !b.lost && ctx.Err() == nil {
		b.next, err = p.caps.advancer.MarkPublishedNext(dctx, p.cfg.RelayID, lease, b.msgs, p.batchLimit())
	} else {
		err = p.store.MarkPublished(dctx, p.cfg.RelayID, lease, b.msgs[:b.acked])
	}
	r, done := p.deleted(lease, b.acked, err)
	if done && !errors.Is(err, ErrLeaseLost) {
		b.doubt = true // the sink holds rows the store still has
	}
	return r, done
}

// deleted counts the acknowledged messages a delete under lease removed,
// or reports how it failed.
func (p *drainers) deleted(lease Lease, acked int, err error) (batchResult, bool) {
	switch {
	case err == nil:
		p.published.Add(int64(acked))
		return batchResult{}, false
	case errors.Is(err, ErrLeaseRevoked):
		p.log.Info("relay: lease revoked by an operator before delete; the rows are published again under the new term", "bucket", lease.Bucket, "term", lease.Term, "acked", acked)
		return batchResult{out: outLost, err: err}, true
	case errors.Is(err, ErrLeaseLost):
		p.log.Info("relay: lease lost before delete; the new owner publishes the rows again", "bucket", lease.Bucket, "term", lease.Term, "acked", acked)
		return batchResult{out: outLost, err: err}, true
	case !IsMisconfiguration(err):
		p.log.Warn("relay: delete published messages failed; they will be published again unless the publisher reconciles", "bucket", lease.Bucket, "acked", acked, "err", err)
	}
	return batchResult{out: outFailed, err: err, store: true}, true
}

// leaseEnded ends a batch whose lease ended during the publish: the rest
// of the batch is the new owner's.
func (p *drainers) leaseEnded(b *batch) (batchResult, bool) {
	if !b.lost {
		return batchResult{}, false
	}
	cause := context.Cause(b.hl.ctx)
	if errors.Is(cause, ErrLeaseRevoked) {
		p.log.Info("relay: lease revoked by an operator during publish; the rest of the batch is published under the new term", "bucket", b.hl.Bucket, "term", b.hl.Term, "acked", b.acked)
	} else {
		p.log.Warn("relay: lease lost during publish; leaving the rest of the batch to the new owner", "bucket", b.hl.Bucket, "term", b.hl.Term, "acked", b.acked)
	}
	return batchResult{out: outLost, err: fmt.Errorf("%w: bucket %d during publish: %w", ErrLeaseLost, b.hl.Bucket, cause)}, true
}

// failurePolicy meets a failed publish. A stop or a misconfiguration
// counts against no message. A failure the publisher pins on a later
// message, or a whole batch the sink refused, is narrowed first: the
// bucket's next batch is cut short so that the failure policy meets the
// culprit at the head of the bucket. Otherwise the first unacknowledged
// message meets the policy (fail).
func (p *drainers) failurePolicy(ctx context.Context, b *batch) batchResult {
	perr, acked, bucket := b.perr, b.acked, b.hl.Bucket
	switch {
	case ctx.Err() != nil:
		return batchResult{out: outStopped}
	case IsMisconfiguration(perr):
		// The publisher cannot work as configured (not started, not
		// authorized): no message is at fault, so nothing is recorded
		// against one, and the relay stops with the error.
		return batchResult{out: outFailed, err: perr}
	case IsTruncated(perr) && acked > 0:
		// The sink took a prefix on purpose (deleted above): the rest
		// is published next, at once.
		p.log.Debug("relay: the publisher took a prefix of the batch; publishing the rest next",
			"bucket", bucket, "acked", acked, "batch", len(b.msgs), "err", perr)
		return batchResult{out: outRetry}
	}
	if i, ok := FailedIndex(perr); ok && i > acked && i < len(b.msgs) {
		// The publisher names a later message as the cause (a
		// transactional one aborts the whole batch): publish the messages
		// before it on their own, at once.
		p.log.Debug("relay: batch failed at a later message; publishing the messages before it first",
			"bucket", bucket, "acked", acked, "failed_index", i, "err", perr)
		return batchResult{out: outRetry, shrink: i - acked}
	}
	if rest := len(b.msgs) - acked; rest > 1 && IsBatchRejected(perr) {
		// The sink refused several messages at once for what one of them
		// may have caused: publish the first half on its own, at once,
		// until the refused batch is a single message. Only that message
		// meets the failure policy.
		p.log.Info("relay: the sink rejected the batch as a whole; splitting it to find the message that caused it",
			"bucket", bucket, "acked", acked, "rejected", rest, "next_batch", rest/2, "err", perr)
		return batchResult{out: outRetry, shrink: rest / 2}
	}
	out, err := p.fail(ctx, b.hl.Lease, b.msgs[acked], acked, perr)
	return batchResult{out: out, err: err}
}

// filterBatch hands a batch to the failure handler's BatchFilter and
// returns the messages to publish. A nil result means the batch ends with
// the returned outcome: the filter failed, or took every message out and
// the bucket is read again.
func (p *drainers) filterBatch(ctx context.Context, lease Lease, msgs []Message) ([]Message, outcome, error) {
	kept, err := p.caps.filter.FilterBatch(ctx, p.cfg.RelayID, lease, msgs)
	switch {
	case err == nil:
	case isStop(ctx, err):
		return nil, outStopped, nil
	case errors.Is(err, ErrLeaseLost):
		return nil, outLost, err
	case IsMisconfiguration(err):
		return nil, outFailed, err
	default:
		p.log.Warn("relay: batch filter failed", "bucket", lease.Bucket, "err", err)
		return nil, outFailed, err
	}
	if removed := len(msgs) - len(kept); removed > 0 {
		p.cfg.Observer.MessagesDeadLettered(removed, true)
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
func (p *drainers) fail(ctx context.Context, lease Lease, msg Message, acked int, perr error) (outcome, error) {
	if IsUnavailable(perr) {
		p.log.Warn("relay: publish failed: the sink is unavailable; retrying after backoff, not counted against the message",
			"bucket", lease.Bucket, "acked", acked, "message_id", msg.MessageID, "err", perr)
		return outFailed, perr
	}
	msg, err := p.record(ctx, lease, msg, perr)
	if err != nil {
		return outLost, err
	}
	action, err := p.handle(ctx, Failure{RelayID: p.cfg.RelayID, Lease: lease, Message: msg, Acked: acked, Err: perr})
	if err != nil {
		return outcomeOf(err), err
	}
	p.log.Warn("relay: publish failed", "bucket", lease.Bucket, "acked", acked,
		"message_id", msg.MessageID, "attempts", msg.Attempts, "permanent", IsPermanent(perr), "err", perr)
	if action == FailureRetry {
		// The handler took the message out of the bucket.
		p.cfg.Observer.MessagesDeadLettered(1, false)
		return outRetry, nil
	}
	return outFailed, perr
}

// record counts the failure on the message (FailureRecorder) and returns
// the message with its attempts. Only a lost lease is an error: a record
// that failed otherwise is logged and the policy goes on.
func (p *drainers) record(ctx context.Context, lease Lease, msg Message, perr error) (Message, error) {
	err := p.caps.recorder.RecordFailure(ctx, p.cfg.RelayID, lease, msg, perr)
	switch {
	case err == nil:
		msg.Attempts++
	case errors.Is(err, ErrLeaseLost):
		return msg, err
	case errors.Is(err, errNotRecorded), isStop(ctx, err):
	default:
		p.log.Warn("relay: record publish failure failed", "bucket", lease.Bucket, "err", err)
	}
	return msg, nil
}

// handle asks the failure handler what to do with the failed message. It
// returns an error only for a misconfiguration or a lost lease; any other
// error of the handler is logged and taken as FailureBackoff.
func (p *drainers) handle(ctx context.Context, f Failure) (FailureAction, error) {
	a, err := p.caps.handler.HandleFailure(ctx, f)
	switch {
	case err == nil:
		return a, nil
	case IsMisconfiguration(err), errors.Is(err, ErrLeaseLost):
		return FailureBackoff, err
	case !isStop(ctx, err): // a stop cancelling the handler is no failure
		p.log.Warn("relay: failure handler failed", "bucket", f.Lease.Bucket, "message_id", f.Message.MessageID, "err", err)
	}
	return FailureBackoff, nil
}

// outcomeOf is the outcome of a batch that ends with err from the failure
// policy: a misconfiguration fails it (and stops the relay), a lost
// lease loses the bucket.
func outcomeOf(err error) outcome {
	if IsMisconfiguration(err) {
		return outFailed
	}
	return outLost
}

// publishCall is one publish of a bucket's batch under its lease: the
// publisher runs under ctx, which the lease keeper ends when the lease is
// lost (a renewal found it taken over) or can no longer be trusted (the
// trust window passed without a renewal; without a LeaseRenewer that
// bounds every publish), and Config.PublishTimeout ends. Renewal goes on
// meanwhile, on the keeper's own goroutine. No transaction or row lock is
// held.
type publishCall struct {
	p    *drainers
	what string
	ctx  context.Context // the publisher's
	pctx context.Context // the lease's bound, without the timeout
	// cancelTimeout and cancel release ctx and pctx.
	cancelTimeout, cancel context.CancelFunc
	start                 time.Time
}

// startPublish starts a publish under hl's lease.
func (p *drainers) startPublish(hl *heldLease) *publishCall {
	c := &publishCall{p: p, what: fmt.Sprintf("bucket %d", hl.Bucket)}
	pctx, cancel := p.caps.renewal.bound(hl.ctx, p.k, c.what)
	tctx, cancelTimeout := context.WithTimeoutCause(pctx, p.cfg.PublishTimeout, errPublishTimedOut)
	c.ctx, c.pctx, c.cancelTimeout, c.cancel, c.start = tctx, pctx, cancelTimeout, cancel, time.Now()
	return c
}

// end ends the publish of n messages, which returned acked and err, and
// reports whether the lease ended during it (lost). A publish the timeout
// ended short of the batch is an unavailable sink's.
func (c *publishCall) end(ctx context.Context, acked int, err error, n int) (int, error, bool) {
	timedOut := errors.Is(context.Cause(c.ctx), errPublishTimedOut) && ctx.Err() == nil
	c.cancelTimeout()
	lost := c.pctx.Err() != nil && ctx.Err() == nil
	c.cancel()
	if lost {
		c.p.log.Warn("relay: lease ended during publish; cancelled the publish", "batch", c.what, "cause", context.Cause(c.pctx))
	}
	if timedOut && !lost && (err != nil || acked < n) {
		// Not about the messages: the sink (or the publisher) stopped
		// answering. The bucket backs off like after any outage.
		err = Unavailable(fmt.Errorf("%w: %s: %s with %d of %d messages acknowledged",
			ErrPublishTimeout, c.what, time.Since(c.start).Round(time.Millisecond), acked, n))
	}
	return acked, err, lost
}

// observePublish reports one Publish call. A publish the relay cancelled
// (stopping, lease lost) is not a failure, unless it completed anyway.
func (p *drainers) observePublish(ctx context.Context, bucket, n, acked int, err error, lost bool, d time.Duration) {
	e := PublishEvent{Bucket: bucket, Messages: n, Acked: acked, Duration: d}
	switch {
	case err == nil && acked == n:
	case IsTruncated(err) && acked > 0:
	case lost || ctx.Err() != nil || IsFenced(err):
		e.Cancelled = true
	case err == nil:
		e.Err = fmt.Errorf("relay: publisher acknowledged %d of %d messages without an error", acked, n)
	default:
		e.Err = err
	}
	p.cfg.Observer.Published(e)
}
