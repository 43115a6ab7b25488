package pgwal

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/relay"
)

// policy is the reader's failure policy, the relay engine's
// relay.FailureHandler and relay.BatchFilter over a term's stream. Its
// semantics are those of table mode's gormrelay.FailurePolicy in
// ModeDeadLetter with quarantine: a message that failed permanently
// (relay.IsPermanent) or Config.MaxAttempts times moves to the
// dead-letter table (state "failed"), and the later messages of its key
// in its bucket are parked behind it (state "parked"), in order, until
// RequeueKey (or Admin) puts the key's dead letters back into the
// stream. Outages (relay.IsUnavailable) never reach it: the engine backs
// off without counting them. Dead letters keep the message's id, the
// negated WAL position of its record (a bridged row keeps its table id).
//
// Every write is guarded by the term (source.guard): a reader that lost
// the slot dead-letters and parks nothing.
type policy struct{ src source }

var (
	_ relay.FailureHandler = policy{}
	_ relay.BatchFilter    = policy{}
)

// HandleFailure implements relay.FailureHandler.
func (p policy) HandleFailure(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
	q, err := p.src.guard(f.Lease)
	if err != nil {
		return relay.FailureBackoff, err
	}
	s := p.src.s
	if !relay.IsPermanent(f.Err) && f.Message.Attempts < s.r.cfg.MaxAttempts {
		return relay.FailureBackoff, nil
	}
	text := "unknown error"
	if f.Err != nil {
		text = f.Err.Error()
	}
	if err := s.deadLetter(ctx, q, []relay.Message{f.Message}, gormrelay.DeadLetterFailed, text); err != nil {
		return relay.FailureBackoff, err
	}
	return relay.FailureRetry, nil
}

// FilterBatch implements relay.BatchFilter: it parks the messages of msgs
// whose key is quarantined in their bucket and returns the others in
// order. A quarantined key whose dead letters are gone (requeued) flows
// again.
func (p policy) FilterBatch(ctx context.Context, _ string, lease relay.Lease, msgs []relay.Message) ([]relay.Message, error) {
	q, err := p.src.guard(lease)
	if err != nil {
		return nil, err
	}
	s := p.src.s
	if err := s.awaitQuarantined(ctx, q, msgs); err != nil {
		return nil, err
	}
	var park []relay.Message
	for _, m := range msgs {
		if q.isQuarantined(&m) {
			park = append(park, m)
		}
	}
	if len(park) == 0 {
		return msgs, nil
	}
	// park checks each key's dead letters under the key's lock and takes
	// a key whose dead letters were requeued out of quarantine: its
	// messages are kept, in the batch's order.
	if err := s.park(ctx, q, park); err != nil {
		return nil, err
	}
	keep := msgs[:0:0]
	for _, m := range msgs {
		if !q.isQuarantined(&m) {
			keep = append(keep, m)
		}
	}
	return keep, nil
}

