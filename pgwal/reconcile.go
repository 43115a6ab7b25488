package pgwal

import (
	"context"
	"fmt"

	"github.com/jackc/pglogrepl"

	"github.com/gorm-outbox/outbox/relay"
)

// A strict-mode reader (a publisher that is a relay.Reconciler:
// publisher.Transactional) publishes nothing twice across reading terms.
// A term replays the slot from its confirmed position, which trails what
// the previous term published: a reader that died between a Kafka commit
// and the confirmation of its position leaves messages in the replay that
// Kafka already holds. Every Kafka transaction records the batch it
// carried (the progress marker, package publisher), with the Position of
// its last message: the LSN of that message's transaction's commit. A
// bucket's messages are in the order (commit LSN, message LSN), so that
// message, found in the replay by its commit and its ID (the negated LSN
// of its own record), divides the bucket's replay: what comes up to it is
// in Kafka, what follows is not.
//
// After the publisher fenced the previous owners (announce), the term
// reads every bucket's record (relay.Committed) and holds the bucket:
// nothing of it is published until the replay has passed the record's
// position. Then it drops the bucket's replayed messages up to the
// record's last message, but only when the record is shown to be this
// outbox's:
//
//   - the batch lies in the replay entirely: its IDs are the replayed
//     messages' up to the last one, and their digest is the record's;
//   - the replay starts inside the batch (the previous term confirmed a
//     position between two of its transactions): the replayed messages up
//     to the last one are the tail of the record's IDs, and the digest of
//     the last one alone is the record's LastDigest.
//
// Anything else drops nothing: a record without a position (written by a
// table-mode relay, or by an earlier version); a position before the
// term's start (the batch was confirmed before the restart point); a
// position beyond the server's WAL when the term began (no reader of
// this server can have published it); a record whose last message is not
// in the replay or whose digest does not match (another outbox shares
// the TransactionalIDPrefix), logged at Warn; a replay that holds bridged
// rows up to that message (their messages are read from the table later;
// a duplicate at worst). Dropped messages leave their queue as published
// ones do, so the confirmed position moves past them. Held messages count
// against MaxPending: when the held buckets alone fill it before their
// records are decided, the one with the longest replay is released
// undecided and published in full (a duplicate at worst) rather than
// stall the stream, and the reader logs it at Warn; then the next, while
// they still fill it.

// holdReplays hands each bucket's record to its queue: the bucket is held
// until settle decides it. from is where the term reads from, walEnd the
// server's WAL end once the publisher fenced the previous owners.
func (s *stream) holdReplays(records []relay.Committed, from, walEnd pglogrepl.LSN) {
	s.start, s.walEnd = from, walEnd
	for b, c := range records {
		if b >= len(s.buckets) || len(c.IDs) == 0 {
			continue
		}
		q := s.buckets[b]
		q.mu.Lock()
		q.held = &c
		q.mu.Unlock()
		s.holding++
	}
	s.settle()
}

// isHeld reports whether q waits for its replay to be decided.
func (q *bucketQ) isHeld() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held != nil
}

// settle decides the held buckets whose record's position the replay has
// passed (or that it will never reach). It runs on the receiving
// goroutine, after each transaction it queued and each advance of done.
func (s *stream) settle() {
	if s.holding == 0 {
		return
	}
	for _, q := range s.buckets {
		q.mu.Lock()
		c := q.held
		q.mu.Unlock()
		if c == nil {
			continue
		}
		if drop, ok := s.decide(q, c); ok {
			s.release(q, drop)
		}
	}
}

// giveUp releases the held bucket with the longest replay undecided,
// dropping nothing: the held replays filled the queues (MaxPending)
// before reaching their records' positions. Once its messages are
// published the stream reads on, and the other held buckets may still be
// decided; the receiving loop calls giveUp again while the held replays
// alone fill the queues.
func (s *stream) giveUp() {
	var (
		longest *bucketQ
		n       int
	)
	for _, q := range s.buckets {
		q.mu.Lock()
		if q.held != nil && (longest == nil || len(q.q) > n) {
			longest, n = q, len(q.q)
		}
		q.mu.Unlock()
	}
	if longest == nil {
		return
	}
	s.r.log.Warn("pgwal: the replay of a bucket before its last batch committed to Kafka outgrew MaxPending; publishing it in full, so messages may be published again",
		"bucket", longest.bucket, "held", n, "max_pending", s.r.cfg.MaxPending)
	s.release(longest, nil)
}

