package gormrelay

import (
	"time"

	"github.com/gorm-outbox/outbox/relay"
)

// IdleLimitSet is idleLimitSet.
var IdleLimitSet = idleLimitSet

// TunedIdle is the idle limit s set on its pool; 0 if none.
func TunedIdle(s *Store) int {
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	return s.pool.tunedIdle
}

// PoolReadings is how many times s read its connection pool's statistics.
func PoolReadings(s *Store) int {
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	return s.pool.readings
}

// ChurnWindow is the least time one reading of the pool covers.
const ChurnWindow = churnWindow

// Analyzed is how many times s analyzed its messages table because the
// planner's estimate was stale.
func Analyzed(s *Store) int {
	s.estimate.mu.Lock()
	defer s.estimate.mu.Unlock()
	return s.estimate.analyses
}

// EstimateChecks is how many times s checked the planner's estimate.
func EstimateChecks(s *Store) int {
	s.estimate.mu.Lock()
	defer s.estimate.mu.Unlock()
	return s.estimate.checks
}

// SetEstimateClock makes s read the time of its estimate checks from now.
func SetEstimateClock(s *Store, now func() time.Time) {
	s.estimate.mu.Lock()
	defer s.estimate.mu.Unlock()
	s.estimate.now = now
}

// LateBeat runs the first statement of relay me's heartbeat, as the
// database runs one the relay abandoned on its cancelled context, and
// returns the rows it updated.
func LateBeat(s *Store, me string) (int64, error) {
	r := s.beat(s.db, me, nowMs())
	return r.RowsAffected, r.Error
}

// LateClaim runs relay me's claim of candidates (the buckets and terms
// its acquisition read) for lease, as the database runs one the relay
// abandoned on its cancelled context, and returns what it claimed.
func LateClaim(s *Store, me string, candidates []relay.Lease, lease time.Duration) ([]relay.Lease, error) {
	now := nowMs()
	return s.claim(s.db, me, candidates, now, now+lease.Milliseconds())
}
