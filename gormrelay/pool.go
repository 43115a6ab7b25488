package gormrelay

import (
	"database/sql"
	"log/slog"
	"reflect"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox/relay"
)

// Pool tuning: a pool whose idle limit the application never set
// (database/sql's default, 2) is raised by NewStore to what a relay needs,
// PoolIdleFor(Parallelism), and raised again at the relay's first lease
// acquisition if its Parallelism needs more. A pool whose idle limit was
// set, to any value (SetMaxIdleConns(2) included), is left alone: calling
// SetMaxIdleConns before NewStore is how to opt out. An open limit
// (SetMaxOpenConns) is never changed, and database/sql caps the idle
// limit at it.
//
// database/sql does not report the idle limit, so the store reads it from
// the sql.DB's unexported maxIdleCount field (zero: never set), through
// reflect, read-only; the field has kept its name and meaning since Go
// 1.1. If a Go release renames it, the store tunes nothing and the churn
// warning below still says what to set (TestPoolIdleLimitReadable fails
// on such a release).
const (
	// PoolRelayConns is what a relay needs besides its drainers: its lease
	// keeper's acquisition and renewal, and its backlog sampler.
	PoolRelayConns = 3
	// PoolAppConns is what the store leaves idle for the application
	// sharing the pool: more than database/sql's default 2.
	PoolAppConns = 5
)

// PoolIdleFor returns the idle limit the store gives an untuned pool for a
// relay with the given Parallelism: parallelism + PoolRelayConns +
// PoolAppConns, 16 at relay.ParallelismDefault.
func PoolIdleFor(parallelism int) int {
	if parallelism <= 0 {
		parallelism = relay.ParallelismDefault
	}
	return parallelism + PoolRelayConns + PoolAppConns
}

// idleLimitSet reports whether the pool's idle limit was set by
// SetMaxIdleConns (or SetMaxOpenConns below it); known is false when it
// cannot be read.
func idleLimitSet(db *sql.DB) (set, known bool) {
	f := reflect.ValueOf(db).Elem().FieldByName("maxIdleCount")
	if !f.IsValid() || f.Kind() != reflect.Int {
		return false, false
	}
	return f.Int() != 0, true
}

// tunePool raises the idle limit of the store's pool to
// PoolIdleFor(parallelism) if the store owns its tuning: the limit was
// unset when NewStore first saw the pool, and this store set it since.
// It logs each change once at Debug: raising an untuned pool's limit is
// what the store documents it does, at every start of a relay and every
// outboxtest.Drain, and the application has nothing to act on. What is
// worth telling, a pool whose limit still makes it close connections, is
// the churn warning (watchPool), at Warn.
func (s *Store) tunePool(parallelism int) {
	sqlDB, err := s.db.DB()
	if err != nil {
		return // not a *sql.DB pool (a transaction, a custom ConnPool)
	}
	want := PoolIdleFor(parallelism)
	w := &s.pool
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.tunedIdle == 0 {
		if w.untouchable {
			return
		}
		set, known := idleLimitSet(sqlDB)
		if set || !known {
			w.untouchable = true
			return
		}
	} else if want <= w.tunedIdle {
		return
	}
	from := w.tunedIdle
	w.tunedIdle = want
	sqlDB.SetMaxIdleConns(want)
	if from == 0 {
		s.logger.Debug("outbox: raised the connection pool's idle limit from database/sql's default 2, so that the relay's drainers reuse connections instead of opening a database session per statement; "+
			"call sql.DB.SetMaxIdleConns yourself before creating the store to choose another value",
			slog.Int("max_idle_conns", want), slog.Int("parallelism", max(parallelism, 1)),
			slog.Int("max_open_conns", sqlDB.Stats().MaxOpenConnections))
		return
	}
	s.logger.Debug("outbox: raised the connection pool's idle limit for the relay's Parallelism",
		slog.Int("from", from), slog.Int("max_idle_conns", want), slog.Int("parallelism", parallelism))
}

// Pool churn: database/sql keeps at most MaxIdleConns idle connections (2
// unless the application sets it) and closes every connection returned
// beyond that. The relay's drainers each take a connection for one
// statement at a time, so a busy relay with more drainers than idle slots
// closes a connection after most statements and opens a new one for the
// next: a new database session per statement (a new backend process on
// PostgreSQL, statements prepared again). On two cores that cut the drain
// rate by a third and raised the commit-to-consumer p99 from a few
// milliseconds to over 100 (BENCHMARKS.md, "The connection pool's idle
// limit"). Nothing in database/sql reports the setting, only the count of
// connections it closed for it (DBStats.MaxIdleClosed), so the store
// watches that count at each lease maintenance and warns.

const (
	// churnWindow is the least time a reading covers: readings closer
	// to the last one are deferred to the next.
	churnWindow = 2 * time.Second
	// churnMinClosed and churnMinRate are the least connections closed
	// at the idle limit over a reading, in total and per second, for the
	// store to warn.
	churnMinClosed = 10
	churnMinRate   = 1.0
	// churnWarnEvery spaces the warnings.
	churnWarnEvery = time.Hour
)

// poolWatch holds the last reading of the pool's MaxIdleClosed, taken at
// at (zero before the first).
type poolWatch struct {
	mu     sync.Mutex
	at     time.Time
	closed int64
	// nextWarn: no warning before.
	nextWarn time.Time
	// readings counts the readings, for tests.
	readings int
	// tunedIdle is the idle limit this store set (tunePool); 0 if none.
	tunedIdle int
	// untouchable: the application set the idle limit, or it cannot be
	// read; the store never changes it.
	untouchable bool
}

// watchPool reads the connection pool's count of connections closed at
// its idle limit and warns when it grew fast since the last reading. The
// relay calls AcquireLeases about every LeaseRenewInterval (10 s by
// default); readings less than churnWindow apart are merged.
func (s *Store) watchPool() {
	sqlDB, err := s.db.DB()
	if err != nil {
		return // not a *sql.DB pool (a transaction, a custom ConnPool)
	}
	st := sqlDB.Stats()
	now := time.Now()
	w := &s.pool
	w.mu.Lock()
	defer w.mu.Unlock()
	w.readings++
	if w.at.IsZero() {
		w.at, w.closed = now, st.MaxIdleClosed
		return
	}
	d := now.Sub(w.at)
	if d < churnWindow {
		return
	}
	n := st.MaxIdleClosed - w.closed
	w.at, w.closed = now, st.MaxIdleClosed
	if n < churnMinClosed || float64(n)/d.Seconds() < churnMinRate {
		return
	}
	if !due(&w.nextWarn, now, churnWarnEvery) {
		return
	}
	s.logger.Warn("outbox: the connection pool closed connections at its idle limit; each one is reopened as a new database session when next needed, "+
		"which slows the relay's drainers and the application: set sql.DB.SetMaxIdleConns to at least the relay's Parallelism plus 3, "+
		"plus what the application uses at once (docs/operations.md, \"Drainers and the connection pool\")",
		"closed_at_idle_limit", n, "seconds", d.Round(time.Millisecond).Seconds(),
		"open", st.OpenConnections, "in_use", st.InUse, "idle", st.Idle)
}
