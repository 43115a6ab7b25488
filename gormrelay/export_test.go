package gormrelay

// PoolReadings is how many times s read its connection pool's statistics.
func PoolReadings(s *Store) int {
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	return s.pool.readings
}

// ChurnWindow is the least time one reading of the pool covers.
const ChurnWindow = churnWindow
