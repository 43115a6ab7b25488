package gormrelay

import (
	"cmp"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/gormlog"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

// StoreTimeoutDefault bounds every Store operation (one or a few short
// statements) when StoreConfig.Timeout is zero.
const StoreTimeoutDefault = 10 * time.Second

// StoreConfig configures a Store beyond the outbox's configuration. The
// zero value is usable: every zero field takes the default documented on
// it.
type StoreConfig struct {
	// Timeout bounds every Store operation (one or a few short
	// statements), and the failure policy's dead-letter transaction. A
	// timed-out operation fails with an error naming it; the relay retries
	// it with backoff. Keep it well below relay.Config.LeaseRenewInterval,
	// so that a slow acquisition or renewal fails before the leases do.
	// Default 10s (StoreTimeoutDefault).
	Timeout time.Duration
}

// WithDefaults returns a copy of c with every zero field set to its
// default.
func (c StoreConfig) WithDefaults() StoreConfig {
	c.Timeout = cmp.Or(c.Timeout, StoreTimeoutDefault)
	return c
}

// validate checks a configuration that WithDefaults has filled in.
func (c StoreConfig) validate() error {
	if c.Timeout < time.Millisecond {
		return &relay.ConfigError{Package: "gormrelay", Field: "StoreConfig.Timeout", Value: c.Timeout, Reason: "must be at least 1ms"}
	}
	return nil
}

const (
	// storeChunk bounds the ids or buckets put into one statement, well
	// below every database's parameter limit.
	storeChunk = 1000
	// probeChunk bounds the per-bucket probes UNIONed into one statement.
	probeChunk = 128
	// lastErrorMax bounds the error text stored on a failing message.
	lastErrorMax = 2000
)

// Store is the GORM implementation of the relay's storage contract
// (relay.Store) with the relay.LeaseRenewer, relay.FailureRecorder,
// relay.BatchAdvancer and relay.BucketCounter capabilities, on
// PostgreSQL, MySQL/MariaDB and SQLite. It passes the relay/storetest
// conformance suite on all three.
//
// The relay.Store operations are each one or a few short, indexed
// statements outside any transaction; the concurrency model is the guarded
// conditional UPDATE of the lease rows described in package relay. The lease rows for buckets
// 0..BucketCount-1 are created on first use. Times are Unix milliseconds
// from this host's clock.
//
// A lease row with paused set (LeaseRow.Paused) is never claimed, and a
// relay holding it releases it at its next acquisition: an operator can
// stop publishing one bucket without stopping the relays.
//
// The one exception is the failure policy the Store brings
// (HandleFailure, FilterBatch; see FailurePolicy): moving messages to the
// dead-letter table is one short transaction that locks the bucket's
// lease row (SELECT ... FOR UPDATE; SQLite's write lock) to check the lease
// before copying and deleting. It runs between publishes, so the Store
// never holds a transaction or a lock while the publisher runs. It is safe
// for concurrent use.
type Store struct {
	db      *gorm.DB
	tables  outbox.Tables
	buckets int
	timeout time.Duration

	// quoted table names for raw SQL
	messages, leases, relays string
	// postgres: delete by an id array (see MarkPublished)
	postgres bool

	// the default failure policy (failure.go), built on first use
	policyOnce sync.Once
	policy     *FailurePolicy
	logger     *slog.Logger // the outbox Config.Logger, for the policy

	// schemaOK is set once CheckSchema passed (schema.go)
	schemaOK atomic.Bool

	// claimed is, per bucket, the last lease term this store claimed,
	// recorded once the claim's UPDATE returned: a read that starts
	// later sees every dead letter written under an earlier term, so the
	// failure policy reads the quarantined keys of all newly claimed
	// buckets in one statement (see FailurePolicy.quarantined).
	claimedMu sync.Mutex
	claimed   map[int]int64

	// pool watches the connection pool for churn (pool.go).
	pool poolWatch
	// estimate watches the planner's row estimate of the messages table
	// (estimate.go).
	estimate estimateWatch
}

var (
	_ relay.Store           = (*Store)(nil)
	_ relay.LeaseRenewer    = (*Store)(nil)
	_ relay.FailureRecorder = (*Store)(nil)
)

// NewStore returns the relay store of the outbox configured by cfg on db.
// cfg is completed with WithDefaults and validated; its Tables and
// BucketCount are used, and must match the writers' configuration. An
// optional StoreConfig (at most one) sets the store's own settings; it is
// completed with WithDefaults and validated too. The
// tables are not touched until the relay runs: a relay started before the
// tables exist stops with a *relay.MisconfigurationError naming the missing
// table.
//
// If the application never set the idle limit of db's connection pool
// (database/sql keeps 2 idle connections and closes the rest, so the
// relay's drainers would open a database session per statement), NewStore
// raises it to PoolIdleFor(relay.ParallelismDefault), 16, and the relay's
// first lease acquisition raises it further for a larger Parallelism; each
// change is logged once at Info. Call SetMaxIdleConns on the pool before
// NewStore (any value) to keep your own setting.
func NewStore(db *gorm.DB, cfg outbox.Config, storeCfg ...StoreConfig) (*Store, error) {
	if db == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "db", Value: nil, Reason: "a *gorm.DB is required"}
	}
	if len(storeCfg) > 1 {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "storeCfg", Value: len(storeCfg), Reason: "at most one StoreConfig"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sc := StoreConfig{}
	if len(storeCfg) == 1 {
		sc = storeCfg[0]
	}
	sc = sc.WithDefaults()
	if err := sc.validate(); err != nil {
		return nil, err
	}
	sess := db.Session(&gorm.Session{NewDB: true, SkipHooks: true, SkipDefaultTransaction: true, Logger: gormlog.OnlyFailures(db.Logger)})
	s := &Store{
		db:       sess,
		tables:   cfg.Tables,
		buckets:  cfg.BucketCount,
		timeout:  sc.Timeout,
		messages: sess.Statement.Quote(cfg.Tables.MessagesTable()),
		leases:   sess.Statement.Quote(cfg.Tables.LeasesTable()),
		relays:   sess.Statement.Quote(cfg.Tables.RelaysTable()),
		postgres: sess.Dialector.Name() == outbox.DialectPostgres,
		logger:   cfg.Logger,
	}
	s.tunePool(relay.ParallelismDefault)
	return s, nil
}

// op starts a store operation: a context bounded by the store timeout,
// with a cause naming the operation.
func (s *Store) op(ctx context.Context, name string) (*gorm.DB, context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeoutCause(ctx, s.timeout, fmt.Errorf("outbox: store %s: timed out after %s", name, s.timeout))
	return s.db.WithContext(ctx), ctx, cancel
}

