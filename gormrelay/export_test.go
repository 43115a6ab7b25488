package gormrelay

// PoolReadings is how many times s read its connection pool's statistics.
func PoolReadings(s *Store) int {
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	return s.pool.readings
}
