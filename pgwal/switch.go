package pgwal

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// The checks of the staged switch between table mode and WAL mode
// (docs/wal-mode.md, Switching modes). Each reads the database only
// (WALMark writes a marker into the WAL); they work from any process,
// with a Reader configured like the running ones or with the Admin
// (NewAdmin: no publisher, nothing started), which has the same methods.
// Positions are pglogrepl.LSN (a uint64); LSN.String gives PostgreSQL's
// "16/B374D848" form and pglogrepl.ParseLSN reads it back, so a mark can
// be kept as text between stages (outboxctl wal switch prints and takes
// that form).

// switchChecks holds what the checks read: the outbox's tables, its WAL
// prefix and the slot.
type switchChecks struct {
	sess   func(ctx context.Context) *gorm.DB
	tables outbox.Tables
	prefix string
	slot   func(ctx context.Context) (SlotStatus, error)
	name   string
}

func (r *Reader) checks() switchChecks {
	return switchChecks{sess: r.sess, tables: r.ocfg.Tables, prefix: r.prefix, slot: r.SlotStatus, name: r.cfg.Slot}
}

func (a *Admin) checks() switchChecks {
	return switchChecks{
		sess:   func(ctx context.Context) *gorm.DB { return a.db.WithContext(ctx) },
		tables: a.plugin.Config().Tables, prefix: a.plugin.Config().WALPrefix(), name: a.cfg.Slot,
		slot: func(ctx context.Context) (SlotStatus, error) { return ReadSlotStatus(ctx, a.db, a.cfg.Slot) },
	}
}

// TableMark returns the highest id in the messages table (0 when empty).
// Read after a bridging EnsureSlot returned, every row committed before
// the slot existed has an id at most the mark.
func (r *Reader) TableMark(ctx context.Context) (int64, error) { return r.checks().tableMark(ctx) }

// TableMark is Reader.TableMark, without a reader.
func (a *Admin) TableMark(ctx context.Context) (int64, error) { return a.checks().tableMark(ctx) }

// TableDrained reports whether the messages table holds no row with an id
// at most mark: the table-mode relays published (or dead-lettered) every
// row committed before the slot.
func (r *Reader) TableDrained(ctx context.Context, mark int64) (bool, error) {
	return r.checks().tableDrained(ctx, mark)
}

// TableDrained is Reader.TableDrained, without a reader.
func (a *Admin) TableDrained(ctx context.Context, mark int64) (bool, error) {
	return a.checks().tableDrained(ctx, mark)
}

// TableRelaysStopped reports whether no table-mode relay holds a bucket
// lease: a relay releases its leases when it stops, and the lease of one
// that died lapses.
func (r *Reader) TableRelaysStopped(ctx context.Context) (bool, error) {
	return r.checks().tableRelaysStopped(ctx)
}

// TableRelaysStopped is Reader.TableRelaysStopped, without a reader.
func (a *Admin) TableRelaysStopped(ctx context.Context) (bool, error) {
	return a.checks().tableRelaysStopped(ctx)
}

// WALMark writes a marker into the WAL (a transactional logical decoding
// message the readers skip) and returns its position: every transaction
// that committed before WALMark was called is before it, and the marker
// moves an idle reader's confirmed position past it.
func (r *Reader) WALMark(ctx context.Context) (pglogrepl.LSN, error) { return r.checks().walMark(ctx) }

// WALMark is Reader.WALMark, without a reader.
func (a *Admin) WALMark(ctx context.Context) (pglogrepl.LSN, error) { return a.checks().walMark(ctx) }

// PublishedThrough reports whether the slot's confirmed position reached
// lsn: every message (and, with Bridge, every row of the messages table)
// committed before lsn was published or dead-lettered.
func (r *Reader) PublishedThrough(ctx context.Context, lsn pglogrepl.LSN) (bool, error) {
	return r.checks().publishedThrough(ctx, lsn)
}

// PublishedThrough is Reader.PublishedThrough, without a reader.
func (a *Admin) PublishedThrough(ctx context.Context, lsn pglogrepl.LSN) (bool, error) {
	return a.checks().publishedThrough(ctx, lsn)
}

func (c switchChecks) tableMark(ctx context.Context) (int64, error) {
	var mark *int64
	db := c.sess(ctx)
	if err := db.Raw("SELECT max(id) FROM " + db.Statement.Quote(c.tables.Messages)).Scan(&mark).Error; err != nil {
		return 0, fmt.Errorf("pgwal: read %s: %w", c.tables.Messages, err)
	}
	if mark == nil {
		return 0, nil
	}
	return *mark, nil
}

func (c switchChecks) tableDrained(ctx context.Context, mark int64) (bool, error) {
	var n int64
	db := c.sess(ctx)
	if err := db.Raw("SELECT count(*) FROM (SELECT 1 FROM "+db.Statement.Quote(c.tables.Messages)+" WHERE id <= ? LIMIT 1) m", mark).Scan(&n).Error; err != nil {
		return false, fmt.Errorf("pgwal: read %s: %w", c.tables.Messages, err)
	}
	return n == 0, nil
}

func (c switchChecks) tableRelaysStopped(ctx context.Context) (bool, error) {
	var n int64
	db := c.sess(ctx)
	err := db.Raw("SELECT count(*) FROM "+db.Statement.Quote(c.tables.Leases)+" WHERE owner IS NOT NULL AND expires_at_ms > ?",
		time.Now().UnixMilli()).Scan(&n).Error
	if err != nil {
		return false, fmt.Errorf("pgwal: read %s: %w", c.tables.Leases, err)
	}
	return n == 0, nil
}

func (c switchChecks) walMark(ctx context.Context) (pglogrepl.LSN, error) {
	var lsn string
	if err := c.sess(ctx).Raw("SELECT pg_logical_emit_message(true, ?, '')::text", c.prefix+"#mark").Scan(&lsn).Error; err != nil {
		return 0, fmt.Errorf("pgwal: write the marker: %w", err)
	}
	return pglogrepl.ParseLSN(lsn)
}

func (c switchChecks) publishedThrough(ctx context.Context, lsn pglogrepl.LSN) (bool, error) {
	st, err := c.slot(ctx)
	if err != nil {
		return false, err
	}
	if err := st.foreign(c.name); err != nil {
		return false, err
	}
	if !st.Exists {
		return false, &SlotLostError{Slot: c.name, Confirmed: lsn, Reason: "the slot does not exist"}
	}
	return st.Confirmed >= lsn, nil
}
