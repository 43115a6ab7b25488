package pgwal

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gorm-outbox/outbox/internal/bucketset"
	"github.com/gorm-outbox/outbox/relay"
)

// source is the relay engine's store over one term's stream: the buckets
// are the stream's in-memory queues, one lease of every bucket is held
// under the reader's term while the slot's lease is, and a message leaves
// its queue when it was published or dead-lettered, which moves the
// position the stream confirms. The engine publishes it as it publishes
// a table (relay/doc.go): per bucket in order, buckets in parallel, with
// its failure handling.
//
// It implements relay.Store, relay.LeaseRenewer, relay.FailureRecorder
// and relay.BucketCounter; its failure policy (policy) is the engine's
// FailureHandler and BatchFilter.
type source struct{ s *stream }

var (
	_ relay.Store           = source{}
	_ relay.LeaseRenewer    = source{}
	_ relay.FailureRecorder = source{}
	_ relay.BucketCounter   = source{}
)

// leases returns every bucket's lease under the term while the stream
// holds the slot's lease, and none otherwise: a reader that lost the
// slot drains nothing.
func (src source) leases() []relay.Lease {
	s := src.s
	if !s.holds() {
		return nil
	}
	ls := make([]relay.Lease, len(s.buckets))
	for b := range ls {
		ls[b] = relay.Lease{Bucket: b, Term: s.term}
	}
	return ls
}

// guard fails with relay.ErrLeaseLost unless lease is this stream's and
// the stream still holds the slot's lease.
func (src source) guard(lease relay.Lease) (*bucketQ, error) {
	s := src.s
	if lease.Term != s.term || !s.holds() {
		return nil, fmt.Errorf("%w: bucket %d term %d: the reader no longer reads the slot under term %d", relay.ErrLeaseLost, lease.Bucket, lease.Term, s.term)
	}
	if lease.Bucket < 0 || lease.Bucket >= len(s.buckets) {
		return nil, fmt.Errorf("%w: bucket %d is outside 0..%d", relay.ErrLeaseLost, lease.Bucket, len(s.buckets)-1)
	}
	return s.buckets[lease.Bucket], nil
}

// BucketCount implements relay.BucketCounter.
func (src source) BucketCount() int { return len(src.s.buckets) }

// AcquireLeases implements relay.Store: every bucket under the term while
// the slot's lease is held. The one reader of the slot owns every bucket.
func (src source) AcquireLeases(_ context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	if err := relay.CheckBucketCount(req.BucketCount, len(src.s.buckets), "the WAL mode outbox"); err != nil {
		return relay.Acquired{}, err
	}
	return relay.Acquired{Leases: src.leases(), LiveRelays: 1, FairShare: len(src.s.buckets)}, nil
}

// RenewLeases implements relay.LeaseRenewer.
func (src source) RenewLeases(context.Context, string, []relay.Lease, time.Duration) ([]relay.Lease, error) {
	return src.leases(), nil
}

// ReleaseLeases implements relay.Store: the buckets' leases are the
// slot's lease, which the reader releases itself.
func (source) ReleaseLeases(context.Context, string, []relay.Lease) error { return nil }

// PendingBuckets implements relay.Store: the buckets whose queue is not
// empty, but for those held until their replay is decided.
func (src source) PendingBuckets(_ context.Context, buckets []int) ([]int, error) {
	var out []int
	for _, b := range buckets {
		if b < 0 || b >= len(src.s.buckets) {
			continue
		}
		q := src.s.buckets[b]
		q.mu.Lock()
		n := len(q.q)
		if q.held != nil {
			n = 0 // published once its replay is decided
		}
		q.mu.Unlock()
		if n > 0 {
			out = append(out, b)
		}
	}
	return out, nil
}

// headPoll is how long NextBatch waits for a bridged row whose
// transaction is decoded but not visible yet.
const headPoll = time.Millisecond

// pause waits d, or until ctx ends, with its cause.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}

// NextBatch implements relay.Store: up to limit leading entries of the
// bucket's queue, left in it; none while the bucket is held until its
// replay is decided (reconcile.go). Bridged rows of the messages table are read
// when they reach the head; a head row that is gone (a table-mode relay
// published or dead-lettered it) leaves the queue here.
func (src source) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	s := src.s
	if bucket < 0 || bucket >= len(s.buckets) {
		return nil, nil
	}
	q := s.buckets[bucket]
	if q.isHeld() {
		// Its replay is not decided (reconcile.go): the bucket is hinted
		// once it is.
		return []relay.Message{}, nil
	}
	for {
		if msgs, ok := q.head(limit); ok {
			return msgs, nil
		}
		es := q.batch(limit)
		if len(es) == 0 {
			return []relay.Message{}, nil
		}
		es, gone, err := s.loadBridged(ctx, q, es)
		switch {
		case err != nil:
			return nil, err
		case gone > 0:
			s.remove(q, gone)
			continue
		case len(es) == 0:
			// The head row's transaction is decoded but not visible yet.
			if err := pause(ctx, headPoll); err != nil {
				return nil, err
			}
			continue
		}
		msgs := make([]relay.Message, len(es))
		for i, e := range es {
			msgs[i] = e.msg
			msgs[i].Attempts += e.attempts
		}
		return msgs, nil
	}
}

