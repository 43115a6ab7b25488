package pgwal

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/backoff"
	"github.com/gorm-outbox/outbox/internal/walenv"
	"github.com/gorm-outbox/outbox/relay"
)

// entry is one decoded message waiting in its bucket's queue.
type entry struct {
	msg relay.Message
	// commit is the LSN of its transaction's commit record: confirming it
	// makes the server send the transaction again after a restart,
	// confirming past it does not.
	commit pglogrepl.LSN
	// attempts counts failed publishes that were not outages.
	attempts int
	// bridged marks a row of the messages table (Config.Bridge): msg
	// holds its id and bucket until loadBridged reads the row.
	bridged bool
	// xid is the transaction id of a bridged row's insert.
	xid uint32
}

// bucketQ is one bucket's messages in commit order.
type bucketQ struct {
	bucket int
	mu     sync.Mutex
	q      []entry
	wake   chan struct{}
	// quarantined holds the keys of this bucket with a dead letter: their
	// later messages are parked behind it.
	quarantined map[string]struct{}
}

// stream is one term of reading: the replication connection, the
// buckets' queues and the confirmed position.
type stream struct {
	r       *Reader
	conn    *pgconn.PgConn
	term    int64
	buckets []*bucketQ

	mu      sync.Mutex
	pending int
	drained chan struct{} // signalled when pending drops

	// Receiver state, touched by the receiving goroutine only.
	txn       []entry
	inTxn     bool
	txnCommit pglogrepl.LSN
	txnXid    uint32
	// done is the end of the last transaction handed to the queues, or
	// the server's WAL end while idle: everything before it is queued.
	done      pglogrepl.LSN
	confirmed pglogrepl.LSN
	// rel is the messages table in the stream when the reader bridges.
	rel bridgeRelation
}

func newStream(r *Reader, conn *pgconn.PgConn, term int64, start pglogrepl.LSN) *stream {
	s := &stream{r: r, conn: conn, term: term, done: start, confirmed: start, drained: make(chan struct{}, 1)}
	s.buckets = make([]*bucketQ, r.ocfg.BucketCount)
	for b := range s.buckets {
		s.buckets[b] = &bucketQ{bucket: b, wake: make(chan struct{}, 1), quarantined: map[string]struct{}{}}
	}
	return s
}

// loadQuarantine reads the keys that have dead letters: their messages
// stay parked behind them, as in table mode.
func (s *stream) loadQuarantine(ctx context.Context) error {
	var rows []struct {
		Bucket int
		MsgKey []byte
	}
	db := s.r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	if err := db.Raw("SELECT DISTINCT bucket, msg_key FROM " + db.Statement.Quote(s.r.dead) + " WHERE msg_key IS NOT NULL").Scan(&rows).Error; err != nil {
		return fmt.Errorf("pgwal: read quarantined keys: %w", err)
	}
	for _, r := range rows {
		if r.Bucket >= 0 && r.Bucket < len(s.buckets) {
			s.buckets[r.Bucket].quarantined[string(r.MsgKey)] = struct{}{}
		}
	}
	return nil
}

// position is the LSN safe to confirm: before the oldest message not yet
// published or dead-lettered, before the transaction being received, and
// otherwise everything received.
func (s *stream) position() pglogrepl.LSN {
	pos := s.done
	if s.inTxn && s.txnCommit < pos {
		pos = s.txnCommit
	}
	for _, q := range s.buckets {
		q.mu.Lock()
		if len(q.q) > 0 && q.q[0].commit < pos {
			pos = q.q[0].commit
		}
		q.mu.Unlock()
	}
	return max(pos, s.confirmed)
}

// renewal is the outcome of renewing the lease and recording pos in it.
type renewal struct {
	pos  pglogrepl.LSN
	ok   bool
	err  error
	halt error // the term must end (a table relay started while bridging)
}

