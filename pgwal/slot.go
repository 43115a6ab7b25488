package pgwal

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
	"gorm.io/gorm"
)

// ErrSlotLost is wrapped by every *SlotLostError.
var ErrSlotLost = errors.New("pgwal: the replication slot lost WAL that held outbox messages")

// SlotLostError stops the reader when the slot can no longer deliver every
// message written since the reader last confirmed a position: PostgreSQL
// invalidated it (wal_status "lost", max_slot_wal_keep_size exceeded), or
// it was dropped (and perhaps created again). Messages committed between
// Confirmed and the slot's current position may never be published. Run
// returns it and does not read past the gap.
type SlotLostError struct {
	Slot string
	// Confirmed is the last position this outbox's readers confirmed.
	Confirmed pglogrepl.LSN
	// Reason says what was found.
	Reason string
}

func (e *SlotLostError) Error() string {
	return fmt.Sprintf("pgwal: slot %s: %s; messages committed after %s may be lost: compare the source tables with what the consumers received, "+
		"then drop the slot, its publication and its lease row (Admin.DropSlot with force, or outboxctl --mode wal --wal-slot %s wal slot drop --force with the outbox's --prefix if it has one; both drop only a slot of this database) "+
		"so that the next Run creates it again from the current position",
		e.Slot, e.Reason, e.Confirmed, e.Slot)
}

// Unwrap returns ErrSlotLost.
func (e *SlotLostError) Unwrap() error { return ErrSlotLost }

// ErrSlotForeign is wrapped by every *SlotForeignError.
var ErrSlotForeign = errors.New("pgwal: the replication slot belongs to another database or is not a pgoutput logical slot")

// SlotForeignError refuses a slot of the configured name that this
// outbox cannot use: replication slot names are unique per PostgreSQL
// server, not per database, and the slot found is another database's,
// physical, or of another output plugin. Run (without retrying),
// EnsureSlot, PublishedThrough, and the Admin's EnsureSlot, Unconfirmed
// and DropSlot (even with force) return it and leave the slot untouched:
// it is likely another service's, which dropping it would break; the
// Admin's WALStatus reports it in ops.WALStatus.Foreign. Give this
// outbox a slot name of its own (Config.Slot).
type SlotForeignError struct {
	Slot string
	// Database is the slot's database (pg_replication_slots.database;
	// empty for a physical slot), Plugin its output plugin and Type
	// "logical" or "physical".
	Database, Plugin, Type string
	// Current is the database this outbox writes to.
	Current string
}

func (e *SlotForeignError) Error() string {
	what := fmt.Sprintf("a %s slot of plugin %q in database %q", e.Type, e.Plugin, e.Database)
	if e.Type != "logical" {
		what = "a " + e.Type + " slot"
	}
	return fmt.Sprintf("pgwal: slot %s is %s, not a pgoutput slot of this database %q: slot names are unique per server, so the slot is not this outbox's "+
		"(do not drop it: it likely belongs to another service); give this outbox a slot of its own, "+
		"pgwal.Config{Slot: %q} (outboxctl --wal-slot %s)",
		e.Slot, what, e.Current, e.Suggested(), e.Suggested())
}

// Suggested is a slot name for this outbox: the slot's name followed by
// the database's name, reduced to the characters a slot name allows.
func (e *SlotForeignError) Suggested() string {
	s := []byte(slotName(e.Current))[len("outbox_"):]
	n := min(len(e.Slot), 62-len(s))
	return e.Slot[:n] + "_" + string(s)
}

// Unwrap returns ErrSlotForeign.
func (e *SlotForeignError) Unwrap() error { return ErrSlotForeign }

// ErrSlotBeingCreated is returned by EnsureSlot, the Admin's EnsureSlot
// and a reader's term (which Run retries) while a server process is
// creating the slot: it is listed in pg_replication_slots, but until its
// snapshot is built (after every transaction open on the server ended)
// it has no confirmed position and may still fail, leaving no slot.
// Messages written before it is created are in no slot.
var ErrSlotBeingCreated = errors.New("pgwal: the replication slot is being created")