// fail wraps an operation's error with its name. An error from a missing
// table becomes a *relay.MisconfigurationError.
func (s *Store) fail(ctx context.Context, name string, err error) error {
	var me *relay.MisconfigurationError
	if errors.As(err, &me) || errors.Is(err, relay.ErrLeaseLost) {
		return err
	}
	if ctx.Err() != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, ctx.Err()) {
			return fmt.Errorf("%w: %w", cause, err)
		}
		return fmt.Errorf("outbox: store %s: %w", name, err)
	}
	if !maybeSchemaError(err) {
		// A connection, timeout or constraint error: no probe, so a
		// database that is down costs no extra statements.
		return fmt.Errorf("outbox: store %s: %w", name, err)
	}
	if missing := s.missingTable(ctx); missing != "" {
		return &relay.MisconfigurationError{
			Setting: "Tables",
			Reason:  fmt.Sprintf("table %s does not exist: run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)), Tables.AutoMigrate or your migrations before starting the relay", missing),
			Err:     err,
		}
	}
	return fmt.Errorf("outbox: store %s: %w", name, err)
}

// maybeSchemaError reports whether err may come from a missing table or
// column, so that it is worth probing the schema: PostgreSQL SQLSTATE
// class 42 (42P01 undefined table, 42703 undefined column, 3F000 no such
// schema), MySQL 1146/1054/1049 (42S02, 42S22), SQLite "no such
// table/column". Connection errors, timeouts and the rest are not.
func maybeSchemaError(err error) bool {
	var st interface{ SQLState() string }
	if errors.As(err, &st) {
		code := st.SQLState()
		return strings.HasPrefix(code, "42") || code == "3F000"
	}
	text := err.Error()
	for _, mark := range []string{"Error 1146", "Error 1054", "Error 1049", "42S02", "42S22", "no such table", "no such column", "does not exist", "doesn't exist"} {
		if strings.Contains(text, mark) {
			return true
		}
	}
	return false
}

// missingTable returns the first outbox table the relay needs that cannot
// be read while the database itself answers, or "".
func (s *Store) missingTable(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
	defer cancel()
	db := s.db.WithContext(ctx)
	var one int
	if err := db.Raw("SELECT 1").Row().Scan(&one); err != nil {
		return "" // the database is unreachable: not a schema problem
	}
	for _, name := range []string{s.tables.MessagesTable(), s.tables.LeasesTable(), s.tables.RelaysTable(), s.tables.DeadLettersTable()} {
		if err := db.Exec("SELECT 1 FROM " + db.Statement.Quote(name) + " WHERE 1 = 0").Error; err != nil {
			return name
		}
	}
	return ""
}

func nowMs() int64 { return time.Now().UnixMilli() }

// due reports whether now has reached *next and, if so, moves *next to
// every after now: something done at most once every interval (zero
// *next: due at once).
func due(next *time.Time, now time.Time, every time.Duration) bool {
	if now.Before(*next) {
		return false
	}
	*next = now.Add(every)
	return true
}

// AcquireLeases implements relay.Store: heartbeat, misconfiguration
// checks, renewal of held leases, release of surplus and claim of free or
// expired leases up to the fair share.
func (s *Store) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	if err := s.checkBucketCount(req.BucketCount); err != nil {
		return relay.Acquired{}, err
	}
	if req.RelayID == "" || req.LeaseDuration < time.Millisecond {
		return relay.Acquired{}, fmt.Errorf("outbox: store acquire leases: relay id and a lease duration of at least 1ms are required")
	}
	if err := s.checkSchemaOnce(ctx); err != nil {
		return relay.Acquired{}, err
	}
	db, ctx, cancel := s.op(ctx, "acquire leases")
	defer cancel()
	res, err := s.acquire(db, req)
	if err != nil {
		return relay.Acquired{}, s.fail(ctx, "acquire leases", err)
	}
	s.tunePool(req.Parallelism)
	s.watchPool()
	return res, nil
}

// checkBucketCount fails unless the relay's BucketCount is the store's
// (relay.CheckBucketCount).
func (s *Store) checkBucketCount(n int) error {
	return relay.CheckBucketCount(n, s.buckets, "the outbox (table "+s.tables.MessagesTable()+")")
}

var _ relay.StartChecker = (*Store)(nil)

var _ relay.Prober = (*Store)(nil)

// Probe implements relay.Prober: one SELECT 1 on the store's database,
// bounded by the store's operation timeout, logged nowhere (the relay
// probes while the database is down).
func (s *Store) Probe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	return s.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true, Logger: logger.Discard}).Exec("SELECT 1").Error
}

// CheckStart implements relay.StartChecker, so that relay.Start fails at
// once on what would stop the relay later: a BucketCount other than the
// store's, missing or outdated tables (CheckSchema), messages or leases
// outside the buckets.
func (s *Store) CheckStart(ctx context.Context, bucketCount int) error {
	if err := s.checkBucketCount(bucketCount); err != nil {
		return err
	}
	if err := s.checkSchemaOnce(ctx); err != nil {
		return err
	}
	db, ctx, cancel := s.op(ctx, "check buckets")
	defer cancel()
	if err := s.checkBuckets(db); err != nil {
		return s.fail(ctx, "check buckets", err)
	}
	return nil
}

func (s *Store) acquire(db *gorm.DB, req relay.AcquireRequest) (relay.Acquired, error) {
	me := req.RelayID
	dur := req.LeaseDuration.Milliseconds()
	now := nowMs()

	// Before the heartbeat: a misconfigured relay must not count as live
	// and shrink its peers' fair share.
	if err := s.checkBuckets(db); err != nil {
		return relay.Acquired{}, err
	}
	if err := s.heartbeat(db, me, now); err != nil {
		return relay.Acquired{}, err
	}
	live, err := s.liveRelays(db, now, dur)
	if err != nil {
		return relay.Acquired{}, err
	}
	rows, err := s.leaseRows(db)
	if err != nil {
		return relay.Acquired{}, err
	}
	share := relay.FairShare(s.buckets, live)

	var renew, release, candidates []relay.Lease
	for _, r := range rows {
		l := relay.Lease{Bucket: int(r.Bucket), Term: r.Term}
		mine := r.Owner != nil && *r.Owner == me
		expired := r.ExpiresAtMs <= now
		switch {
		case mine && r.Paused && !expired && slices.Contains(req.Busy, l.Bucket):
			renew = append(renew, l) // released after its batch, by a later call
		case mine && r.Paused:
			release = append(release, l)
		case mine && !expired:
			renew = append(renew, l)
		case r.Paused:
		case r.Owner == nil || expired:
			candidates = append(candidates, l)
		}
	}

	// What is released so far is paused; the surplus follows. Both are
	// for the relay's log.
	paused, aboveShare := leaseBuckets(release), []int(nil)
	expires := now + dur
	held, err := s.renew(db, me, renew, now, expires)
	if err != nil {
		return relay.Acquired{}, err
	}
	if len(held) > share {
		// Keep the buckets whose batch is in flight and then the lowest
		// ones; give the rest back to the newcomers.
		var keep, surplus []relay.Lease
		room := share
		for _, l := range held {
			if slices.Contains(req.Busy, l.Bucket) {
				keep = append(keep, l)
				room--
			}
		}
		for _, l := range held {
			switch {
			case slices.Contains(req.Busy, l.Bucket):
			case room > 0:
				keep = append(keep, l)
				room--
			default:
				surplus = append(surplus, l)
			}
		}
		release = append(release, surplus...)
		aboveShare = leaseBuckets(surplus)
		held = keep
	}
	if err := s.release(db, me, release); err != nil {
		return relay.Acquired{}, err
	}
	// Claim in random order so relays starting together rarely race for
	// the same rows; a lost race just claims fewer. The claims go out a
	// chunk per statement (a relay taking 256 free buckets makes one or
	// two round trips, not 256); the candidates after a lost race are
	// tried once more.
	rand.Shuffle(len(candidates), func(i, j int) { candidates[i], candidates[j] = candidates[j], candidates[i] })
	for range 2 {
		need := min(share-len(held), len(candidates))
		if need <= 0 {
			break
		}
		claimed, err := s.claim(db, me, candidates[:need], now, expires)
		if err != nil {
			return relay.Acquired{}, err
		}
		held = append(held, claimed...)
		s.noteClaimed(claimed)
		candidates = candidates[need:]
	}
	slices.SortFunc(held, func(a, b relay.Lease) int { return a.Bucket - b.Bucket })
	res := relay.Acquired{Leases: held, LiveRelays: live, FairShare: share, Paused: paused, AboveShare: aboveShare}
	if len(held) < share {
		res.Waiting = waitingFor(rows, me, now, share)
	}
	return res, nil
}

