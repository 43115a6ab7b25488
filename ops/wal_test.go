package ops_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/ops"
)

// TestCheckWAL: each unhealthy state of a slot is named by its reason; a
// lease free for less than the lease duration, a released lease first
// seen free just now, and retained WAL under the bound (or unbounded)
// are healthy.
func TestCheckWAL(t *testing.T) {
	t.Parallel()
	now := time.Now()
	healthy := ops.WALStatus{Slot: "s", Exists: true, Active: true, RetainedBytes: 100, LeaseDurationMs: 10_000,
		Reader: ops.WALReader{Owner: "r", Term: 3, ExpiresAt: now.Add(5 * time.Second), Held: true}}
	for _, c := range []struct {
		name   string
		change func(*ops.WALStatus, *ops.WALHealth)
		reason string
	}{
		{"healthy", func(*ops.WALStatus, *ops.WALHealth) {}, ""},
		{"lost", func(s *ops.WALStatus, _ *ops.WALHealth) { s.Lost, s.LostReason = true, "wal_status lost" }, ops.WALReasonSlotLost},
		{"another database's", func(s *ops.WALStatus, _ *ops.WALHealth) { s.Foreign = "slot of database inventory" }, ops.WALReasonSlotForeign},
		{"missing", func(s *ops.WALStatus, _ *ops.WALHealth) { s.Exists = false }, ops.WALReasonSlotMissing},
		{"retained over the default", func(s *ops.WALStatus, _ *ops.WALHealth) { s.RetainedBytes = ops.WALMaxRetainedBytesDefault + 1 }, ops.WALReasonRetainedWAL},
		{"retained at the default", func(s *ops.WALStatus, _ *ops.WALHealth) { s.RetainedBytes = ops.WALMaxRetainedBytesDefault }, ""},
		{"retained over a bound", func(s *ops.WALStatus, h *ops.WALHealth) { h.MaxRetainedBytes = 99 }, ops.WALReasonRetainedWAL},
		{"retained unbounded", func(s *ops.WALStatus, h *ops.WALHealth) { s.RetainedBytes, h.MaxRetainedBytes = 1<<40, -1 }, ""},
		{"expired for less than the lease", func(s *ops.WALStatus, _ *ops.WALHealth) {
			s.Reader.Held, s.Reader.ExpiresAt = false, now.Add(-9*time.Second)
		}, ""},
		{"expired for longer than the lease", func(s *ops.WALStatus, _ *ops.WALHealth) {
			s.Reader.Held, s.Reader.ExpiresAt = false, now.Add(-11*time.Second)
		}, ops.WALReasonNoReader},
		{"released, first seen free just now", func(s *ops.WALStatus, h *ops.WALHealth) {
			s.Reader = ops.WALReader{Term: 3}
			h.NoReaderSince = now
		}, ""},
		{"released, free for longer than the lease", func(s *ops.WALStatus, h *ops.WALHealth) {
			s.Reader = ops.WALReader{Term: 3}
			h.NoReaderSince = now.Add(-11 * time.Second)
		}, ops.WALReasonNoReader},
		{"never held, not tracked", func(s *ops.WALStatus, _ *ops.WALHealth) { s.Reader = ops.WALReader{} }, ""},
	} {
		st, h := healthy, ops.WALHealth{}
		c.change(&st, &h)
		err := ops.CheckWAL(st, h, now)
		if c.reason == "" {
			require.NoError(t, err, c.name)
			continue
		}
		var we *ops.WALUnhealthyError
		require.ErrorAs(t, err, &we, c.name)
		require.ErrorIs(t, err, ops.ErrWALUnhealthy, c.name)
		require.Equal(t, c.reason, we.Reason, c.name)
		require.Contains(t, err.Error(), "outbox: WAL slot s: ", c.name)
	}
}
