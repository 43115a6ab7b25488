package pgwal

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/backoff"
	"github.com/gorm-outbox/outbox/internal/gormlog"
	"github.com/gorm-outbox/outbox/relay"
)

// Reader relays the messages an outbox in WAL mode (outbox.ModeWAL)
// writes: it reads them from a logical replication slot in commit order
// and publishes them through a relay.Publisher with the relay engine
// (package relay), per bucket in order and buckets in parallel, with
// table mode's retries and failure policy. One reader per slot reads at
// a time, elected by a lease; the others wait and take over when its
// lease lapses.
type Reader struct {
	db     *gorm.DB
	ocfg   outbox.Config
	cfg    Config
	pub    relay.Publisher
	owned  relay.PublisherService // NewKafka's publisher, started and stopped by Run
	log    *slog.Logger
	leases leases
	dead   string
	prefix string

	received, published, deadLettered atomic.Uint64
	confirmed, reconciled             atomic.Uint64

	// notOurs holds the records of Kafka that a term found not to be
	// this outbox's (reconcile.go); read and written by Run's goroutine.
	notOurs map[recordKey]struct{}

	// cur is the stream of the term being read; nil between terms.
	cur atomic.Pointer[stream]
	// done is closed when Run first returns, with its error in runErr.
	done     chan struct{}
	doneOnce sync.Once
	runErr   error
}

// Stats counts what a Reader did since it was made.
type Stats struct {
	// Received counts the outbox messages decoded from the slot,
	// replays included.
	Received uint64
	// Published counts the messages the publisher acknowledged.
	Published uint64
	// DeadLettered counts the messages written to the dead-letter table,
	// failed and parked.
	DeadLettered uint64
	// Confirmed is the last position confirmed to the server.
	Confirmed pglogrepl.LSN
	// Reconciled counts the replayed messages a strict-mode reader did
	// not publish because Kafka already held them: an earlier reading
	// term published them and did not confirm their position.
	Reconciled uint64
}

// New returns a reader of the outbox of plugin, which must be in
// outbox.ModeWAL, on db, publishing to pub (started by the caller). It
// starts nothing: Run reads. The outbox tables (plugin.AutoMigrate) hold
// the dead letters; Run creates the lease table.
func New(db *gorm.DB, plugin *outbox.Plugin, pub relay.Publisher, cfg Config) (*Reader, error) {
	if plugin == nil || pub == nil || db == nil {
		return nil, &relay.ConfigError{Package: "pgwal", Field: "New", Reason: "db, plugin and pub are required"}
	}
	ocfg := plugin.Config()
	if ocfg.Mode != outbox.ModeWAL {
		return nil, &relay.ConfigError{Package: "pgwal", Field: "outbox.Config.Mode", Value: ocfg.Mode, Reason: "the outbox must be in ModeWAL"}
	}
	cfg = cfg.withDefaults(ocfg)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	db = gormlog.Session(db) // the reader's statements log only when they fail
	r := &Reader{db: db, ocfg: ocfg, cfg: cfg, pub: pub, log: cfg.Logger.With("outbox", ocfg.Name, "slot", cfg.Slot),
		dead: ocfg.Tables.DeadLettersTable(), prefix: ocfg.WALPrefix(), done: make(chan struct{}), notOurs: map[recordKey]struct{}{}}
	r.leases = leases{db: db, table: cfg.LeaseTable, slot: cfg.Slot, me: cfg.RelayID, dur: cfg.LeaseDuration}
	return r, nil
}

// Config returns the configuration with defaults filled in.
func (r *Reader) Config() Config { return r.cfg }

// Stats returns the reader's counters.
func (r *Reader) Stats() Stats {
	return Stats{Received: r.received.Load(), Published: r.published.Load(), DeadLettered: r.deadLettered.Load(),
		Confirmed: pglogrepl.LSN(r.confirmed.Load()), Reconciled: r.reconciled.Load()}
}

// SlotStatus reads the slot's status: its confirmed position and the WAL
// it retains.
func (r *Reader) SlotStatus(ctx context.Context) (SlotStatus, error) {
	return ReadSlotStatus(ctx, r.db, r.cfg.Slot)
}

// Stopped is closed when Run has returned (the first time it is
// called). With Err it makes the reader an opshttp.Stopper, so a health
// check reports a reader stopped on an error at once.
func (r *Reader) Stopped() <-chan struct{} { return r.done }