// leaseBuckets returns the buckets of ls in ascending order; nil if none.
func leaseBuckets(ls []relay.Lease) []int {
	var out []int
	for _, l := range ls {
		out = append(out, l.Bucket)
	}
	slices.Sort(out)
	return out
}

// waitingFor returns the unexpired leases of the relays other than me
// that hold more than share buckets (see relay.Acquired.Waiting).
func waitingFor(rows []outbox.LeaseRow, me string, now int64, share int) []relay.HeldLease {
	var others []outbox.LeaseRow
	count := map[string]int{}
	for _, r := range rows {
		if r.Owner != nil && *r.Owner != me && r.ExpiresAtMs > now && !r.Paused {
			others = append(others, r)
			count[*r.Owner]++
		}
	}
	var waiting []relay.HeldLease
	for _, r := range others {
		if count[*r.Owner] > share {
			waiting = append(waiting, relay.HeldLease{Bucket: int(r.Bucket), Owner: *r.Owner, ExpiresAt: time.UnixMilli(r.ExpiresAtMs)})
		}
	}
	return waiting
}

// heartbeat records that relay me is alive. Its first statement only
// updates the relay's row, so that, run by the database after the relay's
// release deleted that row (a statement abandoned on a cancelled context
// still runs), it brings no heartbeat back; the insert follows only a
// reply that found no row.
func (s *Store) heartbeat(db *gorm.DB, me string, now int64) error {
	r := s.beat(db, me, now)
	if r.Error != nil {
		return r.Error
	}
	if r.RowsAffected > 0 {
		return nil
	}
	// New relay, or MySQL reporting an unchanged row as unaffected.
	return db.Table(s.tables.RelaysTable()).Clauses(clause.OnConflict{
		Columns:   []clause.Column{{Name: "relay_id"}},
		DoUpdates: clause.Assignments(map[string]any{"last_seen_ms": now}),
	}).Create(&outbox.RelayRow{RelayID: me, LastSeenMs: now, StartedAtMs: now}).Error
}

// beat is the heartbeat's update of relay me's row.
func (s *Store) beat(db *gorm.DB, me string, now int64) *gorm.DB {
	return db.Exec("UPDATE "+s.relays+" SET last_seen_ms = ? WHERE relay_id = ?", now, me)
}

// liveRelays counts relays with a heartbeat younger than a lease, and
// deletes heartbeats of relays long gone.
func (s *Store) liveRelays(db *gorm.DB, now, dur int64) (int, error) {
	var seen []int64
	if err := db.Raw("SELECT last_seen_ms FROM " + s.relays).Scan(&seen).Error; err != nil {
		return 0, err
	}
	live, stale := 0, false
	gone := now - max(10*dur, time.Minute.Milliseconds())
	for _, t := range seen {
		if t > now-dur {
			live++
		}
		stale = stale || t < gone
	}
	if stale {
		if err := db.Exec("DELETE FROM "+s.relays+" WHERE last_seen_ms < ?", gone).Error; err != nil {
			return 0, err
		}
	}
	return max(live, 1), nil
}

// checkBuckets fails when messages exist outside 0..BucketCount-1 (a
// writer uses a larger BucketCount, and those rows would never be
// published) or when the lease table defines another BucketCount
// (checkLeaseBuckets). Both probes are one index seek.
func (s *Store) checkBuckets(db *gorm.DB) error {
	if err := s.checkMessageBuckets(db); err != nil {
		return err
	}
	return s.checkLeaseBuckets(db)
}

// checkLeaseBuckets fails unless the lease table is empty or defines this
// store's BucketCount: the first relay of an outbox creates the rows of
// buckets 0..BucketCount-1 (createLeaseRows), so the highest bucket with
// a row, plus one, is the count the running relays use. A relay with
// another count fails here before it writes anything (no heartbeat, no
// lease row), in either direction: with a larger count it would create
// rows that stop the relays already running, with a smaller one it would
// leave their higher buckets without an owner.
func (s *Store) checkLeaseBuckets(db *gorm.DB) error {
	var top []int32
	if err := db.Raw("SELECT bucket FROM " + s.leases + " ORDER BY bucket DESC LIMIT 1").Scan(&top).Error; err != nil {
		return err
	}
	if len(top) == 0 || int(top[0]) == s.buckets-1 {
		return nil
	}
	return s.leaseCountMismatch(int(top[0]) + 1)
}

// leaseCountMismatch is the misconfiguration of a lease table whose rows
// define have buckets while this store uses another BucketCount.
func (s *Store) leaseCountMismatch(have int) error {
	return &relay.MisconfigurationError{Setting: "BucketCount", Reason: fmt.Sprintf(
		"table %s defines %d buckets (rows up to bucket %d), this relay's BucketCount is %d: every relay and writer of an outbox must use the count its lease table defines; "+
			"to change the count, stop every relay and follow \"Changing BucketCount\" in docs/operations.md (the lease rows are deleted while no relay runs)",
		s.tables.LeasesTable(), have, have-1, s.buckets)}
}

// checkMessageBuckets fails when messages exist outside 0..BucketCount-1
// (one index seek). PendingBuckets probes for them too, so a writer with
// a larger BucketCount is noticed within a poll interval.
func (s *Store) checkMessageBuckets(db *gorm.DB) error {
	return s.checkTableBuckets(db, s.messages, s.messagesBeyond)
}

// messagesBeyond is the reason of the misconfiguration that messages in
// bucket, outside 0..BucketCount-1, are. bucket is the highest such
// bucket, so bucket+1 is the least BucketCount the writer uses.
func (s *Store) messagesBeyond(bucket int32) string {
	return fmt.Sprintf("table %s holds messages in bucket %d, outside 0..%d: a writer uses a BucketCount of at least %d and this relay %d, so no relay can publish them; use one BucketCount everywhere",
		s.tables.MessagesTable(), bucket, s.buckets-1, bucket+1, s.buckets)
}

