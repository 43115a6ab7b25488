package pgwal

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// The checks of the staged switch between table mode and WAL mode
// (docs/wal-mode.md, Switching modes). Each reads the database only; they
// work from any process with a Reader configured like the running ones.

// TableMark returns the highest id in the messages table (0 when empty).
// Read after a bridging EnsureSlot returned, every row committed before
// the slot existed has an id at most the mark.
func (r *Reader) TableMark(ctx context.Context) (int64, error) {
	var mark *int64
	db := r.sess(ctx)
	if err := db.Raw("SELECT max(id) FROM " + db.Statement.Quote(r.ocfg.Tables.Messages)).Scan(&mark).Error; err != nil {
		return 0, fmt.Errorf("pgwal: read %s: %w", r.ocfg.Tables.Messages, err)
	}
	if mark == nil {
		return 0, nil
	}
	return *mark, nil
}

// TableDrained reports whether the messages table holds no row with an id
// at most mark: the table-mode relays published (or dead-lettered) every
// row committed before the slot.
func (r *Reader) TableDrained(ctx context.Context, mark int64) (bool, error) {
	var n int64
	db := r.sess(ctx)
	if err := db.Raw("SELECT count(*) FROM (SELECT 1 FROM "+db.Statement.Quote(r.ocfg.Tables.Messages)+" WHERE id <= ? LIMIT 1) m", mark).Scan(&n).Error; err != nil {
		return false, fmt.Errorf("pgwal: read %s: %w", r.ocfg.Tables.Messages, err)
	}
	return n == 0, nil
}

// TableRelaysStopped reports whether no table-mode relay holds a bucket
// lease: a relay releases its leases when it stops, and the lease of one
// that died lapses.
func (r *Reader) TableRelaysStopped(ctx context.Context) (bool, error) {
	var n int64
	db := r.sess(ctx)
	err := db.Raw("SELECT count(*) FROM "+db.Statement.Quote(r.ocfg.Tables.Leases)+" WHERE owner IS NOT NULL AND expires_at_ms > ?",
		time.Now().UnixMilli()).Scan(&n).Error
	if err != nil {
		return false, fmt.Errorf("pgwal: read %s: %w", r.ocfg.Tables.Leases, err)
	}
	return n == 0, nil
}

// WALMark writes a marker into the WAL (a transactional logical decoding
// message the readers skip) and returns its position: every transaction
// that committed before WALMark was called is before it, and the marker
// moves an idle reader's confirmed position past it.
func (r *Reader) WALMark(ctx context.Context) (pglogrepl.LSN, error) {
	var lsn string
	if err := r.sess(ctx).Raw("SELECT pg_logical_emit_message(true, ?, '')::text", r.prefix+"#mark").Scan(&lsn).Error; err != nil {
		return 0, fmt.Errorf("pgwal: write the marker: %w", err)
	}
	return pglogrepl.ParseLSN(lsn)
}

// PublishedThrough reports whether the slot's confirmed position reached
// lsn: every message (and, with Bridge, every row of the messages table)
// committed before lsn was published or dead-lettered.
func (r *Reader) PublishedThrough(ctx context.Context, lsn pglogrepl.LSN) (bool, error) {
	st, err := r.SlotStatus(ctx)
	if err != nil {
		return false, err
	}
	if err := st.foreign(r.cfg.Slot); err != nil {
		return false, err
	}
	if !st.Exists {
		return false, &SlotLostError{Slot: r.cfg.Slot, Confirmed: lsn, Reason: "the slot does not exist"}
	}
	return st.Confirmed >= lsn, nil
}
