package pgwal

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// stallEnv is an outbox in WAL mode on the WAL mode server, with its slot
// created (EnsureSlot), and readers that acknowledge every message.
type stallEnv struct {
	db     *gorm.DB
	plugin *outbox.Plugin
}

func newStallEnv(t *testing.T) *stallEnv {
	t.Helper()
	dbt, p := OpenWALOutbox(t)
	return &stallEnv{db: dbt.DB, plugin: p}
}

func (e *stallEnv) reader(t *testing.T, id string) *Reader {
	t.Helper()
	ack := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
	r, err := New(e.db, e.plugin, ack, Config{
		ReplicationDSN: dbtest.PostgresWALDSN(), RelayID: id,
		LeaseDuration: 900 * time.Millisecond, StandbyInterval: 100 * time.Millisecond,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
		Logger: dbtest.Logger(t),
	})
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(context.Background()))
	slot := r.cfg.Slot
	t.Cleanup(func() {
		require.Eventually(t, func() bool {
			return e.db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ? AND NOT active", slot).Error == nil &&
				e.slotStatus(t, slot).Exists == false
		}, 30*time.Second, 50*time.Millisecond)
		_ = e.db.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})
	return r
}

func (e *stallEnv) slotStatus(t *testing.T, slot string) SlotStatus {
	t.Helper()
	st, err := ReadSlotStatus(context.Background(), e.db, slot)
	require.NoError(t, err)
	return st
}

func (e *stallEnv) write(t *testing.T, n int) {
	t.Helper()
	for range n {
		require.NoError(t, e.db.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
		}))
	}
}

// TestStalledTermStartIsNotSlotLoss: a reader that stalls (a process
// stopped, a machine starved) between taking the lease and reading the
// slot's status finds, when it resumes, the slot confirmed further by the
// reader that took the lease over meanwhile. That is no lost slot: the
// other reader recorded its position in the lease row before it
// confirmed it. The stalled reader's term ends as a lost lease, and the
// reader reads the slot again once it takes the lease back; a *SlotLostError
// would stop it for good.
func TestStalledTermStartIsNotSlotLoss(t *testing.T) {
	ctx := context.Background()
	e := newStallEnv(t)
	a := e.reader(t, "a")
	b := e.reader(t, "b")
	slot := a.cfg.Slot

	// a takes the lease, and stalls before it reads the slot.
	term, ok, err := a.acquire(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	row, _, err := a.leases.row(ctx)
	require.NoError(t, err)
	recorded := row.ConfirmedLSN // what a read when it took the lease
	require.NotZero(t, recorded, "EnsureSlot recorded the slot's consistent point")

	// Meanwhile a's lease lapses, b takes it over (its Run waits for
	// that) and confirms further.
	bctx, stopB := context.WithCancel(ctx)
	bDone := make(chan error, 1)
	go func() { bDone <- b.Run(bctx) }()
	e.write(t, 5)
	require.Eventually(t, func() bool {
		return e.slotStatus(t, slot).Confirmed > pglogrepl.LSN(recorded)
	}, 30*time.Second, 20*time.Millisecond, "b confirms past the position a read when it took the lease")
	stopB()
	require.NoError(t, <-bDone)
	require.Eventually(t, func() bool { return !e.slotStatus(t, slot).Active }, 30*time.Second, 20*time.Millisecond)

	// a resumes its term: the lease is b's now.
	err = a.term(ctx, term)
	var lost *SlotLostError
	require.False(t, errors.As(err, &lost), "a reader that stalled while another confirmed reports no lost slot: %v", err)
	require.ErrorIs(t, err, errLeaseLost)

	// Run takes the lease back once b's lapses and reads on.
	actx, stopA := context.WithCancel(ctx)
	aDone := make(chan error, 1)
	go func() { aDone <- a.Run(actx) }()
	before := e.slotStatus(t, slot).Confirmed
	e.write(t, 5)
	require.Eventually(t, func() bool {
		return a.Stats().Published >= 5 && e.slotStatus(t, slot).Confirmed > before
	}, 30*time.Second, 20*time.Millisecond, "a reads the slot again")
	stopA()
	require.NoError(t, <-aDone)
}

// confirmBetween makes another reader confirm further after each
// statement about the slot or its lease that db runs while armed: it
// records a new position in the lease row, then confirms it to the slot
// (pg_replication_slot_advance), as a reader holding the lease does.
func (e *stallEnv) confirmBetween(t *testing.T, slot, leaseTable string) (armed *atomic.Bool) {
	t.Helper()
	armed = &atomic.Bool{}
	sqlDB, err := e.db.DB() // database/sql: runs no GORM callback
	require.NoError(t, err)
	confirm := func(tx *gorm.DB) {
		sql := tx.Statement.SQL.String()
		if !armed.Load() || (tx.Statement.Table != leaseTable && !strings.Contains(sql, "pg_replication_slots")) {
			return
		}
		var pos string
		require.NoError(t, sqlDB.QueryRow("SELECT pg_current_wal_lsn()::text FROM (SELECT pg_logical_emit_message(true, 'other', 'x')) m").Scan(&pos))
		lsn, err := pglogrepl.ParseLSN(pos)
		require.NoError(t, err)
		_, err = sqlDB.Exec("UPDATE "+leaseTable+" SET confirmed_lsn = greatest(confirmed_lsn, $1) WHERE slot = $2", int64(lsn), slot)
		require.NoError(t, err)
		_, err = sqlDB.Exec("SELECT pg_replication_slot_advance($1, $2::pg_lsn)", slot, pos)
		require.NoError(t, err)
	}
	require.NoError(t, e.db.Callback().Query().After("gorm:query").Register("test:confirm_between", confirm))
	require.NoError(t, e.db.Callback().Row().After("gorm:row").Register("test:confirm_between", confirm))
	return armed
}

// TestEnsureSlotWhileAnotherReaderConfirms: EnsureSlot (the reader's and
// the Admin's) on a slot that a reader confirms further meanwhile, even
// between any two of EnsureSlot's statements, reports no lost slot.
func TestEnsureSlotWhileAnotherReaderConfirms(t *testing.T) {
	ctx := context.Background()
	e := newStallEnv(t)
	r := e.reader(t, "a")
	admin, err := r.Admin(e.plugin)
	require.NoError(t, err)
	armed := e.confirmBetween(t, r.cfg.Slot, r.cfg.LeaseTable)
	before := e.slotStatus(t, r.cfg.Slot).Confirmed

	armed.Store(true)
	err = r.EnsureSlot(ctx)
	armed.Store(false)
	require.NoError(t, err, "the reader's EnsureSlot")
	require.Greater(t, e.slotStatus(t, r.cfg.Slot).Confirmed, before, "the slot was confirmed further meanwhile")

	before = e.slotStatus(t, r.cfg.Slot).Confirmed
	armed.Store(true)
	created, err := admin.EnsureSlot(ctx)
	armed.Store(false)
	require.NoError(t, err, "the Admin's EnsureSlot")
	require.False(t, created)
	require.Greater(t, e.slotStatus(t, r.cfg.Slot).Confirmed, before, "the slot was confirmed further meanwhile")
}