// renew renews the lease and records the position safe to confirm, off
// the receiving goroutine: a commit takes a disk flush, and the stream
// would stand still meanwhile. The outcome arrives on the returned
// channel; confirm then sends the position to the server. A bridging
// reader first checks that no table relay started (checkTableRelays).
func (s *stream) renew(ctx context.Context) <-chan renewal {
	pos := s.position()
	ch := make(chan renewal, 1)
	go func() {
		if err := s.checkTableRelays(ctx); err != nil {
			ch <- renewal{halt: err}
			return
		}
		rctx, cancel := context.WithTimeout(ctx, s.r.cfg.LeaseDuration/3)
		ok, err := s.r.leases.renew(rctx, s.term, int64(pos))
		cancel()
		ch <- renewal{pos: pos, ok: ok, err: err}
	}()
	return ch
}

// confirm sends the position a renewal recorded in the lease to the
// server: the lease always records a position before the server has it.
func (s *stream) confirm(ctx context.Context, r renewal) error {
	if r.halt != nil {
		return r.halt
	}
	if r.err != nil {
		return fmt.Errorf("pgwal: renew lease: %w", r.err)
	}
	if !r.ok {
		return errLeaseLost
	}
	err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: r.pos, WALFlushPosition: r.pos, WALApplyPosition: r.pos, ClientTime: time.Now()})
	if err != nil {
		return fmt.Errorf("pgwal: send standby status: %w", err)
	}
	s.confirmed = r.pos
	s.r.confirmed.Store(uint64(r.pos))
	return nil
}

// renewPoll is how long the stream waits for a message at a time while a
// renewal runs, so that its position reaches the server soon after.
const renewPoll = 5 * time.Millisecond

// receive reads the replication stream until ctx ends or it fails.
func (s *stream) receive(ctx context.Context) error {
	next := time.Now().Add(s.r.cfg.StandbyInterval)
	rctx := deadlineCtx{parent: ctx}
	defer rctx.stop()
	var renewing <-chan renewal // non-nil while a renewal runs
	defer func() {
		if renewing != nil {
			<-renewing // bounded by its timeout
		}
	}()
	// progress is when to look whether messages were published since the
	// last renewal, which then renews early (ConfirmInterval).
	progress := time.Now().Add(s.r.cfg.ConfirmInterval)
	for {
		if now := time.Now(); renewing == nil {
			due := !now.Before(next)
			if !due && !now.Before(progress) {
				if due = s.position() > s.confirmed; !due {
					progress = now.Add(s.r.cfg.ConfirmInterval)
				}
			}
			if due {
				renewing = s.renew(ctx)
				next = now.Add(s.r.cfg.StandbyInterval)
				progress = now.Add(s.r.cfg.ConfirmInterval)
			}
		}
		if renewing != nil {
			select {
			case r := <-renewing:
				renewing = nil
				if err := s.confirm(ctx, r); err != nil {
					return err
				}
			default:
			}
		}
		until := next
		if progress.Before(until) {
			until = progress
		}
		if renewing != nil {
			until = time.Now().Add(renewPoll)
		}
		if s.full() {
			// Backpressure: stop reading, keep the lease and status going.
			t := time.NewTimer(time.Until(until))
			select {
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			case <-s.drained:
			case <-t.C:
			}
			t.Stop()
			continue
		}
		raw, err := s.conn.ReceiveMessage(rctx.until(until))
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("pgwal: receive: %w", err)
		}
		switch m := raw.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("pgwal: replication stream: %w", pgconn.ErrorResponseToPgError(m))
		case *pgproto3.CopyData:
			if len(m.Data) == 0 {
				continue
			}
			switch m.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(m.Data[1:])
				if err != nil {
					return fmt.Errorf("pgwal: keepalive: %w", err)
				}
				if !s.inTxn && ka.ServerWALEnd > s.done {
					s.done = ka.ServerWALEnd
				}
				if ka.ReplyRequested {
					next = time.Now()
				}
			case pglogrepl.XLogDataByteID:
				x, err := pglogrepl.ParseXLogData(m.Data[1:])
				if err != nil {
					return fmt.Errorf("pgwal: xlogdata: %w", err)
				}
				if err := s.decode(x.WALData); err != nil {
					return err
				}
			}
		}
	}
}