// heldEntries counts the messages queued in held buckets.
func (s *stream) heldEntries() int {
	n := 0
	for _, q := range s.buckets {
		q.mu.Lock()
		if q.held != nil {
			n += len(q.q)
		}
		q.mu.Unlock()
	}
	return n
}

// release ends q's hold: drop, its leading messages, leave the queue as
// published ones do, and the engine is woken for the bucket.
func (s *stream) release(q *bucketQ, drop []relay.Message) {
	q.mu.Lock()
	q.held = nil
	q.mu.Unlock()
	s.holding--
	if len(drop) > 0 {
		n, _ := s.take(q, drop)
		s.r.reconciled.Add(uint64(n))
		s.r.log.Info("pgwal: skipped replayed messages Kafka already holds (published by an earlier term, not confirmed)",
			"bucket", q.bucket, "term", s.term, "skipped", n)
	}
	s.hints.add(q.bucket)
}

// decide returns the leading messages of q that Kafka holds by record c,
// with ok true once that is decided; ok false while the replay has not
// passed c's position.
func (s *stream) decide(q *bucketQ, c *relay.Committed) (drop []relay.Message, ok bool) {
	pos := pglogrepl.LSN(c.Position)
	switch {
	case c.Position == 0, pos < s.start:
		return nil, true // no position, or confirmed before the restart point
	case pos > s.walEnd:
		s.r.log.Warn("pgwal: Kafka's record of the bucket's last batch lies beyond this server's WAL; skipping nothing: "+
			"another outbox shares the publisher's TransactionalIDPrefix",
			"bucket", q.bucket, "position", pos, "wal_end", s.walEnd)
		return nil, true
	case s.done <= pos:
		return nil, false // its transaction is not queued yet
	}
	last := c.IDs[len(c.IDs)-1]
	q.mu.Lock()
	defer q.mu.Unlock()
	k := -1
	for i := range q.q {
		e := &q.q[i]
		if e.commit > pos {
			break
		}
		if e.commit == pos && e.msg.ID == last {
			k = i
			break
		}
	}
	if k < 0 {
		s.r.log.Warn("pgwal: Kafka's record of the bucket's last batch names a message the replay does not hold; skipping nothing: "+
			"another outbox shares the publisher's TransactionalIDPrefix",
			"bucket", q.bucket, "position", pos, "recorded", len(c.IDs))
		return nil, true
	}
	es := q.q[:k+1]
	for i := range es {
		if es[i].bridged {
			s.r.log.Warn("pgwal: the replay up to Kafka's record of the bucket's last batch holds bridged rows, which it cannot verify; skipping nothing, so messages may be published again",
				"bucket", q.bucket, "position", pos)
			return nil, true
		}
	}
	msgs := make([]relay.Message, len(es))
	for i := range es {
		msgs[i] = es[i].msg
	}
	if matches(msgs, c) {
		return msgs, true
	}
	s.r.log.Warn("pgwal: Kafka's record of the bucket's last batch does not match the replayed messages; skipping nothing, so they may be published again: "+
		"another outbox shares the publisher's TransactionalIDPrefix",
		"bucket", q.bucket, "position", pos, "recorded", len(c.IDs), "replayed", len(msgs))
	return nil, true
}

// matches reports whether msgs, the replay of a bucket up to the message
// c records last, end with c's batch: entirely, with c's IDs and digest,
// or, when the replay starts inside the batch, with the tail of c's IDs
// and c's LastDigest for the last message.
func matches(msgs []relay.Message, c *relay.Committed) bool {
	n := len(c.IDs)
	if len(msgs) >= n {
		tail := msgs[len(msgs)-n:]
		for i := range tail {
			if tail[i].ID != c.IDs[i] {
				return false
			}
		}
		return relay.MessagesDigest(tail) == c.Digest
	}
	ids := c.IDs[n-len(msgs):]
	for i := range msgs {
		if msgs[i].ID != ids[i] {
			return false
		}
	}
	return c.LastDigest != 0 && relay.MessagesDigest(msgs[len(msgs)-1:]) == c.LastDigest
}

// readRecords reads every bucket's record of its last batch committed to
// Kafka, after the publisher fenced the previous owners (LeasesAcquired).
func readRecords(ctx context.Context, rc relay.Reconciler, leases []relay.Lease) ([]relay.Committed, error) {
	records := make([]relay.Committed, len(leases))
	for i, l := range leases {
		c, err := rc.Reconcile(ctx, l)
		if err != nil {
			return nil, fmt.Errorf("read Kafka's record of bucket %d: %w", l.Bucket, err)
		}
		records[i] = c
	}
	return records, nil
}
