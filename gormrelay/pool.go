package gormrelay

import (
	"sync"
	"time"
)

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