// checkTableBuckets fails with a BucketCount *relay.MisconfigurationError,
// its reason told by reason with the highest such bucket, when the
// (quoted) table holds a row of a bucket outside 0..BucketCount-1.
//
// The ORDER BY keeps the probe an index seek under a plan made for any
// parameter value: PostgreSQL plans a prepared statement once after a few
// executions, and without it that generic plan is a sequential scan that
// stops at the first match, so it read the whole messages table, deleted
// rows included, at every lease renewal of every relay.
func (s *Store) checkTableBuckets(db *gorm.DB, table string, reason func(bucket int32) string) error {
	var found []int32
	if err := db.Raw("SELECT bucket FROM "+table+" WHERE bucket >= ? ORDER BY bucket DESC LIMIT 1", s.buckets).Scan(&found).Error; err != nil {
		return err
	}
	if len(found) == 0 {
		return nil
	}
	return &relay.MisconfigurationError{Setting: "BucketCount", Reason: reason(found[0])}
}

// leaseRows reads every lease row, creating the missing ones first: all
// of them in an empty table (createLeaseRows), otherwise those missing
// below the highest one. It fails like checkLeaseBuckets when the rows
// define another BucketCount.
func (s *Store) leaseRows(db *gorm.DB) ([]outbox.LeaseRow, error) {
	read := func() ([]outbox.LeaseRow, error) {
		var rows []outbox.LeaseRow
		err := db.Raw("SELECT bucket, owner, term, expires_at_ms, paused FROM " + s.leases + " ORDER BY bucket").Scan(&rows).Error
		if err == nil && len(rows) > 0 && int(rows[len(rows)-1].Bucket) != s.buckets-1 {
			err = s.leaseCountMismatch(int(rows[len(rows)-1].Bucket) + 1)
		}
		return rows, err
	}
	rows, err := read()
	if err != nil || len(rows) == s.buckets {
		return rows, err
	}
	if len(rows) == 0 {
		if err := s.createLeaseRows(db); err != nil {
			// Another relay created them first, or is creating them:
			// what it committed decides (a mismatch if its count is
			// another).
			rows, rerr := read()
			if rerr != nil || len(rows) > 0 {
				return rows, rerr
			}
			return nil, err
		}
		return read()
	}
	have := make(map[int32]bool, len(rows))
	for _, r := range rows {
		have[r.Bucket] = true
	}
	var missing []outbox.LeaseRow
	for b := range int32(s.buckets) {
		if !have[b] {
			missing = append(missing, outbox.LeaseRow{Bucket: b})
		}
	}
	// Relays starting together insert the same rows: the loser's insert is
	// ignored.
	if err := db.Table(s.tables.LeasesTable()).Clauses(clause.OnConflict{DoNothing: true}).
		CreateInBatches(missing, storeChunk).Error; err != nil {
		return nil, err
	}
	return read()
}

// createLeaseRows creates the lease rows of buckets 0..BucketCount-1 in
// an empty lease table, in one transaction, with plain inserts: when
// relays with different counts start together on an empty table, the
// first to commit defines the count and the others' inserts fail on its
// rows (their transactions then create nothing), rather than the largest
// count's rows being added to the smallest's.
func (s *Store) createLeaseRows(db *gorm.DB) error {
	return createLeaseRows(db, s.tables.LeasesTable(), s.buckets)
}

// createLeaseRows creates the rows of buckets 0..n-1 in table, all or
// none. Its failure is not logged: relays starting together on an empty
// table expect the duplicate keys of all but the first, and the caller
// reads the table again.
func createLeaseRows(db *gorm.DB, table string, n int) error {
	rows := make([]outbox.LeaseRow, n)
	for b := range rows {
		rows[b].Bucket = int32(b)
	}
	return db.Session(&gorm.Session{Logger: logger.Discard}).Transaction(func(tx *gorm.DB) error {
		return tx.Table(table).CreateInBatches(rows, storeChunk).Error
	})
}

// leaseGuard appends "(bucket = ? AND term = ?) OR ..." for leases.
func leaseGuard(sb *strings.Builder, args []any, leases []relay.Lease) []any {
	sb.WriteString("(")
	for i, l := range leases {
		if i > 0 {
			sb.WriteString(" OR ")
		}
		sb.WriteString("(bucket = ? AND term = ?)")
		args = append(args, l.Bucket, l.Term)
	}
	sb.WriteString(")")
	return args
}

func buckets(leases []relay.Lease) []int {
	out := make([]int, len(leases))
	for i, l := range leases {
		out[i] = l.Bucket
	}
	return out
}

// renew extends the leases still held by me under their terms and
// unexpired to at least expires, and returns those.
//
// A relay's acquisition and its renewal (relay.LeaseRenewer) may run at
// the same time, and their statements may reach the database in either
// order, so an expiry is only ever moved forward: a renewal that started
// earlier but arrives later must not shorten the lease below what the
// relay already trusts.
func (s *Store) renew(db *gorm.DB, me string, leases []relay.Lease, now, expires int64) ([]relay.Lease, error) {
	var held []relay.Lease
	for chunk := range slices.Chunk(leases, probeChunk) {
		var sb strings.Builder
		sb.WriteString("UPDATE " + s.leases + " SET expires_at_ms = CASE WHEN expires_at_ms < ? THEN ? ELSE expires_at_ms END" +
			" WHERE owner = ? AND expires_at_ms > ? AND bucket IN ? AND ")
		args := leaseGuard(&sb, []any{expires, expires, me, now, buckets(chunk)}, chunk)
		r := db.Exec(sb.String(), args...)
		if r.Error != nil {
			return nil, r.Error
		}
		if int(r.RowsAffected) == len(chunk) {
			held = append(held, chunk...)
			continue
		}
		// Some leases were lost, or MySQL counted a row it left unchanged
		// (already renewed to this expiry or later) as unaffected: read
		// back which we hold. A concurrent renewal of ours may have moved
		// the expiry further since, so not only this expiry counts.
		sb.Reset()
		sb.WriteString("SELECT bucket, term FROM " + s.leases + " WHERE owner = ? AND expires_at_ms >= ? AND bucket IN ? AND ")
		args = leaseGuard(&sb, []any{me, expires, buckets(chunk)}, chunk)
		var rows []outbox.LeaseRow
		if err := db.Raw(sb.String(), args...).Scan(&rows).Error; err != nil {
			return nil, err
		}
		for _, r := range rows {
			held = append(held, relay.Lease{Bucket: int(r.Bucket), Term: r.Term})
		}
	}
	slices.SortFunc(held, func(a, b relay.Lease) int { return a.Bucket - b.Bucket })
	return held, nil
}

