package pgwal

import (
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"

	"github.com/stretchr/testify/require"
)

// TestCheckSlot: a slot invalidated by max_slot_wal_keep_size, dropped,
// or dropped and created again is a *SlotLostError whose advice drops
// only a slot of this database; a slot of another database, physical or
// of another plugin is a *SlotForeignError that never advises dropping
// it; a slot never read is created; a healthy one is read.
func TestCheckSlot(t *testing.T) {
	ours := func(st SlotStatus) SlotStatus {
		st.Exists, st.Database, st.Plugin, st.Type, st.Current = true, "inventory", "pgoutput", "logical", "inventory"
		return st
	}
	for _, c := range []struct {
		name     string
		st       SlotStatus
		recorded uint64
		exists   bool
		lost     string
		foreign  string
		creating string
	}{
		{name: "new", st: SlotStatus{}, exists: false},
		{name: "healthy", st: ours(SlotStatus{Confirmed: 100, WALStatus: "reserved"}), recorded: 100, exists: true},
		{name: "behind the record", st: ours(SlotStatus{Confirmed: 90, WALStatus: "reserved"}), recorded: 100, exists: true},
		{name: "dropped", st: SlotStatus{}, recorded: 100, lost: "dropped"},
		{name: "invalidated", st: ours(SlotStatus{Confirmed: 100, WALStatus: "lost"}), recorded: 100, exists: true, lost: "max_slot_wal_keep_size"},
		{name: "recreated", st: ours(SlotStatus{Confirmed: 500, WALStatus: "reserved"}), recorded: 100, exists: true, lost: "created again"},
		{name: "another database", st: SlotStatus{Exists: true, Confirmed: 500, WALStatus: "reserved", Database: "inventory", Plugin: "pgoutput", Type: "logical", Current: "inv2"},
			recorded: 100, exists: true, foreign: `in database "inventory", not a pgoutput slot of this database "inv2"`},
		{name: "another database never read", st: SlotStatus{Exists: true, Database: "inventory", Plugin: "pgoutput", Type: "logical", Current: "inv2"},
			exists: true, foreign: `database "inventory"`},
		{name: "another plugin", st: SlotStatus{Exists: true, Database: "inv2", Plugin: "wal2json", Type: "logical", Current: "inv2"},
			exists: true, foreign: `plugin "wal2json"`},
		{name: "being created", st: SlotStatus{Exists: true, Active: true, ActivePID: 4242, Creating: true, Database: "inv2", Plugin: "pgoutput", Type: "logical", Current: "inv2"},
			exists: true, creating: "by server process 4242"},
		{name: "physical", st: SlotStatus{Exists: true, Type: "physical", Current: "inv2"}, exists: true, foreign: "is a physical slot"},
	} {
		t.Run(c.name, func(t *testing.T) {
			exists, err := checkSlot(c.st, "outbox_orders", lsn(c.recorded))
			require.Equal(t, c.exists, exists)
			switch {
			case c.lost != "":
				var le *SlotLostError
				require.ErrorAs(t, err, &le)
				require.ErrorIs(t, err, ErrSlotLost)
				require.Contains(t, err.Error(), c.lost)
				require.Contains(t, err.Error(), "Admin.DropSlot with force")
				require.NotContains(t, err.Error(), "pg_drop_replication_slot")
			case c.foreign != "":
				var fe *SlotForeignError
				require.ErrorAs(t, err, &fe)
				require.ErrorIs(t, err, ErrSlotForeign)
				require.NotErrorIs(t, err, ErrSlotLost)
				require.Contains(t, err.Error(), c.foreign)
				require.Contains(t, err.Error(), `pgwal.Config{Slot: "outbox_orders_inv2"} (outboxctl --wal-slot outbox_orders_inv2)`)
				require.Contains(t, err.Error(), "do not drop it")
				require.NotContains(t, err.Error(), "pg_drop_replication_slot")
			case c.creating != "":
				require.ErrorIs(t, err, ErrSlotBeingCreated)
				require.Contains(t, err.Error(), c.creating)
			default:
				require.NoError(t, err)
			}
		})
	}
}

// TestSlotForeignSuggested: the suggested slot name is a valid slot name
// of at most 63 characters that ends with the database's name.
func TestSlotForeignSuggested(t *testing.T) {
	long := "outbox_" + strings.Repeat("a", 56)
	for _, c := range []struct{ slot, current, want string }{
		{"outbox_orders", "inv2", "outbox_orders_inv2"},
		{"outbox_orders", "Inv-2", "outbox_orders_inv_2"},
		{long, "inventory", long[:53] + "_inventory"},
		{"s", strings.Repeat("d", 70), "s_" + strings.Repeat("d", 56)},
	} {
		got := (&SlotForeignError{Slot: c.slot, Current: c.current}).Suggested()
		require.Equal(t, c.want, got)
		require.Regexp(t, slotRE, got)
	}
}

func lsn(v uint64) pglogrepl.LSN { return pglogrepl.LSN(v) }