// Err is the error Run returned; nil while it runs or after it returned
// nil (its context ended).
func (r *Reader) Err() error {
	select {
	case <-r.done:
		return r.runErr
	default:
		return nil
	}
}

// OldestUnpublished returns the creation time (the writer's clock) of the
// oldest message this reader decoded and has not yet published or
// dead-lettered; ok is false when it holds none or is not reading.
func (r *Reader) OldestUnpublished() (oldest time.Time, ok bool) {
	oldest, _, ok = r.oldest()
	return oldest, ok
}

// oldest returns the creation time of the oldest message held in the
// current term's queues, and its bucket.
func (r *Reader) oldest() (oldest time.Time, bucket int, ok bool) {
	s := r.cur.Load()
	if s == nil {
		return time.Time{}, 0, false
	}
	return s.oldest()
}

// oldest returns the creation time of the oldest message held in the
// stream's queues, and its bucket.
func (s *stream) oldest() (oldest time.Time, bucket int, ok bool) {
	for _, q := range s.buckets {
		q.mu.Lock()
		if len(q.q) > 0 && (!ok || q.q[0].msg.CreatedAt.Before(oldest)) {
			oldest, bucket, ok = q.q[0].msg.CreatedAt, q.bucket, true
		}
		q.mu.Unlock()
	}
	return oldest, bucket, ok
}

// errLeaseLost ends one term of reading.
var errLeaseLost = errors.New("pgwal: lease lost")

// Run elects this reader (waiting while another holds the slot), reads
// the slot and publishes until ctx ends, then returns nil. It returns an
// error for what retrying cannot fix: a *SlotLostError, a
// *SlotForeignError (the slot's name is another database's slot), a
// *relay.MisconfigurationError from the publisher, a bucket beyond the
// outbox's BucketCount. Connection failures are retried with backoff,
// cut short when the database answers again (probed every BackoffMin,
// at least ProbeIntervalMin apart).
// Ending ctx stops reading and publishing: the position the acknowledged
// publishes reached is recorded and confirmed (bounded by
// StandbyInterval), and the messages in flight, given to the publisher
// and not acknowledged, are abandoned: the next reader publishes them
// again. A reader made by NewKafka or
// NewKafkaTransactional starts its publisher first (its error is
// returned at once) and stops it before returning; once it closed, Run
// releases the lease, so another reader takes over at once. With a
// publisher of the caller's (New) the lease is not released: that
// publisher may still deliver what it was given after Run returned, and
// another reader takes over once the lease lapses (LeaseDuration).
func (r *Reader) Run(ctx context.Context) (err error) {
	defer r.doneOnce.Do(func() { r.runErr = err; close(r.done) })
	stopOwned, err := r.startOwned(ctx)
	if err != nil {
		return err
	}
	var held int64 // the term held when ctx ended
	defer func() { r.releaseAfterStop(ctx, held, stopOwned()) }()
	if err := r.prepare(ctx); err != nil || ctx.Err() != nil {
		return err
	}
	failures := 0
	var w waiter
	var waitingFor SlotLease // the holder last logged while waiting
	for {
		term, ok, err := r.acquire(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err == nil && !ok {
			r.logWaiting(ctx, &waitingFor)
		} else {
			waitingFor = SlotLease{}
		}
		if err == nil && ok {
			began := time.Now()
			err = r.term(ctx, term)
			if ctx.Err() != nil {
				held = term
				return nil
			}
			var lost *SlotLostError
			if errors.As(err, &lost) || errors.Is(err, ErrSlotForeign) || relay.IsMisconfiguration(err) {
				r.log.Error("pgwal: reader stopped", "err", err)
				return err
			}
			if time.Since(began) > r.cfg.BackoffMax {
				failures = 0
				w = waiter{}
			}
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.StandbyInterval)
			_ = r.leases.release(rctx, term)
			cancel()
		}
		if err == nil {
			if !backoff.Sleep(ctx, r.cfg.StandbyInterval) {
				return nil
			}
			continue
		}
		failures++
		r.log.Warn("pgwal: reading the slot failed, retrying", "err", err, "attempt", failures)
		if !r.pause(ctx, &w, backoff.Exponential(r.cfg.BackoffMin, r.cfg.BackoffMax, failures), outage(err)) {
			return nil
		}
	}
}