// claim takes the free or expired leases among candidates (each under the
// term it was read with) for me, and returns those it got, with their new
// terms.
func (s *Store) claim(db *gorm.DB, me string, candidates []relay.Lease, now, expires int64) ([]relay.Lease, error) {
	var got []relay.Lease
	for chunk := range slices.Chunk(candidates, probeChunk) {
		var sb strings.Builder
		sb.WriteString("UPDATE " + s.leases + " SET owner = ?, term = term + 1, expires_at_ms = ?" +
			" WHERE paused = ? AND (owner IS NULL OR expires_at_ms <= ?) AND bucket IN ? AND ")
		args := leaseGuard(&sb, []any{me, expires, false, now, buckets(chunk)}, chunk)
		r := db.Exec(sb.String(), args...)
		if r.Error != nil {
			return nil, r.Error
		}
		if int(r.RowsAffected) == len(chunk) {
			for _, c := range chunk {
				got = append(got, relay.Lease{Bucket: c.Bucket, Term: c.Term + 1})
			}
			continue
		}
		if r.RowsAffected == 0 {
			continue
		}
		// Some were claimed by another relay first: read back ours, the
		// rows with our owner, this expiry and the next term.
		next := make([]relay.Lease, len(chunk))
		for i, c := range chunk {
			next[i] = relay.Lease{Bucket: c.Bucket, Term: c.Term + 1}
		}
		sb.Reset()
		sb.WriteString("SELECT bucket, term FROM " + s.leases + " WHERE owner = ? AND expires_at_ms = ? AND bucket IN ? AND ")
		args = leaseGuard(&sb, []any{me, expires, buckets(next)}, next)
		var rows []outbox.LeaseRow
		if err := db.Raw(sb.String(), args...).Scan(&rows).Error; err != nil {
			return nil, err
		}
		for _, r := range rows {
			got = append(got, relay.Lease{Bucket: int(r.Bucket), Term: r.Term})
		}
	}
	return got, nil
}

// noteClaimed records the terms of leases this store just claimed.
func (s *Store) noteClaimed(leases []relay.Lease) {
	if len(leases) == 0 {
		return
	}
	s.claimedMu.Lock()
	defer s.claimedMu.Unlock()
	if s.claimed == nil {
		s.claimed = make(map[int]int64, s.buckets)
	}
	for _, l := range leases {
		s.claimed[l.Bucket] = l.Term
	}
}

// claimedLeases appends to dst the last lease this store claimed in each
// bucket for which keep returns true.
func (s *Store) claimedLeases(dst []relay.Lease, keep func(relay.Lease) bool) []relay.Lease {
	s.claimedMu.Lock()
	defer s.claimedMu.Unlock()
	for b, term := range s.claimed {
		if l := (relay.Lease{Bucket: b, Term: term}); keep(l) {
			dst = append(dst, l)
		}
	}
	return dst
}

// release clears the owner of the leases me holds under their terms.
func (s *Store) release(db *gorm.DB, me string, leases []relay.Lease) error {
	for chunk := range slices.Chunk(leases, probeChunk) {
		var sb strings.Builder
		sb.WriteString("UPDATE " + s.leases + " SET owner = NULL, expires_at_ms = 0 WHERE owner = ? AND bucket IN ? AND ")
		args := leaseGuard(&sb, []any{me, buckets(chunk)}, chunk)
		if err := db.Exec(sb.String(), args...).Error; err != nil {
			return err
		}
	}
	return nil
}

// RenewLeases implements relay.LeaseRenewer: it extends the leases still
// held by relayID under their terms and unexpired, and refreshes the
// relay's heartbeat. It never acquires or releases a lease.
func (s *Store) RenewLeases(ctx context.Context, relayID string, leases []relay.Lease, d time.Duration) ([]relay.Lease, error) {
	db, ctx, cancel := s.op(ctx, "renew leases")
	defer cancel()
	now := nowMs()
	held, err := s.renew(db, relayID, leases, now, now+d.Milliseconds())
	if err == nil {
		err = s.heartbeat(db, relayID, now)
	}
	if err != nil {
		return nil, s.fail(ctx, "renew leases", err)
	}
	return held, nil
}

// ReleaseLeases implements relay.Store: it releases every lease relayID
// holds, whatever its term and whether or not it is listed, and deletes
// the relay's heartbeat. Guarding by owner alone also frees the leases of
// a claim that committed after the relay gave up on its reply. The
// released leases' terms are advanced, so that a claim the relay sent
// before, and abandoned on its cancelled context, claims nothing if the
// database runs it after the release: a claim names the terms it saw.
func (s *Store) ReleaseLeases(ctx context.Context, relayID string, _ []relay.Lease) error {
	db, ctx, cancel := s.op(ctx, "release leases")
	defer cancel()
	err := db.Exec("UPDATE "+s.leases+" SET owner = NULL, expires_at_ms = 0, term = term + 1 WHERE owner = ?", relayID).Error
	if err == nil {
		err = db.Exec("DELETE FROM "+s.relays+" WHERE relay_id = ?", relayID).Error
	}
	if err != nil {
		return s.fail(ctx, "release leases", err)
	}
	return nil
}

// bucketRange is the WHERE condition that selects one bucket's rows, with
// the bucket as both of its arguments, for statements that read them
// through the (bucket, id) index in order (ORDER BY bucket, id).
//
// It is a range rather than "bucket = ?" on purpose. With an equality,
// PostgreSQL drops the constant bucket from the sort order and, since the
// buckets' rows are interleaved in the table, usually prefers to walk the
// primary key in id order (or the table itself), filtering out the other
// buckets' rows. That walk also steps over every row deleted since the
// last vacuum, in all buckets: each read of a draining backlog then costs
// more than the one before. Through (bucket, id) a read steps over the
// deleted rows of its own bucket only. The range leaves "bucket, id" as
// the sort order, which only that index provides. MySQL and SQLite use the
// index either way.
const bucketRange = "bucket >= ? AND bucket <= ?"

// PendingBuckets implements relay.Store with one index probe per bucket
// (the first row of the bucket through the (bucket, id) index), so its
// cost does not grow with the backlog. The last statement also probes for
// a row in a bucket beyond BucketCount, which no relay can publish (a
// writer with a larger BucketCount).
//
// On PostgreSQL it is one statement whatever the number of buckets: the
// buckets are one array parameter, each probed by a LATERAL subquery, so
// the statement text never changes and its plan is the same small nested
// loop. The UNION ALL of one subquery per bucket that MySQL/MariaDB and
// SQLite run (one round trip for up to probeChunk buckets) cost the
// server about 80 ms of CPU per discovery of 256 buckets, most of it
// planning 256 subqueries, against about 5 ms for the array: a relay
// owning 256 buckets paid it at every PollInterval, idle or draining.
func (s *Store) PendingBuckets(ctx context.Context, bs []int) ([]int, error) {
	db, ctx, cancel := s.op(ctx, "find pending buckets")
	defer cancel()
	if s.postgres {
		return s.pendingBucketsPostgres(ctx, db, bs)
	}
	var out []int
	chunks := slices.Collect(slices.Chunk(bs, probeChunk))
	if len(chunks) == 0 {
		chunks = [][]int{nil}
	}
	for ci, chunk := range chunks {
		var sb strings.Builder
		args := make([]any, 0, 2*len(chunk)+1)
		for i, b := range chunk {
			if i > 0 {
				sb.WriteString(" UNION ALL ")
			}
			fmt.Fprintf(&sb, "SELECT b FROM (SELECT bucket AS b FROM %s WHERE %s ORDER BY bucket, id LIMIT 1) p%d", s.messages, bucketRange, i)
			args = append(args, b, b)
		}
		if ci == len(chunks)-1 {
			if len(chunk) > 0 {
				sb.WriteString(" UNION ALL ")
			}
			fmt.Fprintf(&sb, "SELECT b FROM (SELECT bucket AS b FROM %s WHERE bucket >= ? ORDER BY bucket, id LIMIT 1) beyond", s.messages)
			args = append(args, s.buckets)
		}
		var found []int
		if err := db.Raw(sb.String(), args...).Scan(&found).Error; err != nil {
			return nil, s.fail(ctx, "find pending buckets", err)
		}
		out = append(out, found...)
	}
	return s.pendingFound(out)
}

