package ops

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// WALStatus is the state of an outbox in WAL mode (outbox.ModeWAL): its
// logical replication slot, the reader that holds the slot's lease, and
// how far the reader is behind. Status.WAL carries it; a WALOperator
// reads it alone, cheaply enough for a health probe.
type WALStatus struct {
	// Slot is the replication slot's name.
	Slot string `json:"slot"`
	// Exists reports whether pg_replication_slots has the slot.
	Exists bool `json:"exists"`
	// Active reports whether a reader is connected to the slot.
	Active bool `json:"active"`
	// Lost reports a slot that can no longer deliver every message: it is
	// missing although a reader used it before, PostgreSQL invalidated it
	// (wal_status lost), or it was dropped and created again. LostReason
	// says which. A slot never created yet is missing but not lost.
	Lost       bool   `json:"lost"`
	LostReason string `json:"lost_reason,omitempty"`
	// Foreign, when not empty, says why the slot of this name cannot be
	// this outbox's: slot names are unique per server, and it belongs to
	// another database or is not a pgoutput logical slot. Its position,
	// retained WAL and state are then left out: they are not this
	// outbox's.
	Foreign string `json:"foreign,omitempty"`
	// WALState is pg_replication_slots.wal_status: reserved, extended,
	// unreserved or lost.
	WALState string `json:"wal_status,omitempty"`
	// ConfirmedLSN is the slot's confirmed_flush_lsn: every message
	// committed before it was published or dead-lettered. CurrentLSN is
	// pg_current_wal_lsn() at the read.
	ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
	CurrentLSN   string `json:"current_lsn,omitempty"`
	// RetainedBytes is the lag in bytes: the WAL the server keeps for the
	// slot, CurrentLSN - ConfirmedLSN.
	RetainedBytes int64 `json:"retained_bytes"`
	// Reader is the slot's lease: the reader elected to read it.
	Reader WALReader `json:"reader"`
	// LeaseDurationMs is the readers' lease duration (pgwal
	// Config.LeaseDuration).
	LeaseDurationMs int64 `json:"lease_duration_ms"`
	// Oldest is the creation time of the oldest message not yet published
	// (or dead-lettered), as LagSource tells; zero when none is known.
	// LagAgeMs is its age at the read: the lag in time.
	Oldest   time.Time `json:"oldest,omitzero"`
	LagAgeMs int64     `json:"lag_age_ms"`
	// LagSource says where Oldest comes from: "reader", the queues of the
	// reader running in this process (the oldest message it decoded and
	// has not published or dead-lettered); "lease", the same as the
	// reader holding the slot's lease, in any process, recorded in its
	// lease row at its last renewal (at most a standby interval old; no
	// Oldest and LagAgeMs 0 when it held none); "slot", the oldest
	// unconfirmed message read from the inactive slot without consuming
	// it; "" when none was available (no reader holds the lease, or its
	// term has not read yet the WAL written before it began).
	LagSource string `json:"lag_source,omitempty"`
}

// WALReader is the lease row that elects the one reader of a slot.
type WALReader struct {
	// Owner is the reader holding or last holding the lease (a reader
	// that released it stays named, with ExpiresAt zero); empty when it
	// was never taken.
	Owner string `json:"owner,omitempty"`
	// Term counts the lease's acquisitions.
	Term int64 `json:"term"`
	// ExpiresAt is when the lease lapses unless renewed; zero when free.
	ExpiresAt time.Time `json:"expires_at,omitzero"`
	// Held reports an owner whose lease had not expired at the read.
	Held bool `json:"held"`
	// ConfirmedLSN is the position the reader last recorded as confirmed.
	ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
}

// LagAge is the lag in time at the read; zero when unknown (LagSource "").
func (w WALStatus) LagAge() time.Duration { return time.Duration(w.LagAgeMs) * time.Millisecond }

// WALOperator is an Operator of an outbox in WAL mode. Its Status
// carries WALStatus in Status.WAL, its requeues emit the dead letters
// into the WAL again (each key's dead letters in their original order),
// and it has no per-bucket pause: PauseBucket and ResumeBucket fail with
// ErrInvalidRequest. pgwal.Admin implements it.
type WALOperator interface {
	Operator
	// WALStatus reads the slot and its lease: two short queries.
	WALStatus(ctx context.Context) (WALStatus, error)
}