// acquire takes the slot's lease (leases.acquire). A bridging reader
// first checks that no table-mode relay runs, and while one does fails
// with ErrTableRelaysRunning without taking the lease: it would only
// fail its term (bridgeOID), one lease term per retry.
func (r *Reader) acquire(ctx context.Context) (term int64, ok bool, err error) {
	if r.cfg.Bridge {
		if stopped, err := r.TableRelaysStopped(ctx); err != nil || !stopped {
			return 0, false, errors.Join(ErrTableRelaysRunning, err)
		}
	}
	return r.leases.acquire(ctx)
}

// logWaiting logs, once per holder and term, that the reader waits for
// the slot's lease another reader holds: who, and until when unless
// renewed. last is the holder logged before.
func (r *Reader) logWaiting(ctx context.Context, last *SlotLease) {
	l, ok, err := r.leases.holder(ctx)
	if err != nil || !ok || l.Owner == nil {
		return
	}
	if last.Owner != nil && *last.Owner == *l.Owner && last.Term == l.Term {
		return
	}
	*last = l
	r.log.Info("pgwal: waiting for the slot's lease, held by another reader", "holder", *l.Owner, "term", l.Term,
		"expires_at", time.UnixMilli(l.ExpiresAtMs).UTC().Format(time.RFC3339Nano), "check_every", r.cfg.StandbyInterval)
}

// waiter is what pause remembers of an outage across the attempts of a
// retry loop.
type waiter struct {
	since time.Time // the first failure of the outage; zero when none
	early bool      // the last pause ended early: the database answered
}

// pause waits d, the backoff after a failed attempt, and reports whether
// ctx is still alive. After a failure to reach the database (down the
// database is true: the server is down, restarting, refusing
// connections), it asks every max(BackoffMin, ProbeIntervalMin) whether
// the database answers again (answers) and returns as soon as it does, so that a reader is
// not left asleep for up to BackoffMax once a restarted server accepts
// connections; the pause never lasts longer than d. The database must be
// seen down before an answer ends the pause: the failed attempt counts,
// unless the previous pause already ended early, when one of this
// pause's probes must fail first; so a failure that the probe does not
// see (the database answers, the attempt fails anyway) is retried at the
// plain backoff, not every BackoffMin. Other failures wait d. The probes
// log nothing; the end of an outage is logged once.
func (r *Reader) pause(ctx context.Context, w *waiter, d time.Duration, down bool) bool {
	if !down {
		*w = waiter{}
		return backoff.Sleep(ctx, d)
	}
	now := time.Now()
	if w.since.IsZero() {
		w.since = now
	}
	seenDown := !w.early
	w.early = false
	deadline := now.Add(d)
	every := max(r.cfg.BackoffMin, ProbeIntervalMin)
	for {
		left := time.Until(deadline)
		if !backoff.Sleep(ctx, min(every, left)) {
			return false
		}
		if left = time.Until(deadline); left <= 0 {
			return true
		}
		pctx, cancel := context.WithTimeout(ctx, left)
		err := r.answers(pctx)
		cancel()
		if ctx.Err() != nil {
			return false
		}
		if err == nil && seenDown {
			r.log.Info("pgwal: the database answers again; retrying now",
				"down_for", time.Since(w.since).Round(time.Millisecond), "backoff_left", time.Until(deadline).Round(time.Millisecond))
			w.early = true
			return true
		}
		if err != nil && unreachable(err) {
			seenDown = true
		}
	}
}

// errInRecovery is a probe's answer from a server that accepts
// connections but is in recovery (a standby), which the reader cannot
// hold its lease on.
var errInRecovery = errors.New("pgwal: the database is in recovery")

// answers checks that the database accepts what the reader's next
// attempt needs: a session on the reader's database, not in recovery,
// and a replication connection. Its statements log nothing: while the
// server is down each fails.
func (r *Reader) answers(ctx context.Context) error {
	db := r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true, Logger: logger.Discard})
	var inRecovery bool
	if err := db.Raw("SELECT pg_is_in_recovery()").Scan(&inRecovery).Error; err != nil {
		return err
	}
	if inRecovery {
		return errInRecovery
	}
	conn, err := r.connect(ctx)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// outage reports whether a term ended because the database could not be