// pendingBucketsPostgres is PendingBuckets on PostgreSQL: one statement,
// the buckets as one int[] parameter.
func (s *Store) pendingBucketsPostgres(ctx context.Context, db *gorm.DB, bs []int) ([]int, error) {
	list := bucketArray(bs)
	q := "SELECT p.b FROM unnest(CAST(CAST(? AS text) AS int[])) AS p(b) CROSS JOIN LATERAL" +
		" (SELECT 1 FROM " + s.messages + " WHERE bucket >= p.b AND bucket <= p.b ORDER BY bucket, id LIMIT 1) probe" +
		" UNION ALL SELECT b FROM (SELECT bucket AS b FROM " + s.messages + " WHERE bucket >= ? ORDER BY bucket, id LIMIT 1) beyond"
	var found []int
	if err := db.Raw(q, list, s.buckets).Scan(&found).Error; err != nil {
		return nil, s.fail(ctx, "find pending buckets", err)
	}
	return s.pendingFound(found)
}

// pendingFound sorts the buckets discovery found, and fails if one is
// beyond BucketCount.
func (s *Store) pendingFound(out []int) ([]int, error) {
	slices.Sort(out)
	if n := len(out); n > 0 && out[n-1] >= s.buckets {
		return nil, &relay.MisconfigurationError{Setting: "BucketCount", Reason: s.messagesBeyond(int32(out[n-1]))}
	}
	return out, nil
}

// batchCapMin is the capacity NextBatch starts a batch with when the limit
// is larger: a relay woken for a few new messages should not allocate a
// whole BatchSize of Message structs each time.
const batchCapMin = 64

// batchColumns are the message columns a batch read selects, in the order
// scanBatch scans them.
const batchColumns = wire.ColID + ", " + wire.ColMessageID + ", " + wire.ColTopic + ", " + wire.ColKey + ", " + wire.ColValue + ", " +
	wire.ColHeaders + ", " + wire.ColPartition + ", " + wire.ColCreatedAtMs + ", " + wire.ColAttempts

// NextBatch implements relay.Store: the oldest limit rows of bucket by id,
// read through the (bucket, id) index (see bucketRange).
func (s *Store) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	msgs, err := s.readBatch(ctx, bucket, limit)
	if err == nil && len(msgs) == limit {
		s.checkEstimate(ctx, bucket, limit) // a backlog: is the planner aware of it? (estimate.go)
	}
	return msgs, err
}

var _ relay.BatchSkipper = (*Store)(nil)

// NextBatchExcept implements relay.BatchSkipper: the read of NextBatch
// with the ids of except left out in the same statement (on PostgreSQL
// as one array parameter), up to storeChunk of them; a longer except
// reads nothing.
func (s *Store) NextBatchExcept(ctx context.Context, bucket, limit int, except []relay.Message) ([]relay.Message, error) {
	if len(except) > storeChunk {
		return nil, nil
	}
	ids := make([]int64, len(except))
	for i, m := range except {
		ids[i] = m.ID
	}
	msgs, err := s.readBatchExcept(ctx, bucket, limit, ids)
	if err == nil && msgs == nil {
		msgs = []relay.Message{}
	}
	return msgs, err
}

// readBatch is NextBatch's read.
func (s *Store) readBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	return s.readBatchExcept(ctx, bucket, limit, nil)
}

// readBatchExcept reads the bucket's oldest rows but those of ids.
func (s *Store) readBatchExcept(ctx context.Context, bucket, limit int, ids []int64) ([]relay.Message, error) {
	db, ctx, cancel := s.op(ctx, "read batch")
	defer cancel()
	where, args := bucketRange, []any{bucket, bucket}
	switch {
	case len(ids) == 0:
	case s.postgres:
		where += " AND NOT (id = ANY(CAST(CAST(? AS text) AS bigint[])))"
		args = append(args, int8Array(ids))
	default:
		where += " AND id NOT IN ?"
		args = append(args, ids)
	}
	rows, err := db.Raw("SELECT "+batchColumns+" FROM "+
		s.messages+" WHERE "+where+" ORDER BY bucket, id LIMIT ?", append(args, limit)...).Rows()
	if err != nil {
		return nil, s.fail(ctx, "read batch", err)
	}
	defer rows.Close()
	msgs, err := scanBatch(rows, bucket, limit)
	if err != nil {
		return nil, s.fail(ctx, "read batch", err)
	}
	return msgs, nil
}

// scanBatch scans the rows of a batch read, batchColumns, all of bucket.
func scanBatch(rows *sql.Rows, bucket, limit int) ([]relay.Message, error) {
	// Every row is scanned through the same destinations, so that nothing
	// but the column values themselves is allocated per row.
	var (
		m         relay.Message
		id        sql.NullInt64
		mid       sql.NullString
		topic     sql.NullString
		headers   []byte
		partition sql.NullInt32
		created   sql.NullInt64
		attempts  sql.NullInt64
	)
	dest := []any{&id, &mid, &topic, &m.Key, &m.Value, &headers, &partition, &created, &attempts}
	var msgs []relay.Message
	for rows.Next() {
		m = relay.Message{}
		headers = nil
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if msgs == nil {
			msgs = make([]relay.Message, 0, min(limit, batchCapMin))
		} else if len(msgs) == cap(msgs) {
			// A full first chunk says a backlog: grow to the limit at once
			// rather than by doubling.
			msgs = slices.Grow(msgs, limit-len(msgs))
		}
		var err error
		if m.Headers, err = outbox.DecodeHeaders(headers); err != nil {
			return nil, fmt.Errorf("outbox: store read batch: message %d: %w", id.Int64, err)
		}
		if partition.Valid {
			p := partition.Int32
			m.Partition = &p
		}
		m.ID, m.MessageID, m.Topic = id.Int64, mid.String, topic.String
		m.Bucket = bucket
		m.CreatedAt = time.UnixMilli(created.Int64)
		m.Attempts = int(attempts.Int64)
		msgs = append(msgs, m)
	}
	return msgs, rows.Err()
}

var _ relay.BatchAdvancer = (*Store)(nil)

