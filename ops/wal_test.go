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

// TestCheckWALNoReaderText: the no_reader detail says what the probe
// knows: since when no reader was seen holding the lease (its expiry, or
// the first probe that found it released), and the last owner the lease
// row names.
func TestCheckWALNoReaderText(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	st := ops.WALStatus{Slot: "s", Exists: true, LeaseDurationMs: 10_000}
	detail := func(r ops.WALReader, h ops.WALHealth) string {
		s := st
		s.Reader = r
		var we *ops.WALUnhealthyError
		require.ErrorAs(t, ops.CheckWAL(s, h, now), &we)
		require.Equal(t, ops.WALReasonNoReader, we.Reason)
		return we.Detail
	}
	require.Equal(t, "no reader seen holding the slot's lease since it expired at 2026-01-02T03:03:50Z (15s ago, over the lease duration 10s); last owner r",
		detail(ops.WALReader{Owner: "r", Term: 3, ExpiresAt: now.Add(-15 * time.Second)}, ops.WALHealth{}))
	require.Equal(t, "no reader seen holding the slot's lease since the first probe that found it free, 2026-01-02T03:03:53Z (12s ago, over the lease duration 10s); last owner r",
		detail(ops.WALReader{Owner: "r", Term: 3}, ops.WALHealth{NoReaderSince: now.Add(-12 * time.Second)}))
	require.Contains(t, detail(ops.WALReader{Term: 3}, ops.WALHealth{NoReaderSince: now.Add(-12 * time.Second)}),
		"; last owner unknown (the lease row does not name it)")
	require.Contains(t, detail(ops.WALReader{}, ops.WALHealth{NoReaderSince: now.Add(-12 * time.Second)}), "; no reader ever took it")
}