// park dead-letters msgs, messages of quarantined keys, in state parked,
// one key at a time under the key's lock (lockKey), which a requeue of
// the key also takes: a key whose dead letters a requeue took meanwhile
// is not parked but taken out of quarantine.
func (s *stream) park(ctx context.Context, q *bucketQ, msgs []relay.Message) error {
	var order []string
	byKey := map[string][]relay.Message{}
	for _, m := range msgs {
		k := string(m.Key)
		if _, ok := byKey[k]; !ok {
			order = append(order, k)
		}
		byKey[k] = append(byKey[k], m)
	}
	for _, k := range order {
		err := s.deadLetter(ctx, q, byKey[k], gormrelay.DeadLetterParked, "")
		if errors.Is(err, errRequeued) {
			delete(q.quarantined, k)
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (q *bucketQ) isQuarantined(m *relay.Message) bool {
	if m.Key == nil {
		return false
	}
	_, ok := q.quarantined[string(m.Key)]
	return ok
}

// awaitQuarantined waits until the transactions of the messages of msgs
// whose key is quarantined are visible to new snapshots. A commit record
// is decoded a moment before its transaction becomes visible: a
// RequeueKey transaction, which emits a key's dead letters again and
// deletes them, would otherwise find its own dead letters still there
// and park the messages it requeued.
func (s *stream) awaitQuarantined(ctx context.Context, q *bucketQ, msgs []relay.Message) error {
	var ids map[int64]struct{}
	for i := range msgs {
		if q.isQuarantined(&msgs[i]) {
			if ids == nil {
				ids = map[int64]struct{}{}
			}
			ids[msgs[i].ID] = struct{}{}
		}
	}
	if ids == nil {
		return nil
	}
	var xids []uint32
	q.mu.Lock()
	for _, e := range q.q {
		if _, ok := ids[e.msg.ID]; ok && !slices.Contains(xids, e.xid) {
			xids = append(xids, e.xid)
		}
	}
	q.mu.Unlock()
	for _, xid := range xids {
		for {
			ok, err := s.visible(ctx, xid)
			if err != nil || ok {
				if err != nil {
					return err
				}
				break
			}
			if err := pause(ctx, headPoll); err != nil {
				return err
			}
		}
	}
	return nil
}

// hasDeadLetters reports whether key has rows in the dead-letter table
// dead, read through db.
func hasDeadLetters(db *gorm.DB, dead string, key []byte) (bool, error) {
	var n int64
	err := db.Raw("SELECT count(*) FROM (SELECT 1 FROM "+db.Statement.Quote(dead)+" WHERE msg_key = ? LIMIT 1) d", key).Scan(&n).Error
	return n > 0, err
}

// errRequeued reports that the key of messages to park has no dead
// letters left: a requeue took them.
var errRequeued = errors.New("pgwal: the key's dead letters were requeued")

// deadLetter writes msgs, messages of q of one key, to the dead-letter
// table in state, quarantines the key and takes them out of q. A replayed
// message already there is left as it is. Parking returns errRequeued,
// and writes nothing, when the key has no dead letter left (a requeue
// took them: see lockKey).
func (s *stream) deadLetter(ctx context.Context, q *bucketQ, msgs []relay.Message, state gormrelay.DeadLetterState, lastError string) error {
	now := time.Now().UnixMilli()
	rows := make([]outbox.DeadLetterRow, len(msgs))
	for i, m := range msgs {
		rows[i] = outbox.DeadLetterRow{ID: m.ID, MessageID: m.MessageID, Bucket: int32(m.Bucket), Topic: m.Topic, Key: m.Key, Value: m.Value,
			Headers: outbox.EncodeHeaders(m.Headers), Partition: m.Partition, CreatedAtMs: m.CreatedAt.UnixMilli(),
			Attempts: int32(m.Attempts), DeadAtMs: now, State: string(state)}
		if lastError != "" {
			le := lastError
			rows[i].LastError = &le
		}
	}
	db := s.r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	err := db.Transaction(func(tx *gorm.DB) error {
		if key := msgs[0].Key; key != nil {
			if err := lockKey(tx, s.r.dead, key); err != nil {
				return err
			}
			if state == gormrelay.DeadLetterParked {
				// Under the key's lock: a requeue that committed since
				// the key was found quarantined took its dead letters.
				if dead, err := hasDeadLetters(tx, s.r.dead, key); err != nil || !dead {
					return cmp.Or(err, errRequeued)
				}
			}
		}
		return tx.Table(s.r.dead).Clauses(clause.OnConflict{DoNothing: true}).Create(&rows).Error
	})
	if errors.Is(err, errRequeued) {
		return err
	}
	if err != nil {
		return fmt.Errorf("pgwal: write dead letters: %w", err)
	}
	for _, m := range msgs {
		if m.Key != nil {
			q.quarantined[string(m.Key)] = struct{}{}
		}
	}
	_, bridged := s.take(q, msgs)
	s.deleteBridged(ctx, bridged)
	s.r.deadLettered.Add(uint64(len(msgs)))
	s.r.log.Warn("pgwal: messages dead-lettered", "bucket", q.bucket, "count", len(msgs), "state", state, "err", lastError)
	return nil
}