// MarkPublishedNext implements relay.BatchAdvancer as MarkPublished and
// then NextBatch, on every database: the relay reads the bucket's next
// batch at once instead of handing the bucket back first.
//
// PostgreSQL could do both in one statement, one round trip (a
// data-modifying WITH deleting under the lease guard, and a read of the
// bucket's head that skips the deleted ids, which are still in its
// snapshot). Measured on loopback it was slower than the two statements
// at every batch size: for one message p50 1.6 ms against 0.5 for the
// delete and 0.2 for the read (a relay at 1,000 tx/s that read ahead
// after hinted batches), and 17 ms against 6 ms for 500 messages
// (BenchmarkAdvance at 9e917b8, which still had it).
// MySQL/MariaDB drivers run one statement per round trip unless
// multiStatements is set on the DSN, and SQLite has no round trip to
// save.
func (s *Store) MarkPublishedNext(ctx context.Context, relayID string, lease relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	if err := s.MarkPublished(ctx, relayID, lease, msgs); err != nil {
		return nil, err
	}
	next, err := s.NextBatch(ctx, lease.Bucket, limit)
	if err != nil {
		// Deleted, not read ahead: the relay reads with NextBatch.
		return nil, nil
	}
	if next == nil {
		next = []relay.Message{}
	}
	return next, nil
}

// leaseHeld is the lease guard used inside DELETE and UPDATE statements on
// the messages table. Its arguments: bucket, owner, term, now.
func (s *Store) leaseHeld() string {
	return "EXISTS (SELECT 1 FROM " + s.leases + " WHERE bucket = ? AND owner = ? AND term = ? AND expires_at_ms > ?)"
}

// checkLease reports ErrLeaseLost when relayID no longer holds lease.
func (s *Store) checkLease(db *gorm.DB, relayID string, lease relay.Lease) error {
	var n int64
	if err := db.Raw("SELECT COUNT(*) FROM "+s.leases+" WHERE bucket = ? AND owner = ? AND term = ? AND expires_at_ms > ?",
		lease.Bucket, relayID, lease.Term, nowMs()).Scan(&n).Error; err != nil {
		return err
	}
	if n == 0 {
		return s.lostLease(db, relayID, lease)
	}
	return nil
}

// lostLease is the error of a lease-guarded operation that found lease no
// longer held by relayID: ErrLeaseLost, and ErrLeaseRevoked too when the
// row still names relayID, unexpired, under a later term. Only the admin
// API advances a term without claiming the row (Admin.advanceTerm); a
// claim, by this relay or another, needs the lease expired or free.
func (s *Store) lostLease(db *gorm.DB, relayID string, lease relay.Lease) error {
	revoked, err := s.revokedLeases(db, relayID, []relay.Lease{lease})
	if err == nil && len(revoked) == 1 {
		return fmt.Errorf("%w: %w: bucket %d term %d: the term is now %d", relay.ErrLeaseLost, relay.ErrLeaseRevoked, lease.Bucket, lease.Term, revoked[0].Term)
	}
	return fmt.Errorf("%w: bucket %d term %d is no longer held by %s", relay.ErrLeaseLost, lease.Bucket, lease.Term, relayID)
}

var _ relay.RevocationChecker = (*Store)(nil)

// RevokedLeases implements relay.RevocationChecker: those of lost whose
// row names relayID, unexpired, under a later term, each with that term.
func (s *Store) RevokedLeases(ctx context.Context, relayID string, lost []relay.Lease) ([]relay.Lease, error) {
	db, ctx, cancel := s.op(ctx, "check revoked leases")
	defer cancel()
	out, err := s.revokedLeases(db, relayID, lost)
	if err != nil {
		return nil, s.fail(ctx, "check revoked leases", err)
	}
	return out, nil
}

func (s *Store) revokedLeases(db *gorm.DB, relayID string, lost []relay.Lease) ([]relay.Lease, error) {
	var out []relay.Lease
	for chunk := range slices.Chunk(lost, probeChunk) {
		var rows []outbox.LeaseRow
		if err := db.Raw("SELECT bucket, term FROM "+s.leases+" WHERE owner = ? AND expires_at_ms > ? AND bucket IN ?",
			relayID, nowMs(), buckets(chunk)).Scan(&rows).Error; err != nil {
			return nil, err
		}
		for _, r := range rows {
			for _, l := range chunk {
				if l.Bucket == int(r.Bucket) && r.Term > l.Term {
					out = append(out, relay.Lease{Bucket: l.Bucket, Term: r.Term})
				}
			}
		}
	}
	return out, nil
}

// MarkPublished implements relay.Store: it deletes msgs by id, in the same
// statement conditioned on relayID holding lease unexpired under its term.
func (s *Store) MarkPublished(ctx context.Context, relayID string, lease relay.Lease, msgs []relay.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	db, ctx, cancel := s.op(ctx, "delete published messages")
	defer cancel()
	ids := make([]int64, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	// PostgreSQL takes the ids as one array (see pgIDs). With one
	// parameter per id it plans the statement again at every execution,
	// which takes longer than the delete itself, and the client allocates
	// per id.
	// Chunks are deleted in order, so a refused chunk still leaves a
	// contiguous suffix of the batch pending.
	for chunk := range slices.Chunk(ids, storeChunk) {
		in, inArgs := "id IN ?", []any{chunk}
		if s.postgres {
			in, inArgs = pgIDs(lease.Bucket, chunk)
		}
		args := append(append([]any{lease.Bucket}, inArgs...), lease.Bucket, relayID, lease.Term, nowMs())
		r := db.Exec("DELETE FROM "+s.messages+" WHERE bucket = ? AND "+in+" AND "+s.leaseHeld(), args...)
		if r.Error != nil {
			return s.fail(ctx, "delete published messages", r.Error)
		}
		if r.RowsAffected == 0 {
			// Refused by the guard, or the rows are gone already (an
			// operator purged them): only the first is an error.
			if err := s.checkLease(db, relayID, lease); err != nil {
				return s.fail(ctx, "delete published messages", err)
			}
		}
	}
	return nil
}

// int8Array is a list of ids for PostgreSQL, passed as one parameter in
// the text form of an array, "{1,2,3}", which the statement casts to
// bigint[]. GORM hands a driver.Valuer to the driver as one value instead
// of expanding the slice into a parameter per element, and a text
// parameter is sent as is (pgx would parse and re-encode a bigint[] one
// element by element).
type int8Array []int64

// Value implements driver.Valuer.
func (a int8Array) Value() (driver.Value, error) {
	b := make([]byte, 0, 2+len(a)*8)
	b = append(b, '{')
	for i, v := range a {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, v, 10)
	}
	return string(append(b, '}')), nil
}

// literalIDsMin is the batch size from which PostgreSQL's deletes take
// their ids as an array literal in the statement text instead of one
// parameter. With the parameter the statement text is the same for every
// batch, so the driver prepares it once and PostgreSQL may settle on a
// generic plan: for a few ids that is the fastest (a literal is a new
// statement, prepared by the driver and planned by the server each
// time: 1.4 ms against 0.5 ms to delete one message and read the next),
// but for 500 ids the generic plan deleted 10 times slower than a
// literal (BenchmarkAdvance, two-calls/500: 62 ms against 6 ms). From
// about 128 ids the two break even.
const literalIDsMin = 128