// reached (unreachable), which answers can tell has ended; the brokers'
// network errors (a *publisherError) are not.
func outage(err error) bool {
	var pe *publisherError
	return unreachable(err) && !errors.As(err, &pe)
}

// publisherError is the publisher's failure to take a term's leases
// (relay.LeaseAware): a strict-mode publisher fences the previous
// owners on the brokers.
type publisherError struct{ err error }

func (e *publisherError) Error() string { return "pgwal: publisher: " + e.err.Error() }

func (e *publisherError) Unwrap() error { return e.err }

// prepare creates the lease table and the publication, retrying with
// backoff while the database cannot be reached (down, restarting, the
// session ended) until ctx ends, and a few times when another reader
// created them at the same moment; other errors are returned.
func (r *Reader) prepare(ctx context.Context) error {
	races := 0
	var w waiter
	for failures := 1; ; failures++ {
		err := r.leases.migrate(ctx)
		if err != nil {
			err = fmt.Errorf("pgwal: create lease table %s: %w", r.cfg.LeaseTable, err)
		} else {
			err = r.ensurePublication(ctx)
		}
		if err == nil || ctx.Err() != nil {
			return nil
		}
		if createRace(err) && races < 5 {
			// The next attempt finds the winner's objects.
			races++
		} else if !unreachable(err) {
			return err
		}
		r.log.Warn("pgwal: the database cannot be reached, retrying", "err", err, "attempt", failures)
		if !r.pause(ctx, &w, backoff.Exponential(r.cfg.BackoffMin, r.cfg.BackoffMax, failures), unreachable(err)) {
			return nil
		}
	}
}

// unreachable reports whether err says the database could not be
// reached or ended the session (connection errors, SQLSTATE classes 08
// and 57P, too many connections), which retrying can fix, as opposed to
// what it cannot (a missing privilege, a bad table name).
func unreachable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "57P") || pe.Code == "53300"
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	return errors.As(err, &ce) || errors.As(err, &ne) || errors.Is(err, driver.ErrBadConn) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || pgconn.Timeout(err)
}

// createRace reports whether err is what PostgreSQL answers a CREATE
// that raced with the same CREATE in another session: the object, or
// its row type in the catalog, already exists.
func createRace(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "42P07" || pe.Code == "42710" || pe.Code == "23505")
}

func (r *Reader) ensurePublication(ctx context.Context) error {
	if err := ensurePublication(ctx, r.db, r.cfg.Slot); err != nil {
		return err
	}
	return r.prepareSlot(ctx)
}

// ensurePublication creates the (empty) publication named slot when it
// is missing.
func ensurePublication(ctx context.Context, gdb *gorm.DB, slot string) error {
	db := gdb.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	var n int64
	if err := db.Raw("SELECT count(*) FROM pg_publication WHERE pubname = ?", slot).Scan(&n).Error; err != nil {
		return fmt.Errorf("pgwal: read publications: %w", err)
	}
	if n > 0 {
		return nil
	}
	// An empty publication: pgoutput needs one, and it decodes no row
	// change, only the logical decoding messages.
	err := db.Exec("CREATE PUBLICATION " + slot).Error
	if err != nil && !isDuplicate(err) {
		return fmt.Errorf("pgwal: create publication %s: %w", slot, err)
	}
	return nil
}

func isDuplicate(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "42710"
}