// WALHealth bounds what CheckWAL accepts.
type WALHealth struct {
	// MaxRetainedBytes is the retained WAL above which the slot is
	// unhealthy. Default WALMaxRetainedBytesDefault; negative disables the
	// check.
	MaxRetainedBytes int64
	// NoReaderSince is when the probe first saw the lease held by nobody
	// (zero: it has not, or does not track it). An expired lease counts
	// from its expiry; a released one, which records no time, from
	// NoReaderSince.
	NoReaderSince time.Time
}

// WALMaxRetainedBytesDefault is WALHealth.MaxRetainedBytes' default: 1 GiB.
const WALMaxRetainedBytesDefault = 1 << 30

// ErrWALUnhealthy is wrapped by every *WALUnhealthyError.
var ErrWALUnhealthy = errors.New("outbox: WAL mode slot unhealthy")

// WALUnhealthyError says why an outbox in WAL mode is not being
// delivered.
type WALUnhealthyError struct {
	Slot string
	// Reason is "slot_lost", "slot_missing", "retained_wal" or
	// "no_reader".
	Reason string
	// Detail says what was found, in plain words.
	Detail string
}

func (e *WALUnhealthyError) Error() string {
	return fmt.Sprintf("outbox: WAL slot %s: %s", e.Slot, e.Detail)
}

// Unwrap returns ErrWALUnhealthy.
func (e *WALUnhealthyError) Unwrap() error { return ErrWALUnhealthy }

// WAL health reasons (WALUnhealthyError.Reason).
const (
	WALReasonSlotLost    = "slot_lost"
	WALReasonSlotForeign = "slot_foreign"
	WALReasonSlotMissing = "slot_missing"
	WALReasonRetainedWAL = "retained_wal"
	WALReasonNoReader    = "no_reader"
)

// CheckWAL returns a *WALUnhealthyError when st, read at now, shows an
// outbox in WAL mode that is not being delivered: the slot is lost or
// missing or another database's, it retains more WAL than h.MaxRetainedBytes, or no reader has
// held its lease for longer than the lease duration. It returns nil
// otherwise.
func CheckWAL(st WALStatus, h WALHealth, now time.Time) error {
	bad := func(reason, format string, args ...any) error {
		return &WALUnhealthyError{Slot: st.Slot, Reason: reason, Detail: fmt.Sprintf(format, args...)}
	}
	maxRetained := h.MaxRetainedBytes
	if maxRetained == 0 {
		maxRetained = WALMaxRetainedBytesDefault
	}
	switch {
	case st.Foreign != "":
		return bad(WALReasonSlotForeign, "%s", st.Foreign)
	case st.Lost:
		return bad(WALReasonSlotLost, "the slot is lost: %s", st.LostReason)
	case !st.Exists:
		return bad(WALReasonSlotMissing, "the slot does not exist: no message written is kept for the readers; create it (pgwal EnsureSlot, outboxctl wal slot create) before writing in WAL mode")
	case maxRetained > 0 && st.RetainedBytes > maxRetained:
		return bad(WALReasonRetainedWAL, "the slot retains %d bytes of WAL, over %d: the reader is behind or stopped", st.RetainedBytes, maxRetained)
	}
	if st.Reader.Held {
		return nil
	}
	since, seen := st.Reader.ExpiresAt, "it expired at"
	if since.IsZero() {
		since, seen = h.NoReaderSince, "the first probe that found it free,"
	}
	lease := time.Duration(st.LeaseDurationMs) * time.Millisecond
	if !since.IsZero() && now.Sub(since) > lease {
		owner := "last owner " + st.Reader.Owner
		switch {
		case st.Reader.Term == 0:
			owner = "no reader ever took it"
		case st.Reader.Owner == "":
			owner = "last owner unknown (the lease row does not name it)"
		}
		return bad(WALReasonNoReader, "no reader seen holding the slot's lease since %s %s (%s ago, over the lease duration %s); %s",
			seen, since.UTC().Format(time.RFC3339), now.Sub(since).Round(time.Millisecond), lease, owner)
	}
	return nil
}
