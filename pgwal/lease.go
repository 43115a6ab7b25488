package pgwal

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
)

// SlotLease is the row that elects the one reader of a slot, with the
// lease semantics of the relay's bucket leases (outbox.LeaseRow): an
// owner, an expiry, and a term that grows with every acquisition, so a
// reader whose lease was taken over can tell. ConfirmedLSN is the
// position the owner last confirmed to the server, recorded before it is
// sent: a slot whose confirmed position is beyond it was dropped and
// created again, and the messages in between are lost.
type SlotLease struct {
	Slot        string  `gorm:"column:slot;type:varchar(63);primaryKey"`
	Owner       *string `gorm:"column:owner;type:varchar(128)"`
	Term        int64   `gorm:"column:term;not null;default:0"`
	ExpiresAtMs int64   `gorm:"column:expires_at_ms;not null;default:0"`
	// ConfirmedLSN is 0 until the reader created or first read the slot.
	ConfirmedLSN int64 `gorm:"column:confirmed_lsn;not null;default:0"`
	// LagOldestMs is the creation time (Unix milliseconds, the writer's
	// clock) of the oldest message the owner held and had not published
	// or dead-lettered at its last renewal, 0 when it held none. LagAtMs
	// is when that renewal looked (the reader's clock); 0 when it could
	// not tell: a term that had not read yet the WAL written before it
	// began. LagBucket is the oldest message's bucket. The lag in time,
	// for a process without the reader.
	LagOldestMs int64 `gorm:"column:lag_oldest_ms;not null;default:0"`
	LagAtMs     int64 `gorm:"column:lag_at_ms;not null;default:0"`
	LagBucket   int   `gorm:"column:lag_bucket;not null;default:0"`
}

// lagSample is what a renewal records of the reader's lag in time
// (SlotLease.LagOldestMs, LagAtMs, LagBucket); the zero value is unknown.
type lagSample struct {
	oldestMs, atMs int64
	bucket         int
}

// leases is the reader's access to its lease row.
type leases struct {
	db    *gorm.DB
	table string
	slot  string
	me    string
	dur   time.Duration
}

func (l *leases) migrate(ctx context.Context) error {
	if ok, err := l.current(ctx); err == nil && ok {
		return nil
	}
	return l.db.WithContext(ctx).Table(l.table).AutoMigrate(&SlotLease{})
}

// leaseColumns are the lease table's columns as SlotLease declares them
// on PostgreSQL: each column's type (format_type) and whether it is NOT
// NULL.
var leaseColumns = map[string]struct {
	typ     string
	notNull bool
}{
	"slot":          {"character varying(63)", true},
	"owner":         {"character varying(128)", false},
	"term":          {"bigint", true},
	"expires_at_ms": {"bigint", true},
	"confirmed_lsn": {"bigint", true},
	"lag_oldest_ms": {"bigint", true},
	"lag_at_ms":     {"bigint", true},
	"lag_bucket":    {"bigint", true},
}

// current reports whether the lease table exists with every column of
// SlotLease, of its type and nullability, in one catalog query: a reader
// then starts without AutoMigrate, which reads the catalog in a dozen
// queries (a fifth of a second under load, before the first message is
// read). A table that differs in any column is left to AutoMigrate.
func (l *leases) current(ctx context.Context) (bool, error) {
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	var cols []struct {
		Name    string
		Typ     string
		NotNull bool
	}
	err := db.Raw("SELECT attname AS name, format_type(atttypid, atttypmod) AS typ, attnotnull AS not_null FROM pg_attribute"+
		" WHERE attrelid = to_regclass(?) AND attnum > 0 AND NOT attisdropped", l.quoted(db)).Scan(&cols).Error
	if err != nil {
		return false, err
	}
	found := 0
	for _, c := range cols {
		want, ok := leaseColumns[c.Name]
		if !ok {
			continue
		}
		if c.Typ != want.typ || c.NotNull != want.notNull {
			return false, nil
		}
		found++
	}
	return found == len(leaseColumns), nil
}