// term reads the slot for as long as this reader holds the lease under
// term.
func (r *Reader) term(ctx context.Context, term int64) error {
	// The slot, then the lease row (slotAndRow): the row as acquire saw it
	// may be stale, when this reader stalled since (a process stopped, a
	// starved machine) and another took the lease over and confirmed
	// further; checked against it, that reader's progress would look like
	// a re-created slot.
	st, row, err := r.leases.slotAndRow(ctx)
	if err != nil {
		return err
	}
	if !r.leases.holds(row, term) {
		return errLeaseLost
	}
	recorded := pglogrepl.LSN(row.ConfirmedLSN)
	exists, err := checkSlot(st, r.cfg.Slot, recorded)
	if err != nil {
		return err
	}
	conn, err := r.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if !exists {
		if st.Confirmed, err = r.createSlot(ctx, conn); err != nil {
			return err
		}
	}
	// Start from the position the lease row recorded when the slot's is
	// behind it: a crash of the server (an immediate shutdown) takes the
	// slot's confirmed position back to the last checkpoint, and
	// everything published since would be published again. The recorded
	// position was safe to confirm (it is recorded before it is sent);
	// checkSlot refused a slot whose position is beyond it.
	from := max(st.Confirmed, recorded)
	// Record where reading starts before anything is confirmed, so a slot
	// dropped from now on is noticed.
	renewed := time.Now()
	if ok, err := r.leases.renew(ctx, term, int64(from), lagSample{}); err != nil || !ok {
		return errors.Join(errLeaseLost, err)
	}
	err = pglogrepl.StartReplication(ctx, conn, r.cfg.Slot, from, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + r.cfg.Slot + "'", "messages 'true'"},
	})
	if err != nil {
		return fmt.Errorf("pgwal: start replication from slot %s: %w", r.cfg.Slot, err)
	}

	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	s := newStream(r, conn, term, from, renewed)
	// The WAL written before the term began: until it is read, an empty
	// queue does not mean nothing is pending.
	s.backlogEnd = st.Confirmed + pglogrepl.LSN(max(st.RetainedBytes, 0))
	defer s.end()
	if s.rel.oid, err = r.bridgeOID(ctx); err != nil {
		return err
	}
	if err := s.loadQuarantine(ctx); err != nil {
		return err
	}
	r.cur.Store(s)
	defer r.cur.Store(nil)
	leases := make([]relay.Lease, r.ocfg.BucketCount)
	for b := range s.buckets {
		leases[b] = relay.Lease{Bucket: b, Term: term}
	}
	if la, ok := r.pub.(relay.LeaseAware); ok {
		records, err := r.announce(sctx, la, term, from, leases)
		if err != nil {
			la.LeasesReleased(context.WithoutCancel(ctx), leases)
			if errors.Is(err, errLeaseLost) {
				return err
			}
			return &publisherError{err}
		}
		defer la.LeasesReleased(context.WithoutCancel(ctx), leases)
		if records != nil {
			// Read after the previous owners were fenced: every batch
			// they committed lies before this position.
			walEnd, err := r.walEnd(ctx)
			if err != nil {
				return err
			}
			s.holdReplays(records, from, walEnd)
		}
	}
	var pub relay.Publisher = publisherOnly{r.pub}
	if rc, ok := r.pub.(relay.Reconciler); ok {
		pub = reconcilingPublisher{publisherOnly{r.pub}, rc}
	}
	eng, err := relay.New(source{s}, pub, r.engineConfig(s))
	if err != nil {
		return err
	}
	if err := eng.Start(sctx); err != nil {
		return err
	}
	// Logged once the term reads: a term that fails before (a bridging
	// reader while table relays run, a publisher's fence) logs only its
	// failure.
	r.log.Info("pgwal: reading the slot", "term", term, "from", from, "slot_confirmed", st.Confirmed, "recorded", recorded)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		select {
		case <-eng.Stopped():
			// The engine stops on its own only on a misconfiguration.
			cancel(eng.Err())
		case <-sctx.Done():
		}
	}()
	err = s.receive(sctx)
	// The buckets' leases end with the stream, before the engine's
	// publishes are cancelled: nothing more leaves the queues.
	s.end()
	cancel(err)
	<-eng.Stopped()
	<-stopped
	if ctx.Err() != nil {
		s.confirmLast(ctx)
	}
	if err := eng.Err(); err != nil {
		return err
	}
	if cause := context.Cause(sctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return cause
	}
	return err
}

// engineConfig is the relay engine's configuration for the term of s:
// the Config fields that configure publishing, its failure policy, and
// the stream's hints.
func (r *Reader) engineConfig(s *stream) relay.Config {
	return relay.Config{
		RelayID:            r.cfg.RelayID,
		BucketCount:        r.ocfg.BucketCount,
		BatchSize:          r.cfg.BatchSize,
		Parallelism:        r.cfg.Parallelism,
		PollInterval:       r.cfg.StandbyInterval,
		LeaseDuration:      r.cfg.LeaseDuration,
		LeaseRenewInterval: r.cfg.StandbyInterval,
		BackoffMin:         r.cfg.BackoffMin,
		BackoffMax:         r.cfg.BackoffMax,
		Hints:              s.hints,
		FailureHandler:     policy{source{s}},
		Logger:             slog.New(engineLogs{r.log.Handler()}),
		Observer:           r.cfg.Observer,
	}
}