// MarkPublished implements relay.Store: under the term's guard it takes
// msgs out of their bucket's queue by id, deletes the bridged rows among
// them, and so lets the confirmed position move past them.
func (src source) MarkPublished(ctx context.Context, _ string, lease relay.Lease, msgs []relay.Message) error {
	q, err := src.guard(lease)
	if err != nil {
		return err
	}
	removed, bridged := src.s.take(q, msgs)
	src.s.deleteBridged(ctx, bridged)
	src.s.r.published.Add(uint64(removed))
	return nil
}

// RecordFailure implements relay.FailureRecorder: it counts the failure
// on the message's entry, under the term's guard.
func (src source) RecordFailure(_ context.Context, _ string, lease relay.Lease, msg relay.Message, _ error) error {
	q, err := src.guard(lease)
	if err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for i := range q.q {
		if q.q[i].msg.ID == msg.ID {
			q.q[i].attempts++
			break
		}
	}
	return nil
}

// take removes the entries of msgs from q, found by id (never by a
// range), and returns how many it removed and the ids of the bridged
// rows among them. msgs is usually q's head, in order.
func (s *stream) take(q *bucketQ, msgs []relay.Message) (n int, bridged []int64) {
	if len(msgs) == 0 {
		return 0, nil
	}
	q.mu.Lock()
	head := len(msgs) <= len(q.q)
	for i := 0; head && i < len(msgs); i++ {
		head = q.q[i].msg.ID == msgs[i].ID
	}
	if head {
		for i := range msgs {
			if q.q[i].bridged {
				bridged = append(bridged, q.q[i].msg.ID)
			}
		}
		n = len(msgs)
		q.q = q.q[n:]
	} else {
		ids := make(map[int64]struct{}, len(msgs))
		for _, m := range msgs {
			ids[m.ID] = struct{}{}
		}
		q.q = slices.DeleteFunc(q.q, func(e entry) bool {
			if _, ok := ids[e.msg.ID]; ok {
				n++
				if e.bridged {
					bridged = append(bridged, e.msg.ID)
				}
				return true
			}
			return false
		})
	}
	q.mu.Unlock()
	s.removed(n)
	return n, bridged
}

// remove drops the first n entries of q (rows gone from the messages
// table).
func (s *stream) remove(q *bucketQ, n int) {
	q.mu.Lock()
	n = min(n, len(q.q))
	q.q = q.q[n:]
	q.mu.Unlock()
	s.removed(n)
}

// removed accounts for n entries that left the queues: backpressure
// (MaxPending) eases.
func (s *stream) removed(n int) {
	if n == 0 {
		return
	}
	s.mu.Lock()
	s.pending -= n
	s.mu.Unlock()
	select {
	case s.drained <- struct{}{}:
	default:
	}
}

// hints is the engine's relay.Hints for one stream: the buckets that
// received messages since the engine last took them (Take), and a
// coalescing wake-up.
type hints struct {
	*bucketset.Hints
	ready chan struct{}
}

func newHints(buckets int) *hints {
	return &hints{Hints: bucketset.NewHints(buckets), ready: make(chan struct{}, 1)}
}

// add hints buckets.
func (h *hints) add(buckets ...int) {
	h.Add(buckets)
	select {
	case h.ready <- struct{}{}:
	default:
	}
}

// Ready implements relay.Hints.
func (h *hints) Ready() <-chan struct{} { return h.ready }

var _ relay.BacklogSampler = source{}

// errNotCaughtUp is SampleBacklog's answer while the term has not read
// the WAL written before it began: its queues do not hold the backlog yet.
var errNotCaughtUp = errors.New("pgwal: the reader has not yet read the WAL written before its term began")

// SampleBacklog implements relay.BacklogSampler, so that a
// relay.BacklogObserver (metrics.Collector) as Config.Observer reports
// WAL mode's backlog as table mode's: the messages the reader decoded and
// has not published or dead-lettered, per bucket, with the oldest one's
// creation time (the lag in time, as WALStatus's), and the dead-letter
// table's count. WAL not decoded yet is not counted: while the term has
// not read the WAL written before it began, the sample fails (the
// backlog is unknown). The engine samples only while the reader reads.
func (src source) SampleBacklog(ctx context.Context) (relay.Backlog, error) {
	s := src.s
	if !s.caughtUp.Load() {
		return relay.Backlog{}, errNotCaughtUp
	}
	b := relay.Backlog{BucketCount: len(s.buckets), SampledAt: time.Now()}
	for _, q := range s.buckets {
		q.mu.Lock()
		if n := len(q.q); n > 0 {
			oldest := q.q[0].msg.CreatedAt
			for _, e := range q.q[1:] {
				if e.msg.CreatedAt.Before(oldest) {
					oldest = e.msg.CreatedAt
				}
			}
			b.Buckets = append(b.Buckets, relay.BucketBacklog{Bucket: q.bucket, Pending: int64(n), Oldest: oldest})
			b.Pending += int64(n)
			if b.Oldest.IsZero() || oldest.Before(b.Oldest) {
				b.Oldest = oldest
			}
		}
		q.mu.Unlock()
	}
	db := s.r.sess(ctx)
	if err := db.Table(s.r.dead).Count(&b.DeadLetters).Error; err != nil {
		return relay.Backlog{}, fmt.Errorf("pgwal: count dead letters: %w", err)
	}
	b.DeadLettersKnown = true
	return b, nil
}
