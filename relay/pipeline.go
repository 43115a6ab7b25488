package relay

import (
	"context"
)

// sent is a batch handed to the Pipeliner. Its acknowledgements are
// awaited on a goroutine of its own, so that the drainer can read and
// send the bucket's next batch meanwhile.
type sent struct {
	*batch
	done chan struct{} // closed once wait returned: acked, perr and lost are set
}

// complete reports whether every message of the batch was acknowledged
// while the lease held.
func (s *sent) complete() bool { return s.perr == nil && !s.lost && s.acked == len(s.msgs) }

// ended reports whether the batch's wait returned, and whether it failed
// (failed): it was not acknowledged completely.
func (s *sent) ended() (ended, failed bool) {
	select {
	case <-s.done:
		return true, !s.complete()
	default:
		return false, false
	}
}

// failedAny reports whether a batch of q is known to have failed.
func failedAny(q []*sent) bool {
	for _, s := range q {
		if _, failed := s.ended(); failed {
			return true
		}
	}
	return false
}

// keyOf is a message's key for the per-key order: a keyless message is
// ordered with the bucket's other keyless messages.
func keyOf(m *Message) string {
	if m.Key == nil {
		return "\x00nil"
	}
	return "\x01" + string(m.Key)
}

// unacknowledged returns the keys of the messages of q not known to be
// acknowledged: every key of a batch whose wait has not returned.
func unacknowledged(q []*sent) map[string]bool {
	keys := map[string]bool{}
	for _, s := range q {
		if ended, failed := s.ended(); ended && !failed {
			continue
		}
		for i := range s.msgs {
			keys[keyOf(&s.msgs[i])] = true
		}
	}
	return keys
}

// unended counts the batches of q whose wait has not returned: the ones
// PipelineDepth bounds.
func unended(q []*sent) int {
	n := 0
	for _, s := range q {
		if ended, _ := s.ended(); !ended {
			n++
		}
	}
	return n
}

// pipelineQueueFactor bounds a bucket's batches in flight, those
// acknowledged behind an unacknowledged one included, to this many times
// PipelineDepth: their rows are left out of every read until deleted.
const pipelineQueueFactor = 4

// send hands batch b to the Pipeliner under its lease (startPublish),
// behind the bucket's batches in flight, and awaits its acknowledgements
// in the background, then signals ends (one slot). Each batch is reported
// to the Observer on its own.
func (p *drainers) send(ctx context.Context, b *batch, ends chan<- struct{}) *sent {
	c := p.startPublish(b.hl)
	wait := p.pipeliner.Send(c.ctx, b.msgs)
	s := &sent{batch: b, done: make(chan struct{})}
	go func() {
		acked, err := wait()
		p.acknowledged(ctx, b, c, acked, err)
		close(s.done)
		select {
		case ends <- struct{}{}:
		default:
		}
	}()
	return s
}

// await waits for every batch of q to end.
func await(q []*sent) {
	for _, s := range q {
		<-s.done
	}
}

// pipelined drains bucket b's batches, b read, with a Pipeliner
// (Config.PipelineDepth above 1): the variant of drainBatch's steps that
// keeps up to PipelineDepth batches of the bucket in flight. Each batch
// goes through filter and admit, then is sent; then, while the oldest
// batch in flight is unacknowledged:
//
//   - pipeline: when the bucket was hinted since the last read, fewer
//     than PipelineDepth batches in flight are unacknowledged (and q
//     holds fewer than pipelineQueueFactor × PipelineDepth), none of
//     them is known to have failed, and the scheduler lets the drainer go on
//     (scheduler.pipeline), the next batch is read without the rows in
//     flight (BatchSkipper; a store that cannot leave that many out
//     reads nothing, and the drainer waits for the oldest batch to end)
//     and sent behind them, cut before its first
//     message whose key has a message in a batch not acknowledged yet:
//     a message is never sent while an earlier one of its key may still
//     fail (a sink fails what waits behind a failed message, not what
//     reaches it after the failure, before the relay saw it). The rest
//     is read again once the oldest batch ends;
//   - acknowledged: batches end in the order they were sent. A batch
//     acknowledged completely is deleted (guarded by the lease) once
//     every earlier one was, and after the next batch was sent if there
//     is one, so the delete is off the path to the next publish;
//   - failed: a batch that failed, was acknowledged in part or lost its
//     lease stops the sends; every later batch in flight is awaited and
//     none of it is deleted (its rows are published again later: a
//     duplicate at worst); the batch then ends as drainBatch's last batch
//     does (fenced, conclude): its acknowledged prefix is deleted and the
//     failure policy meets it.
//
// The last batch, acknowledged with nothing else in flight and no hint
// to follow, ends the turn as drainBatch's does (conclude), a full one
// with the next read (BatchAdvancer). A read or filter that ends the
// sends ends the turn with its result once the batches in flight are
// acknowledged and deleted. Every wait has returned and every delete
// ended when pipelined returns.
func (p *drainers) pipelined(ctx context.Context, b *batch) batchResult {
	bucket, lease := b.hl.Bucket, b.hl.Lease
	hinted := p.sched.watch(bucket)
	defer p.sched.unwatch(bucket)
	marks := b.marks // the bucket's marks the last read covered
	defer func() { b.marks = marks }()
	var (
		q       []*sent      // in flight, in bucket order
		acked   *sent        // acknowledged completely, not deleted yet
		ended   *batchResult // a step that ended the sends, with its result
		turns   int          // batches sent
		blocked bool         // the last read was cut, or read nothing: read again after the oldest batch ends
	)
	ends := make(chan struct{}, 1) // a batch's wait returned
	next := b
	for {
		if next != nil {
			if r, done := p.filter(ctx, next); done {
				ended = &r
			} else if r, done := p.admit(ctx, next); done {
				ended = &r
			} else {
				q = append(q, p.send(ctx, next, ends))
				turns++
			}
			next = nil
		}
		if acked != nil {
			err := p.store.MarkPublished(context.WithoutCancel(ctx), p.cfg.RelayID, lease, acked.msgs)
			if r, done := p.deleted(lease, acked.acked, err); done {
				await(q)
				return r
			}
			acked = nil
		}
		if len(q) == 0 {
			// Nothing in flight is left only after a step ended the sends.
			return *ended
		}
		var wake <-chan struct{}
		if p.mayPipeline(ctx, ended, blocked, q) {
			m, ok := p.sched.pipeline(bucket, true, turns >= maxTurns)
			if ok && m != marks {
				next, ended, blocked = p.readNext(ctx, b.hl, q, nil, m, &marks)
				continue
			}
			if ok {
				wake = hinted
			}
		}
		select {
		case <-q[0].done:
		case <-wake:
			continue
		case <-ends:
			// A later batch ended: it no longer counts against
			// PipelineDepth, or it failed and stops the sends.
			continue
		}
		head := q[0]
		q = q[1:]
		blocked = false
		if !head.complete() {
			await(q)
			if r, done := p.fenced(head.batch); done {
				return r
			}
			return p.conclude(ctx, head.batch)
		}
		if len(q) > 0 || ended != nil {
			acked = head
			continue
		}
		// The last batch in flight: a hint since the last read sends the
		// next one before this one's delete.
		if p.mayPipeline(ctx, nil, false, nil) {
			if m, ok := p.sched.pipeline(bucket, false, turns >= maxTurns); ok && m != marks {
				if next, ended, _ = p.readNext(ctx, b.hl, nil, head, m, &marks); next != nil || ended != nil {
					acked = head
					continue
				}
			}
		}
		return p.conclude(ctx, head.batch)
	}
}