// acquire takes the lease when it is free, expired or already ours, and
// returns the new term. ok is false when another reader holds it. It
// returns no recorded position: one read now is stale by the time the
// slot is read, if this reader stalled meanwhile and another took the
// lease over and confirmed further (slotAndRow reads both in the order
// that holds).
func (l *leases) acquire(ctx context.Context) (term int64, ok bool, err error) {
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	if err := db.Table(l.table).Clauses(clause.OnConflict{DoNothing: true}).Create(&SlotLease{Slot: l.slot}).Error; err != nil {
		return 0, false, err
	}
	now := time.Now().UnixMilli()
	r := db.Exec("UPDATE "+l.quoted(db)+" SET owner = ?, term = term + 1, expires_at_ms = ? WHERE slot = ? AND (owner IS NULL OR owner = ? OR expires_at_ms <= ?)",
		l.me, now+l.dur.Milliseconds(), l.slot, l.me, now)
	if r.Error != nil || r.RowsAffected == 0 {
		return 0, false, r.Error
	}
	row, found, err := l.row(ctx)
	if err != nil || !found || !l.holds(row, row.Term) {
		return 0, false, err
	}
	return row.Term, true, nil
}

// holds reports whether row is this reader's lease under term.
func (l *leases) holds(row SlotLease, term int64) bool {
	return row.Owner != nil && *row.Owner == l.me && row.Term == term
}

// renew extends the lease held under term and records confirmed (never
// moving it back) and lag. It reports false when the lease was lost.
func (l *leases) renew(ctx context.Context, term, confirmed int64, lag lagSample) (bool, error) {
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	now := time.Now().UnixMilli()
	r := db.Exec("UPDATE "+l.quoted(db)+" SET expires_at_ms = ?, confirmed_lsn = CASE WHEN confirmed_lsn < ? THEN ? ELSE confirmed_lsn END,"+
		" lag_oldest_ms = ?, lag_at_ms = ?, lag_bucket = ? WHERE slot = ? AND owner = ? AND term = ? AND expires_at_ms > ?",
		now+l.dur.Milliseconds(), confirmed, confirmed, lag.oldestMs, lag.atMs, lag.bucket, l.slot, l.me, term, now)
	return r.Error == nil && r.RowsAffected == 1, r.Error
}

// holder reads the lease row; ok is false when there is none.
func (l *leases) holder(ctx context.Context) (SlotLease, bool, error) {
	var rows []SlotLease
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	if err := db.Table(l.table).Select("slot", "owner", "term", "expires_at_ms").Where("slot = ?", l.slot).Find(&rows).Error; err != nil || len(rows) == 0 {
		return SlotLease{}, false, err
	}
	return rows[0], true, nil
}

// row reads the lease row; found is false when there is none.
func (l *leases) row(ctx context.Context) (row SlotLease, found bool, err error) {
	var rows []SlotLease
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	if err := db.Table(l.table).Where("slot = ?", l.slot).Find(&rows).Error; err != nil || len(rows) == 0 {
		return SlotLease{}, false, err
	}
	return rows[0], true, nil
}

// slotAndRow reads the slot's status, then the lease row (the zero row
// when there is none), for checkSlot. The order matters: a reader records
// a position in the row before it confirms it to the server, so every
// position the slot had been confirmed to when it was read is recorded by
// the time the row is read, and a slot confirmed beyond the row's
// position was dropped and created again. Read the other way round, a
// reader that confirmed in between (another reader took the lease over
// from one stalled after it read the row) looks like a re-created slot.
func (l *leases) slotAndRow(ctx context.Context) (SlotStatus, SlotLease, error) {
	st, err := ReadSlotStatus(ctx, l.db, l.slot)
	if err != nil {
		return SlotStatus{}, SlotLease{}, fmt.Errorf("pgwal: read slot status: %w", err)
	}
	row, _, err := l.row(ctx)
	if err != nil {
		return SlotStatus{}, SlotLease{}, fmt.Errorf("pgwal: read lease: %w", err)
	}
	return st, row, nil
}

// record stores confirmed as the recorded position when it is further,
// whoever holds the lease.
func (l *leases) record(ctx context.Context, confirmed int64) error {
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	if err := db.Table(l.table).Clauses(clause.OnConflict{DoNothing: true}).Create(&SlotLease{Slot: l.slot}).Error; err != nil {
		return err
	}
	return db.Exec("UPDATE "+l.quoted(db)+" SET confirmed_lsn = ? WHERE slot = ? AND confirmed_lsn < ?", confirmed, l.slot, confirmed).Error
}

// release gives the lease up: it expires now, and the row still names
// this reader as its last owner (for the operator: ops.WALReader.Owner).
func (l *leases) release(ctx context.Context, term int64) error {
	db := l.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	return db.Exec("UPDATE "+l.quoted(db)+" SET expires_at_ms = 0 WHERE slot = ? AND owner = ? AND term = ?", l.slot, l.me, term).Error
}

func (l *leases) quoted(db *gorm.DB) string { return db.Statement.Quote(l.table) }
