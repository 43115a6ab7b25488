package gormrelay

import "time"

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
