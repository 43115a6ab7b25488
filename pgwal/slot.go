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
		"then drop the slot (SELECT pg_drop_replication_slot('%s')) and delete its lease row so that the next Run creates it again from the current position",
		e.Slot, e.Reason, e.Confirmed, e.Slot)
}

// Unwrap returns ErrSlotLost.
func (e *SlotLostError) Unwrap() error { return ErrSlotLost }

// SlotStatus is what pg_replication_slots says about the slot.
type SlotStatus struct {
	Exists bool
	// Confirmed is the slot's confirmed_flush_lsn: everything committed
	// before it was published.
	Confirmed pglogrepl.LSN
	// RetainedBytes is the WAL the server keeps for the slot,
	// pg_current_wal_lsn() - confirmed_flush_lsn.
	RetainedBytes int64
	// WALStatus is pg_replication_slots.wal_status: reserved, extended,
	// unreserved or lost.
	WALStatus string
	// Active reports whether a reader is connected.
	Active bool
}

// ReadSlotStatus reads the status of slot through db.
func ReadSlotStatus(ctx context.Context, db *gorm.DB, slot string) (SlotStatus, error) {
	var rows []struct {
		Confirmed *string
		Retained  *int64
		WALStatus *string
		Active    bool
	}
	err := db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true}).Raw(
		"SELECT confirmed_flush_lsn::text AS confirmed, (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint AS retained, wal_status, active"+
			" FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&rows).Error
	if err != nil || len(rows) == 0 {
		return SlotStatus{}, err
	}
	r := rows[0]
	st := SlotStatus{Exists: true, Active: r.Active}
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

// checkSlot fails with a *SlotLostError when the slot lost WAL or was
// dropped since this outbox's readers recorded confirmed (0: never read).
// It reports whether the slot exists.
func checkSlot(st SlotStatus, slot string, confirmed pglogrepl.LSN) (bool, error) {
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