// deadlineCtx hands out a context of parent with a given deadline, the
// same one until the deadline moves: one context per received message
// would cost a timer each.
type deadlineCtx struct {
	parent   context.Context
	ctx      context.Context
	cancel   context.CancelFunc
	deadline time.Time
}

func (d *deadlineCtx) until(t time.Time) context.Context {
	if d.ctx == nil || !t.Equal(d.deadline) {
		d.stop()
		d.ctx, d.cancel = context.WithDeadline(d.parent, t)
		d.deadline = t
	}
	return d.ctx
}

func (d *deadlineCtx) stop() {
	if d.cancel != nil {
		d.cancel()
	}
}

func (s *stream) full() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending >= s.r.cfg.MaxPending
}

// decode handles one pgoutput message.
func (s *stream) decode(data []byte) error {
	msg, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("pgwal: parse pgoutput message: %w", err)
	}
	switch m := msg.(type) {
	case *pglogrepl.BeginMessage:
		s.inTxn, s.txnCommit, s.txnXid, s.txn = true, m.FinalLSN, m.Xid, s.txn[:0]
	case *pglogrepl.LogicalDecodingMessage:
		if !m.Transactional || m.Prefix != s.r.prefix {
			return nil
		}
		env, err := walenv.Decode(m.Content)
		if err != nil {
			return &relay.MisconfigurationError{Setting: "outbox.Config.Mode", Reason: fmt.Sprintf("message at %s with prefix %q: %v", m.LSN, m.Prefix, err), Err: err}
		}
		if env.Bucket >= len(s.buckets) {
			return &relay.MisconfigurationError{Setting: "BucketCount", Reason: fmt.Sprintf(
				"message %s at %s is in bucket %d, outside 0..%d: a writer uses a larger BucketCount; use one BucketCount everywhere", env.ID, m.LSN, env.Bucket, len(s.buckets)-1)}
		}
		hs, err := outbox.DecodeHeaders(env.Headers)
		if err != nil {
			return &relay.MisconfigurationError{Setting: "outbox.Config.Mode", Reason: fmt.Sprintf("message %s at %s: %v", env.ID, m.LSN, err), Err: err}
		}
		s.txn = append(s.txn, entry{commit: s.txnCommit, msg: relay.Message{
			// The negated LSN of the message's own record: unique, and
			// never a messages table id, so dead letters keep a unique id.
			ID: -int64(m.LSN), MessageID: env.ID, Bucket: env.Bucket, Topic: env.Topic, Key: env.Key, Value: env.Value,
			Headers: hs, Partition: env.Partition, CreatedAt: time.UnixMilli(env.CreatedAtMs)}})
		s.r.received.Add(1)
	case *pglogrepl.RelationMessage:
		s.decodeRelation(m)
	case *pglogrepl.InsertMessage:
		return s.decodeInsert(m)
	case *pglogrepl.CommitMessage:
		s.enqueue(s.txn)
		s.txn, s.inTxn, s.done = s.txn[:0], false, m.TransactionEndLSN
	}
	return nil
}

// enqueue hands a committed transaction's messages to their buckets.
func (s *stream) enqueue(es []entry) {
	if len(es) == 0 {
		return
	}
	s.mu.Lock()
	s.pending += len(es)
	s.mu.Unlock()
	for _, e := range es {
		q := s.buckets[e.msg.Bucket]
		q.mu.Lock()
		q.q = append(q.q, e)
		q.mu.Unlock()
		select {
		case q.wake <- struct{}{}:
		default:
		}
	}
}