// SlotStatus is what pg_replication_slots says about the slot.
type SlotStatus struct {
	Exists bool
	// Database is the slot's database (empty for a physical slot), Plugin
	// its output plugin and Type "logical" or "physical"; Current is the
	// database ReadSlotStatus connected to. A slot of another database,
	// type or plugin is refused with a *SlotForeignError.
	Database, Plugin, Type, Current string
	// Confirmed is the slot's confirmed_flush_lsn: everything committed
	// before it was published.
	Confirmed pglogrepl.LSN
	// RetainedBytes is the WAL the server keeps for the slot,
	// pg_current_wal_lsn() - confirmed_flush_lsn.
	RetainedBytes int64
	// WALStatus is pg_replication_slots.wal_status: reserved, extended,
	// unreserved or lost.
	WALStatus string
	// Active reports whether a reader is connected, or a server process
	// creates the slot; ActivePID is that process
	// (pg_replication_slots.active_pid).
	Active    bool
	ActivePID int64
	// Creating reports a logical slot being created: listed, active, and
	// without a confirmed position until its creation ends.
	Creating bool
}

// ReadSlotStatus reads the status of slot through db.
func ReadSlotStatus(ctx context.Context, db *gorm.DB, slot string) (SlotStatus, error) {
	var rows []struct {
		Confirmed *string
		Retained  *int64
		WALStatus *string
		Active    bool
		ActivePID *int64 `gorm:"column:active_pid"`
		Database  *string
		Plugin    *string
		SlotType  string
		Current   string
	}
	err := db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true}).Raw(
		"SELECT confirmed_flush_lsn::text AS confirmed, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS retained, wal_status, active, active_pid,"+
			" database::text AS database, plugin::text AS plugin, slot_type, current_database()::text AS current"+
			" FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&rows).Error
	if err != nil || len(rows) == 0 {
		return SlotStatus{}, err
	}
	r := rows[0]
	st := SlotStatus{Exists: true, Active: r.Active, Type: r.SlotType, Current: r.Current}
	if r.Database != nil {
		st.Database = *r.Database
	}
	if r.ActivePID != nil {
		st.ActivePID = *r.ActivePID
	}
	st.Creating = r.SlotType == "logical" && r.Confirmed == nil && r.Active
	if r.Plugin != nil {
		st.Plugin = *r.Plugin
	}
	if r.Confirmed != nil {
		if st.Confirmed, err = pglogrepl.ParseLSN(*r.Confirmed); err != nil {
			return SlotStatus{}, err
		}
	}
	if r.Retained != nil {
		st.RetainedBytes = *r.Retained
	}
	if r.WALStatus != nil {
		st.WALStatus = *r.WALStatus
	}
	return st, nil
}

// foreign returns a *SlotForeignError when the slot exists and is not a
// pgoutput logical slot of the current database, else nil.
func (st SlotStatus) foreign(slot string) error {
	if !st.Exists || (st.Type == "logical" && st.Plugin == "pgoutput" && st.Database == st.Current) {
		return nil
	}
	return &SlotForeignError{Slot: slot, Database: st.Database, Plugin: st.Plugin, Type: st.Type, Current: st.Current}
}

// checkSlot fails with a *SlotForeignError when the slot is not this
// database's pgoutput slot, with ErrSlotBeingCreated while a server
// process creates it, and with a *SlotLostError when it lost WAL or
// was dropped since this outbox's readers recorded confirmed (0: never
// read). It reports whether the slot exists.
func checkSlot(st SlotStatus, slot string, confirmed pglogrepl.LSN) (bool, error) {
	if err := st.foreign(slot); err != nil {
		return true, err
	}
	if st.Creating {
		return true, fmt.Errorf("%w: %s, by server process %d, which waits for the transactions open on the server to end; "+
			"wait, or cancel it (SELECT pg_cancel_backend(%d)) when its creator is gone", ErrSlotBeingCreated, slot, st.ActivePID, st.ActivePID)
	}
	switch {
	case !st.Exists && confirmed == 0:
		return false, nil
	case !st.Exists:
		return false, &SlotLostError{Slot: slot, Confirmed: confirmed, Reason: "the slot does not exist any more (dropped)"}
	case st.WALStatus == "lost":
		return true, &SlotLostError{Slot: slot, Confirmed: confirmed, Reason: "PostgreSQL invalidated the slot (wal_status lost: max_slot_wal_keep_size exceeded)"}
	case confirmed != 0 && st.Confirmed > confirmed:
		return true, &SlotLostError{Slot: slot, Confirmed: confirmed,
			Reason: fmt.Sprintf("the slot's confirmed position %s is beyond the last one its readers confirmed: it was dropped and created again", st.Confirmed)}
	}
	return true, nil
}