// engineLogs is the engine's log handler: the engine's lease records
// ("relay: leases changed", "relay: released leases") are the slot's
// term, which the reader logs itself ("pgwal: reading the slot"), so they
// are demoted to debug; a reader's log shows no table relay at work.
type engineLogs struct{ slog.Handler }

func (h engineLogs) Handle(ctx context.Context, rec slog.Record) error {
	if rec.Level == slog.LevelInfo && (rec.Message == "relay: leases changed" || rec.Message == "relay: released leases") {
		if !h.Handler.Enabled(ctx, slog.LevelDebug) {
			return nil
		}
		rec.Level = slog.LevelDebug
	}
	return h.Handler.Handle(ctx, rec)
}

func (h engineLogs) WithAttrs(attrs []slog.Attr) slog.Handler {
	return engineLogs{h.Handler.WithAttrs(attrs)}
}

func (h engineLogs) WithGroup(name string) slog.Handler { return engineLogs{h.Handler.WithGroup(name)} }

// publisherOnly hands the engine the reader's publisher without its
// LeaseAware side: the reader announces the term's leases itself
// (announce), renewing the slot's lease while a strict-mode publisher
// fences the previous owners.
type publisherOnly struct{ pub relay.Publisher }

// Publish publishes through the reader's publisher. A fenced publish
// (relay.IsFenced: another producer took a bucket's transactional id
// over) is handed to the engine as an outage: every bucket's lease is
// the slot's, which the stream renews and gives up itself when another
// reader took it, while the engine would drop the bucket and take it
// again at once under the same term.
func (p publisherOnly) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	n, err := p.pub.Publish(ctx, msgs)
	if relay.IsFenced(err) {
		err = relay.Unavailable(fmt.Errorf("pgwal: publisher fenced; retrying while the reader holds the slot: %v", err))
	}
	return n, err
}

// reconcilingPublisher is publisherOnly for a publisher that is a
// relay.Reconciler: the engine reconciles a bucket whose batch ended in
// doubt during the term (a commit whose outcome the publisher could not
// tell): the batch is at the head of the bucket's queue, and leaves it
// when Kafka's record names it. A fenced reconcile is an outage, as a
// fenced publish is.
type reconcilingPublisher struct {
	publisherOnly
	rc relay.Reconciler
}

// Reconcile forwards to the publisher's relay.Reconciler.
func (p reconcilingPublisher) Reconcile(ctx context.Context, lease relay.Lease) (relay.Committed, error) {
	c, err := p.rc.Reconcile(ctx, lease)
	if relay.IsFenced(err) {
		err = relay.Unavailable(fmt.Errorf("pgwal: publisher fenced; retrying while the reader holds the slot: %v", err))
	}
	return c, err
}

// CheckReady forwards the publisher's relay.ReadyChecker, if it has one.
func (p publisherOnly) CheckReady(ctx context.Context) error {
	if rc, ok := p.pub.(relay.ReadyChecker); ok {
		return rc.CheckReady(ctx)
	}
	return nil
}

// ProbeSink forwards the publisher's relay.SinkProber; without one the
// probe fails, and the engine sleeps its backoffs out.
func (p publisherOnly) ProbeSink(ctx context.Context) error {
	if sp, ok := p.pub.(relay.SinkProber); ok {
		return sp.ProbeSink(ctx)
	}
	return errors.New("pgwal: the publisher cannot probe its sink")
}

