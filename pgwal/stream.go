package pgwal

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
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
	// xid is the id of the message's transaction (of a bridged row's
	// insert).
	xid uint32
}

// bucketQ is one bucket's messages in commit order.
type bucketQ struct {
	bucket int
	mu     sync.Mutex
	q      []entry
	// quarantined holds the keys of this bucket with a dead letter: their
	// later messages are parked behind it.
	quarantined map[string]struct{}
	// held is Kafka's record of the bucket's last committed batch while
	// the replay is not decided (reconcile.go): the bucket's replayed
	// messages are set aside meanwhile (setAside of them, the last ones in
	// aside, a ring whose oldest is at asideAt once full, the first
	// committed at floor), not queued.
	held     *relay.Committed
	aside    []relay.Message
	asideAt  int
	setAside int
	floor    pglogrepl.LSN
}

// stream is one term of reading: the replication connection, the
// buckets' queues and the confirmed position.
type stream struct {
	r       *Reader
	conn    *pgconn.PgConn
	term    int64
	buckets []*bucketQ

	// hints wake the relay engine for the buckets that received
	// messages.
	hints *hints

	mu      sync.Mutex
	pending int
	drained chan struct{} // signalled when pending drops
	// heldUntil is when the slot's lease, last renewed, runs out; ended
	// says the stream stopped reading. Either ends the term's leases of
	// the buckets (source.guard).
	heldUntil time.Time
	ended     bool

	// Receiver state, touched by the receiving goroutine only.
	txn       []entry
	inTxn     bool
	txnCommit pglogrepl.LSN
	txnXid    uint32
	// done is the end of the last transaction handed to the queues, or
	// the server's WAL end while idle: everything before it is queued.
	done      pglogrepl.LSN
	confirmed pglogrepl.LSN
	// backlogEnd is the server's WAL end when the term began: once done
	// reaches it, queues that are empty hold everything pending.
	backlogEnd pglogrepl.LSN
	// caughtUp is set once done reached backlogEnd (seen by lag, on the
	// receiving goroutine): the backlog sampler may then tell empty queues
	// from WAL not read yet.
	caughtUp atomic.Bool
	// rel is the messages table in the stream when the reader bridges.
	rel bridgeRelation
	// touched is enqueue's list of the buckets a transaction filled.
	touched []int
	// start is where the term reads from, walEnd the server's WAL end
	// once the publisher fenced the previous owners, holding the count of
	// held buckets, restart set when the term must end to read set-aside
	// messages again, the first of them committed at keepFrom
	// (reconcile.go).
	start, walEnd, keepFrom pglogrepl.LSN
	holding                 int
	restart                 error
}

// newStream returns the stream of term, whose lease was last renewed by
// a call that started at renewed.
func newStream(r *Reader, conn *pgconn.PgConn, term int64, start pglogrepl.LSN, renewed time.Time) *stream {
	s := &stream{r: r, conn: conn, term: term, done: start, confirmed: start, drained: make(chan struct{}, 1),
		hints: newHints(r.ocfg.BucketCount), heldUntil: renewed.Add(r.cfg.LeaseDuration)}
	s.buckets = make([]*bucketQ, r.ocfg.BucketCount)
	for b := range s.buckets {
		s.buckets[b] = &bucketQ{bucket: b, quarantined: map[string]struct{}{}}
	}
	return s
}

// holds reports whether the stream still reads under the slot's lease.
func (s *stream) holds() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.ended && time.Now().Before(s.heldUntil)
}

// end marks the stream as no longer reading: its term's leases of the
// buckets end.
func (s *stream) end() {
	s.mu.Lock()
	s.ended = true
	s.mu.Unlock()
}

// extend records a renewal of the slot's lease that started at renewed.
func (s *stream) extend(renewed time.Time) {
	s.mu.Lock()
	if t := renewed.Add(s.r.cfg.LeaseDuration); t.After(s.heldUntil) {
		s.heldUntil = t
	}
	s.mu.Unlock()
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
		if q.setAside > 0 && q.floor < pos {
			pos = q.floor // set aside while its record is undecided
		}
		q.mu.Unlock()
	}
	if s.restart != nil && s.keepFrom < pos {
		pos = s.keepFrom // set aside for a record that is not this outbox's
	}
	return max(pos, s.confirmed)
}

// lag samples the reader's lag in time for the lease row: the creation
// time of the oldest message the queues hold, or none held once the
// stream read the WAL written before the term began; unknown before.
func (s *stream) lag() lagSample {
	now := time.Now().UnixMilli()
	if s.done >= s.backlogEnd {
		s.caughtUp.Store(true)
	}
	if oldest, bucket, ok := s.oldest(); ok {
		return lagSample{oldestMs: max(oldest.UnixMilli(), 1), atMs: now, bucket: bucket}
	}
	if s.done < s.backlogEnd {
		return lagSample{}
	}
	return lagSample{atMs: now}
}