// pop removes the first n entries of q.
func (s *stream) pop(q *bucketQ, n int) {
	if n == 0 {
		return
	}
	q.mu.Lock()
	q.q = q.q[n:]
	q.mu.Unlock()
	s.mu.Lock()
	s.pending -= n
	s.mu.Unlock()
	select {
	case s.drained <- struct{}{}:
	default:
	}
}

// batch copies up to limit leading entries of q.
func (q *bucketQ) batch(limit int) []entry {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]entry(nil), q.q[:min(limit, len(q.q))]...)
}

// publishLoop publishes q's messages in order until ctx ends. It returns
// an error only for what stops the reader.
func (s *stream) publishLoop(ctx context.Context, q *bucketQ) error {
	failures := 0
	limit := s.r.cfg.BatchSize
	for {
		es := q.batch(limit)
		if len(es) == 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-q.wake:
				continue
			}
		}
		// Rows of the messages table are read when they reach the head.
		es, ok, err := s.headRows(ctx, q, es, &failures)
		if err != nil || ctx.Err() != nil {
			return err
		}
		if !ok {
			continue
		}
		// Messages of a quarantined key go behind its dead letter.
		if n := s.leadingQuarantined(q, es); n > 0 {
			// A key whose dead letters were requeued (RequeueKey) flows
			// again.
			dead, err := s.hasDeadLetters(ctx, es[0].msg.Key)
			if err == nil && !dead {
				delete(q.quarantined, string(es[0].msg.Key))
				continue
			}
			if err == nil {
				err = s.deadLetter(ctx, q, es[:n], string(gormrelay.DeadLetterParked), "")
			}
			if errors.Is(err, errRequeued) {
				delete(q.quarantined, string(es[0].msg.Key))
				continue
			}
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				failures++
				s.r.log.Warn("pgwal: writing parked messages failed, retrying", "bucket", q.bucket, "err", err)
				if !backoff.Sleep(ctx, backoff.Exponential(s.r.cfg.BackoffMin, s.r.cfg.BackoffMax, failures)) {
					return nil
				}
			}
			continue
		}
		if n := s.firstQuarantined(q, es); n > 0 {
			es = es[:n]
		}
		msgs := make([]relay.Message, len(es))
		for i, e := range es {
			msgs[i] = e.msg
		}
		acked, err := s.r.pub.Publish(ctx, msgs)
		acked = max(0, min(acked, len(es)))
		s.deleteBridged(ctx, es[:acked])
		s.pop(q, acked)
		s.r.published.Add(uint64(acked))
		if err == nil {
			failures, limit = 0, s.r.cfg.BatchSize
			continue
		}
		if ctx.Err() != nil {
			return nil
		}
		if relay.IsMisconfiguration(err) {
			return err
		}
		failed := acked
		if i, ok := relay.FailedIndex(err); ok && i > acked && i < len(es) {
			// A transactional publisher acknowledged nothing: publish the
			// messages before the culprit on their own first.
			limit = i - acked
			continue
		}
		if relay.IsBatchRejected(err) && len(es)-acked > 1 {
			limit = max(1, (len(es)-acked)/2)
			continue
		}
		culprit := es[failed]
		unavailable := relay.IsUnavailable(err) || relay.IsFenced(err)
		if !unavailable {
			q.mu.Lock()
			if len(q.q) > 0 {
				q.q[0].attempts++
				culprit.attempts = q.q[0].attempts
			}
			q.mu.Unlock()
		}
		if !unavailable && (relay.IsPermanent(err) || culprit.attempts >= s.r.cfg.MaxAttempts) {
			if err := s.deadLetter(ctx, q, []entry{culprit}, string(gormrelay.DeadLetterFailed), err.Error()); err != nil && ctx.Err() == nil {
				s.r.log.Warn("pgwal: writing a dead letter failed, retrying", "bucket", q.bucket, "err", err)
			} else {
				failures, limit = 0, s.r.cfg.BatchSize
				continue
			}
		}
		failures++
		d := backoff.Exponential(s.r.cfg.BackoffMin, s.r.cfg.BackoffMax, failures)
		s.r.log.Warn("pgwal: publish failed, retrying", "bucket", q.bucket, "err", err, "unavailable", unavailable, "retry_in", d)
		if !backoff.Sleep(ctx, d) {
			return nil
		}
	}
}

