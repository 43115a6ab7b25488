package pgwal

import (
	"context"
	"errors"
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
// reads every bucket's record (relay.Committed) and holds the bucket
// until its replay reaches the record's last message. Meanwhile the
// bucket's replayed messages are set aside, not queued: only the last
// len(IDs) of them are kept (their ids and message ids), to verify the
// record, and the position to confirm stays before the first one set
// aside, so the slot keeps them. When the record's last message arrives
// (by its commit and its ID), the record is shown to be this outbox's
// if
//
//   - the batch lies in the replay entirely: its IDs are the last
//     messages set aside, and their digest is the record's;
//   - the replay starts inside the batch (the previous term confirmed a
//     position between two of its transactions): the messages set aside
//     are the tail of the record's IDs, and the digest of the last one
//     alone is the record's LastDigest.
//
// Then the messages set aside are skipped for good (counted in
// Stats.Reconciled) and the bucket is queued from the next message on.
// Memory stays bounded by the record's size however long the replay up
// to it: what earlier terms published past the slot's confirmed position,
// which trails the slowest bucket's head.
//
// A record that does not hold skips nothing. Decided at once: a record
// without a position (written by a table-mode relay, or by an earlier
// version); a position before the term's start (the batch was confirmed
// before the restart point); a position beyond the server's WAL when the
// term began (no reader of this server can have published it), logged at
// Warn. Decided when the replay passes the record's position without its
// last message, when that message does not match (another outbox shares
// the TransactionalIDPrefix), or when a bridged row is replayed before it
// (its message is read from the table later): logged at Warn. If
// messages were set aside by then, they are no longer in memory: the term
// ends (errRecordNotOurs), the reader remembers the record as not its
// own, and the next term, which replays them from the position held back,
// publishes the bucket in full.

// errRecordNotOurs ends a term that set aside replayed messages for a
// record that proved not to be this outbox's: the next term reads them
// again from the slot and publishes them.
var errRecordNotOurs = errors.New("pgwal: Kafka's record of a bucket's last batch is not this outbox's; reading the slot again to publish the messages set aside")

// recordKey identifies a record the reader found not to be its own.
type recordKey struct {
	position, digest, lastDigest uint64
	last                         int64
}

func keyOf(c *relay.Committed) recordKey {
	return recordKey{position: c.Position, digest: c.Digest, lastDigest: c.LastDigest, last: c.IDs[len(c.IDs)-1]}
}

// holdReplays hands each bucket's record to its queue: the bucket is held
// until its replay is decided. from is where the term reads from, walEnd
// the server's WAL end once the publisher fenced the previous owners.
func (s *stream) holdReplays(records []relay.Committed, from, walEnd pglogrepl.LSN) {
	s.start, s.walEnd = from, walEnd
	for b, c := range records {
		if b >= len(s.buckets) || len(c.IDs) == 0 {
			continue
		}
		q := s.buckets[b]
		pos := pglogrepl.LSN(c.Position)
		switch {
		case c.Position == 0, pos < from:
			continue // no position, or confirmed before the restart point
		case pos > walEnd:
			s.r.log.Warn("pgwal: Kafka's record of the bucket's last batch lies beyond this server's WAL; skipping nothing: "+
				"another outbox shares the publisher's TransactionalIDPrefix",
				"bucket", b, "position", pos, "wal_end", walEnd)
			continue
		}
		if _, ok := s.r.notOurs[keyOf(&c)]; ok {
			continue
		}
		q.mu.Lock()
		q.held = &c
		q.mu.Unlock()
		s.holding++
	}
}

// isHeld reports whether q waits for its replay to be decided.
func (q *bucketQ) isHeld() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.held != nil
}

// replayHeld takes the messages es of held bucket q, in order, and
// returns those to queue: the ones after the record's last message once
// the record is decided; none while it is not.
func (s *stream) replayHeld(q *bucketQ, es []entry) []entry {
	q.mu.Lock()
	defer q.mu.Unlock()
	c := q.held
	pos, last := pglogrepl.LSN(c.Position), c.IDs[len(c.IDs)-1]
	for k := range es {
		e := &es[k]
		if e.commit > pos || e.bridged {
			s.notOurs(q, "the replay passed the record's position without its last message, or holds bridged rows before it")
			if s.restart != nil {
				return nil // the term ends: nothing of the bucket may go before what was set aside
			}
			return es[k:]
		}
		if q.setAside == 0 {
			q.floor = e.commit
		}
		q.setAside++
		slim := relay.Message{ID: e.msg.ID, MessageID: e.msg.MessageID}
		if len(q.aside) < len(c.IDs) {
			q.aside = append(q.aside, slim)
		} else { // a ring of the last len(c.IDs), the oldest at asideAt
			q.aside[q.asideAt] = slim
			q.asideAt = (q.asideAt + 1) % len(q.aside)
		}
		if e.commit == pos && e.msg.ID == last {
			window := append(q.aside[q.asideAt:len(q.aside):len(q.aside)], q.aside[:q.asideAt]...)
			if !matches(window, c) {
				s.notOurs(q, "the replayed messages do not match it")
				return nil // the term ends (messages were set aside)
			}
			s.r.reconciled.Add(uint64(q.setAside))
			s.r.log.Info("pgwal: skipped replayed messages Kafka already holds (published by an earlier term, not confirmed)",
				"bucket", q.bucket, "term", s.term, "skipped", q.setAside)
			s.unhold(q)
			return es[k+1:]
		}
	}
	return nil
}

// notOurs decides that q's record is not this outbox's, under q.mu: the
// bucket is released, and if messages were set aside the term must end
// to read them again.
func (s *stream) notOurs(q *bucketQ, why string) {
	s.r.log.Warn("pgwal: Kafka's record of the bucket's last batch is not this outbox's; skipping nothing, so messages may be published again: "+
		"another outbox shares the publisher's TransactionalIDPrefix, or the server was restored to an earlier point",
		"bucket", q.bucket, "position", pglogrepl.LSN(q.held.Position), "recorded", len(q.held.IDs), "reason", why)
	if q.setAside > 0 {
		s.r.notOurs[keyOf(q.held)] = struct{}{}
		if s.restart == nil || q.floor < s.keepFrom {
			s.keepFrom = q.floor
		}
		s.restart = errRecordNotOurs
	}
	s.unhold(q)
}

// unhold ends q's hold, under q.mu.
func (s *stream) unhold(q *bucketQ) {
	q.held, q.aside, q.asideAt, q.setAside, q.floor = nil, nil, 0, 0, 0
	s.holding--
}

// settle decides the held buckets whose record's position the replay has
// passed without reaching its last message. It runs on the receiving
// goroutine after each advance of done, and returns errRecordNotOurs
// when the term must end.
func (s *stream) settle() error {
	if s.holding > 0 {
		for _, q := range s.buckets {
			q.mu.Lock()
			if q.held != nil && s.done > pglogrepl.LSN(q.held.Position) {
				s.notOurs(q, "the replay passed the record's position without its last message")
				s.hints.add(q.bucket)
			}
			q.mu.Unlock()
		}
	}
	return s.restart
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