// mayPipeline reports whether the drainer may read and send the bucket's
// next batch behind the batches in flight q, as far as the turn goes:
// no step ended the sends, the last read was not cut by a key in flight,
// fewer than PipelineDepth batches of q are unacknowledged (a batch
// acknowledged behind an unacknowledged one waits for its delete, not for
// the sink: a slow batch does not hold the bucket's later sends back),
// q holds fewer than pipelineQueueFactor × PipelineDepth batches, none
// is known to have failed, and the relay is not stopping. The scheduler
// has its say too (scheduler.pipeline).
func (p *drainers) mayPipeline(ctx context.Context, ended *batchResult, blocked bool, q []*sent) bool {
	return ended == nil && !blocked && len(q) < pipelineQueueFactor*p.cfg.PipelineDepth &&
		unended(q) < p.cfg.PipelineDepth && ctx.Err() == nil && !failedAny(q)
}

// readNext reads the bucket's next batch without the rows of the batches
// in flight (q) and of the batch acknowledged but not deleted yet (acked,
// nil: none), covering the bucket's marks m (stored in *marks when the
// read covered them), and cuts it before its first message whose key has
// a message in a batch of q not acknowledged yet. It returns the batch
// or, when the read ends the sends, the turn's result: the read failed or
// was stopped. blocked says that the read covered less than the bucket
// holds beyond the rows left out, and *marks is left as it was: the
// batch was cut, or the store could not leave that many rows out
// (BatchSkipper's nil batch). An empty read returns neither: nothing
// waits beyond the rows left out.
func (p *drainers) readNext(ctx context.Context, hl *heldLease, q []*sent, acked *sent, m uint64, marks *uint64) (next *batch, ended *batchResult, blocked bool) {
	var except []Message
	if acked != nil {
		except = append(except, acked.msgs...)
	}
	for _, s := range q {
		except = append(except, s.msgs...)
	}
	limit := p.batchLimit()
	msgs, err := p.caps.skipper.NextBatchExcept(ctx, hl.Bucket, limit, except)
	switch {
	case err != nil && isStop(ctx, err):
		return nil, &batchResult{out: outStopped}, false
	case err != nil:
		if !IsMisconfiguration(err) {
			p.log.Warn("relay: read batch failed", "bucket", hl.Bucket, "err", err)
		}
		return nil, &batchResult{out: outFailed, err: err}, false
	case msgs == nil:
		return nil, nil, true
	}
	if len(msgs) > limit {
		msgs = msgs[:limit]
	}
	full := len(msgs) == limit
	if keys := unacknowledged(q); len(keys) > 0 {
		for i := range msgs {
			if keys[keyOf(&msgs[i])] {
				msgs, full, blocked = msgs[:i], false, true
				break
			}
		}
	}
	if !blocked {
		*marks = m
	}
	if len(msgs) == 0 {
		return nil, nil, blocked
	}
	return &batch{hl: hl, msgs: msgs, full: full, marks: m, settled: true}, nil, blocked
}