// renewal is the outcome of renewing the lease and recording pos in it.
type renewal struct {
	pos     pglogrepl.LSN
	started time.Time
	ok      bool
	err     error
	halt    error // the term must end (a table relay started while bridging)
}

// renew renews the lease and records the position safe to confirm, off
// the receiving goroutine: a commit takes a disk flush, and the stream
// would stand still meanwhile. The outcome arrives on the returned
// channel; confirm then sends the position to the server. A bridging
// reader first checks that no table relay started (checkTableRelays).
func (s *stream) renew(ctx context.Context) <-chan renewal {
	pos, lag := s.position(), s.lag()
	ch := make(chan renewal, 1)
	go func() {
		if err := s.checkTableRelays(ctx); err != nil {
			ch <- renewal{halt: err}
			return
		}
		started := time.Now()
		rctx, cancel := context.WithTimeout(ctx, s.r.cfg.LeaseDuration/3)
		ok, err := s.r.leases.renew(rctx, s.term, int64(pos), lag)
		cancel()
		ch <- renewal{pos: pos, started: started, ok: ok, err: err}
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
	s.extend(r.started)
	err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: r.pos, WALFlushPosition: r.pos, WALApplyPosition: r.pos, ClientTime: time.Now()})
	if err != nil {
		return fmt.Errorf("pgwal: send standby status: %w", err)
	}
	s.confirmed = r.pos
	s.r.confirmed.Store(uint64(r.pos))
	return nil
}

// confirmLast records and confirms, once the reader is told to stop, the
// position its publishes reached since the last renewal, so that the
// next reader does not publish those messages again. It runs after the
// stream stopped receiving and the engine stopped, on the term's
// connection, bounded by StandbyInterval; if the lease is no longer held
// or the renewal fails, nothing is confirmed and the next reader
// publishes them again, as it would have.
func (s *stream) confirmLast(ctx context.Context) {
	if s.position() <= s.confirmed {
		return
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.r.cfg.StandbyInterval)
	defer cancel()
	if err := s.confirm(fctx, <-s.renew(fctx)); err != nil {
		s.r.log.Debug("pgwal: confirming the position published when stopped failed; the next reader publishes those messages again", "err", err)
	}
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
					if err := s.settle(); err != nil {
						return err
					}
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
		s.txn = append(s.txn, entry{commit: s.txnCommit, xid: s.txnXid, msg: relay.Message{
			// The negated LSN of the message's own record: unique, and
			// never a messages table id, so dead letters keep a unique id.
			ID: -int64(m.LSN), Position: uint64(s.txnCommit), MessageID: env.ID, Bucket: env.Bucket, Topic: env.Topic, Key: env.Key, Value: env.Value,
			Headers: hs, Partition: env.Partition, CreatedAt: time.UnixMilli(env.CreatedAtMs)}})
		s.r.received.Add(1)
	case *pglogrepl.RelationMessage:
		s.decodeRelation(m)
	case *pglogrepl.InsertMessage:
		return s.decodeInsert(m)
	case *pglogrepl.CommitMessage:
		s.enqueue(s.txn)
		s.txn, s.inTxn, s.done = s.txn[:0], false, m.TransactionEndLSN
		return s.settle()
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
	// Each run of messages of one bucket is appended under one lock, and
	// the engine is woken once for the transaction, after its messages
	// are queued.
	s.touched = s.touched[:0]
	aside := 0
	for i := 0; i < len(es); {
		b := es[i].msg.Bucket
		j := i + 1
		for j < len(es) && es[j].msg.Bucket == b {
			j++
		}
		q := s.buckets[b]
		run := es[i:j]
		if s.holding > 0 && q.isHeld() {
			// Replayed messages of a held bucket are set aside until its
			// record is decided (reconcile.go).
			run = s.replayHeld(q, run)
			aside += j - i - len(run)
		}
		q.mu.Lock()
		q.q = append(q.q, run...)
		q.mu.Unlock()
		s.touched = append(s.touched, b)
		i = j
	}
	s.removed(aside)
	s.hints.add(s.touched...)
}

// head returns the messages of up to limit leading entries of q, with
// their failed attempts counted, or ok false when one of them is a
// bridged row, which NextBatch reads from the messages table first.
func (q *bucketQ) head(limit int) (msgs []relay.Message, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	es := q.q[:min(limit, len(q.q))]
	for i := range es {
		if es[i].bridged {
			return nil, false
		}
	}
	msgs = make([]relay.Message, len(es))
	for i := range es {
		msgs[i] = es[i].msg
		msgs[i].Attempts += es[i].attempts
	}
	return msgs, true
}

// batch copies up to limit leading entries of q.
func (q *bucketQ) batch(limit int) []entry {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]entry(nil), q.q[:min(limit, len(q.q))]...)
}