// pgIDs returns the condition that a row of bucket has its id among ids
// in a PostgreSQL delete, and the arguments it takes: a bigint[]
// parameter below literalIDsMin ids; from there on a literal (digits and
// commas only), within the (bucket, id) of the smallest and the largest
// of the ids.
//
// The bounds are a range of the (bucket, id) index, walked once, with the
// list as a filter ("id + 0" keeps it from being an index condition): as
// an index condition PostgreSQL descends the primary key once per id, and
// bounds on id alone let it walk the primary key over the other buckets'
// rows in the span. A batch is the head of its bucket, so few other rows
// of the bucket lie in its span. The bounds change nothing to what is
// deleted: exactly the listed rows. Server CPU per deleted row, 500-id
// batches of a 100k backlog (/proc/<backend>/schedstat): with 256 buckets,
// where a bucket's rows lie one per heap page and each id descends to
// another leaf, 8.7-10.5 µs with the list as the index condition and
// 6.5-6.9 µs bounded (psql, 3 rounds; 8.0-8.6 against 6.5-6.8 through the
// store); with 8 buckets 6.7-7.4 against 5.3-6.0 µs (5.6-5.8 against
// 5.7-5.9 through the store). Small batches keep the parameter without
// bounds: a generic plan cannot know how narrow they are, and a bounded
// statement with parameters for bounds and list deleted at 34-53 µs per
// row once PostgreSQL settled on its generic plan.
func pgIDs(bucket int, ids []int64) (string, []any) {
	if len(ids) < literalIDsMin {
		return "id = ANY(CAST(CAST(? AS text) AS bigint[]))", []any{int8Array(ids)}
	}
	lit, _ := int8Array(ids).Value()
	return "(bucket, id) >= (?, ?) AND (bucket, id) <= (?, ?) AND id + 0 = ANY('" + lit.(string) + "'::bigint[])",
		[]any{bucket, slices.Min(ids), bucket, slices.Max(ids)}
}

// bucketArray is bs as a PostgreSQL int[] parameter (see int8Array).
func bucketArray(bs []int) int8Array {
	a := make(int8Array, len(bs))
	for i, b := range bs {
		a[i] = int64(b)
	}
	return a
}

// RecordFailure implements relay.FailureRecorder: it increments the
// message's attempts and stores the error text, guarded by the lease.
//
// When the error says that records may have been written although they
// were not acknowledged (publisher.Error.MaybeWritten and
// LaterMaybeWritten), the store notes it on their rows: the failed
// message's error text ends with a "may have been delivered: ..." line,
// kept through its later failures, and the later messages of the batch
// get that line as their last error (their attempts do not change). The
// line stays through the row's later failures and moves with it into the
// dead-letter table, where DeadLetter.MaybeDelivered reports it. Recording
// a failure without such a note reads the row's error text first to keep
// its line: one more statement per failure.
func (s *Store) RecordFailure(ctx context.Context, relayID string, lease relay.Lease, msg relay.Message, cause error) error {
	db, ctx, cancel := s.op(ctx, "record publish failure")
	defer cancel()
	raw := "unknown error"
	if cause != nil {
		raw = cause.Error()
	}
	maybe, later := outcomeOf(cause)
	note := ""
	if maybe {
		note = noteOutcomeUnknown
	} else {
		// Keep what an earlier failure of the row noted. Only the relay
		// holding the lease writes the row, so it cannot change between
		// this read and the guarded update.
		var old []sql.NullString
		if err := db.Raw("SELECT last_error FROM "+s.messages+" WHERE id = ? AND bucket = ?", msg.ID, lease.Bucket).Scan(&old).Error; err != nil {
			return s.fail(ctx, "record publish failure", err)
		}
		if len(old) == 1 && old[0].Valid {
			note = DeliveryNote(old[0].String)
		}
	}
	r := db.Exec("UPDATE "+s.messages+" SET attempts = attempts + 1, last_error = ? WHERE id = ? AND bucket = ? AND "+s.leaseHeld(),
		errorText(raw, note), msg.ID, lease.Bucket, lease.Bucket, relayID, lease.Term, nowMs())
	if r.Error != nil {
		return s.fail(ctx, "record publish failure", r.Error)
	}
	if r.RowsAffected == 0 {
		if err := s.checkLease(db, relayID, lease); err != nil {
			return s.fail(ctx, "record publish failure", err)
		}
	}
	for chunk := range slices.Chunk(later, storeChunk) {
		err := db.Exec("UPDATE "+s.messages+" SET last_error = ? WHERE bucket = ? AND message_id IN ?"+
			" AND (last_error IS NULL OR last_error NOT LIKE ?) AND "+s.leaseHeld(),
			noteLaterAcked(msg.MessageID), lease.Bucket, chunk, "%"+maybeDeliveredPrefix+"%",
			lease.Bucket, relayID, lease.Term, nowMs()).Error
		if err != nil {
			return s.fail(ctx, "record publish failure", err)
		}
	}
	return nil
}

func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

var _ relay.BacklogSampler = (*Store)(nil)

// SampleBacklog implements relay.BacklogSampler for metrics: the pending
// count and oldest pending message per bucket and the number of dead
// letters, with the queries of Admin.Backlog (readBacklog), and the
// paused buckets. It reads the whole messages table, so the relay runs it
// only every sampling interval, on its own goroutine and pooled
// connection, bounded by ctx.
func (s *Store) SampleBacklog(ctx context.Context) (relay.Backlog, error) {
	db, ctx, cancel := s.op(ctx, "sample backlog")
	defer cancel()
	b, err := readBacklog(db, outbox.Config{Tables: s.tables, BucketCount: s.buckets})
	if err != nil {
		return relay.Backlog{}, s.fail(ctx, "sample backlog", err)
	}
	if err := db.Raw("SELECT bucket FROM "+s.leases+" WHERE paused = ? ORDER BY bucket", true).Scan(&b.Paused).Error; err != nil {
		return relay.Backlog{}, s.fail(ctx, "sample backlog", err)
	}
	b.PausedKnown = true
	return b, nil
}

// CheckSchema verifies that the store's tables exist and have every
// column this release needs (see outbox.CheckSchema), within the store
// timeout. A missing table or column is an *outbox.SchemaError.
func (s *Store) CheckSchema(ctx context.Context) error {
	_, ctx, cancel := s.op(ctx, "check schema")
	defer cancel()
	return outbox.CheckSchema(ctx, s.db, s.tables)
}

// checkSchemaOnce runs CheckSchema until it passes once, turning a
// *SchemaError into the *relay.MisconfigurationError that stops the relay.
// AcquireLeases calls it, so the check costs one statement per table at
// relay start.
func (s *Store) checkSchemaOnce(ctx context.Context) error {
	if s.schemaOK.Load() {
		return nil
	}
	err := s.CheckSchema(ctx)
	var se *outbox.SchemaError
	if errors.As(err, &se) {
		reason := "the outbox schema is older than this release needs"
		if se.Column == "" {
			reason = "an outbox table is missing (AutoMigrate or the outbox migrations were not run)"
		}
		return &relay.MisconfigurationError{Setting: "Tables", Reason: reason, Err: se}
	}
	if err != nil {
		return err
	}
	s.schemaOK.Store(true)
	return nil
}

var _ relay.BucketCounter = (*Store)(nil)

// BucketCount implements relay.BucketCounter: the outbox's BucketCount,
// from the Config the store was made with, which relay.New takes as the
// relay's.
func (s *Store) BucketCount() int { return s.buckets }
