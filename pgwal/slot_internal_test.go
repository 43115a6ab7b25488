package pgwal

import (
	"testing"

	"github.com/jackc/pglogrepl"

	"github.com/stretchr/testify/require"
)

// TestCheckSlot: a slot invalidated by max_slot_wal_keep_size, dropped,
// or dropped and created again is a *SlotLostError; a slot never read is
// created; a healthy one is read.
func TestCheckSlot(t *testing.T) {
	for _, c := range []struct {
		name     string
		st       SlotStatus
		recorded uint64
		exists   bool
		lost     string
	}{
		{name: "new", st: SlotStatus{}, exists: false},
		{name: "healthy", st: SlotStatus{Exists: true, Confirmed: 100, WALStatus: "reserved"}, recorded: 100, exists: true},
		{name: "behind the record", st: SlotStatus{Exists: true, Confirmed: 90, WALStatus: "reserved"}, recorded: 100, exists: true},
		{name: "dropped", st: SlotStatus{}, recorded: 100, lost: "dropped"},
		{name: "invalidated", st: SlotStatus{Exists: true, Confirmed: 100, WALStatus: "lost"}, recorded: 100, exists: true, lost: "max_slot_wal_keep_size"},
		{name: "recreated", st: SlotStatus{Exists: true, Confirmed: 500, WALStatus: "reserved"}, recorded: 100, exists: true, lost: "created again"},
	} {
		t.Run(c.name, func(t *testing.T) {
			exists, err := checkSlot(c.st, "s", lsn(c.recorded))
			require.Equal(t, c.exists, exists)
			if c.lost == "" {
				require.NoError(t, err)
				return
			}
			var le *SlotLostError
			require.ErrorAs(t, err, &le)
			require.ErrorIs(t, err, ErrSlotLost)
			require.Contains(t, err.Error(), c.lost)
			require.Contains(t, err.Error(), "pg_drop_replication_slot('s')")
		})
	}
}

func lsn(v uint64) pglogrepl.LSN { return pglogrepl.LSN(v) }