// announce hands the term's leases to the publisher, renewing the slot's
// lease meanwhile: the strict-mode publisher fences the previous owners
// here, which can take longer than LeaseDuration on a recovering
// cluster, and a lease left to lapse meanwhile is taken by a waiting
// reader that cannot stream the slot this reader holds, and that this
// reader then loses at its first standby update. The publisher's context
// ends when the lease is lost; announce then returns errLeaseLost. For a
// publisher that is a relay.Reconciler it then reads, under the same
// renewal, every bucket's record of its last batch committed to Kafka
// (reconcile.go); records is nil for another publisher.
func (r *Reader) announce(ctx context.Context, la relay.LeaseAware, term int64, from pglogrepl.LSN, leases []relay.Lease) (records []relay.Committed, err error) {
	actx, stop := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(r.cfg.StandbyInterval)
		defer t.Stop()
		for {
			select {
			case <-actx.Done():
				return
			case <-t.C:
			}
			rctx, cancel := context.WithTimeout(actx, r.cfg.LeaseDuration/3)
			ok, err := r.leases.renew(rctx, term, int64(from), lagSample{})
			cancel()
			if err == nil && !ok {
				stop(errLeaseLost)
				return
			}
		}
	})
	err = la.LeasesAcquired(actx, leases)
	if rc, ok := r.pub.(relay.Reconciler); ok && err == nil {
		records, err = readRecords(actx, rc, leases)
	}
	if errors.Is(context.Cause(actx), errLeaseLost) {
		err = errLeaseLost
	}
	stop(nil)
	wg.Wait()
	if err != nil {
		return nil, err
	}
	return records, nil
}

// walEnd reads the server's current WAL position.
func (r *Reader) walEnd(ctx context.Context) (pglogrepl.LSN, error) {
	var text string
	if err := r.sess(ctx).Raw("SELECT pg_current_wal_lsn()::text").Scan(&text).Error; err != nil {
		return 0, fmt.Errorf("pgwal: read the WAL position: %w", err)
	}
	return pglogrepl.ParseLSN(text)
}

// createSlot creates the slot on the replication connection conn and
// returns its consistent point: the messages committed after it are in
// the slot. While the server waits for open transactions it logs them
// (watchCreation).
func (r *Reader) createSlot(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	w := watchCreation(ctx, r.db, r.log, conn.PID())
	defer w.stop()
	return r.createSlotOn(ctx, conn)
}

func (r *Reader) createSlotOn(ctx context.Context, conn *pgconn.PgConn) (pglogrepl.LSN, error) {
	if r.cfg.FailoverSlot {
		return r.createFailoverSlot(ctx, conn)
	}
	res, err := pglogrepl.CreateReplicationSlot(ctx, conn, r.cfg.Slot, "pgoutput", pglogrepl.CreateReplicationSlotOptions{})
	if err != nil {
		return 0, fmt.Errorf("pgwal: create slot %s: %w", r.cfg.Slot, err)
	}
	lsn, err := pglogrepl.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, err
	}
	r.log.Info("pgwal: created the replication slot", "consistent_point", lsn)
	return lsn, nil
}

// EnsureSlot creates the lease table, the publication and the slot when
// they are missing, without reading. Only messages committed after the
// slot was created are in it: call EnsureSlot (or run a reader) before
// any writer switches to outbox.ModeWAL. A slot that this outbox's
// readers used before and that is gone or invalidated is a
// *SlotLostError, not created again. A slot of the same name that
// belongs to another database of the server (or is not a pgoutput
// logical slot) is a *SlotForeignError, left untouched. Creating a slot
// waits for the transactions open on the server (in any database) to
// end: while it waits, EnsureSlot logs the sessions it waits for, and
// ending ctx cancels the creation on the server.
func (r *Reader) EnsureSlot(ctx context.Context) error {
	if err := r.leases.migrate(ctx); err != nil {
		return fmt.Errorf("pgwal: create lease table %s: %w", r.cfg.LeaseTable, err)
	}
	if err := r.ensurePublication(ctx); err != nil {
		return err
	}
	st, row, err := r.leases.slotAndRow(ctx)
	if err != nil {
		return err
	}
	exists, err := checkSlot(st, r.cfg.Slot, pglogrepl.LSN(row.ConfirmedLSN))
	if err != nil || exists {
		return err
	}
	conn, err := r.connect(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	lsn, err := r.createSlot(ctx, conn)
	if err != nil {
		return err
	}
	return r.leases.record(ctx, int64(lsn))
}

func (r *Reader) connect(ctx context.Context) (*pgconn.PgConn, error) {
	pc, err := pgconn.ParseConfig(r.cfg.ReplicationDSN)
	if err != nil {
		return nil, &relay.ConfigError{Package: "pgwal", Field: "ReplicationDSN", Value: "(redacted)", Reason: "cannot be parsed", Err: err}
	}
	if pc.RuntimeParams == nil {
		pc.RuntimeParams = map[string]string{}
	}
	pc.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("pgwal: replication connection: %w", err)
	}
	return conn, nil
}