func (q *bucketQ) isQuarantined(m *relay.Message) bool {
	if m.Key == nil {
		return false
	}
	_, ok := q.quarantined[string(m.Key)]
	return ok
}

// leadingQuarantined counts the leading entries of es of the first
// one's key when that key is quarantined.
func (s *stream) leadingQuarantined(q *bucketQ, es []entry) int {
	if !q.isQuarantined(&es[0].msg) {
		return 0
	}
	n := 1
	for n < len(es) && es[n].msg.Key != nil && string(es[n].msg.Key) == string(es[0].msg.Key) {
		n++
	}
	return n
}

// hasDeadLetters reports whether key has rows in the dead-letter table.
func (s *stream) hasDeadLetters(ctx context.Context, key []byte) (bool, error) {
	var n int64
	db := s.r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	err := db.Raw("SELECT count(*) FROM (SELECT 1 FROM "+db.Statement.Quote(s.r.dead)+" WHERE msg_key = ? LIMIT 1) d", key).Scan(&n).Error
	return n > 0, err
}

// firstQuarantined returns the index of the first entry of es whose key
// is quarantined, 0 for none.
func (s *stream) firstQuarantined(q *bucketQ, es []entry) int {
	for i := range es {
		if q.isQuarantined(&es[i].msg) {
			return i
		}
	}
	return 0
}

// errRequeued reports that the key of messages to park has no dead
// letters left: a requeue took them.
var errRequeued = errors.New("pgwal: the key's dead letters were requeued")

// deadLetter writes es, the leading entries of q (of one key when state
// is parked), to the dead-letter table in state, quarantines their keys
// and removes them from q. A replayed message already there is left as
// it is. Parking returns errRequeued, and writes nothing, when the key
// has no dead letter left.
func (s *stream) deadLetter(ctx context.Context, q *bucketQ, es []entry, state, lastError string) error {
	now := time.Now().UnixMilli()
	rows := make([]outbox.DeadLetterRow, len(es))
	for i, e := range es {
		m := e.msg
		rows[i] = outbox.DeadLetterRow{ID: m.ID, MessageID: m.MessageID, Bucket: int32(m.Bucket), Topic: m.Topic, Key: m.Key, Value: m.Value,
			Headers: outbox.EncodeHeaders(m.Headers), Partition: m.Partition, CreatedAtMs: m.CreatedAt.UnixMilli(),
			Attempts: int32(e.attempts), DeadAtMs: now, State: state}
		if lastError != "" {
			le := lastError
			rows[i].LastError = &le
		}
	}
	db := s.r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	err := db.Transaction(func(tx *gorm.DB) error {
		if key := es[0].msg.Key; key != nil {
			if err := lockKey(tx, s.r.dead, key); err != nil {
				return err
			}
			if state == string(gormrelay.DeadLetterParked) {
				// Under the key's lock: a requeue that committed since
				// the key was found quarantined took its dead letters.
				var n int64
				if err := tx.Raw("SELECT count(*) FROM (SELECT 1 FROM "+tx.Statement.Quote(s.r.dead)+" WHERE msg_key = ? LIMIT 1) d", key).Scan(&n).Error; err != nil {
					return err
				}
				if n == 0 {
					return errRequeued
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
	s.deleteBridged(ctx, es)
	for _, e := range es {
		if e.msg.Key != nil {
			q.quarantined[string(e.msg.Key)] = struct{}{}
		}
	}
	s.pop(q, len(es))
	s.r.deadLettered.Add(uint64(len(es)))
	s.r.log.Warn("pgwal: messages dead-lettered", "bucket", q.bucket, "count", len(es), "state", state, "err", lastError)
	return nil
}
