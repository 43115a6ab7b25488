package pgwal_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// currentLSN is the server's WAL insert position.
func currentLSN(t *testing.T, db *gorm.DB) pglogrepl.LSN {
	t.Helper()
	var s string
	require.NoError(t, db.Raw("SELECT pg_current_wal_lsn()::text").Scan(&s).Error)
	lsn, err := pglogrepl.ParseLSN(s)
	require.NoError(t, err)
	return lsn
}

// runErr runs r until it returns by itself, at most a minute.
func runErr(t *testing.T, r *pgwal.Reader) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := r.Run(ctx)
	require.NoError(t, ctx.Err(), "Run returned by itself")
	return err
}

// TestReaderStopsOnRecreatedSlot: a slot dropped while no reader ran is
// refused by Run and EnsureSlot, and not created again. Then it is
// created again, as an operator might: it starts after the messages
// committed in between. The
// reader finds the new slot's confirmed position beyond the one its lease
// row recorded and stops with a *SlotLostError naming both positions; it
// does not read the new slot, so the gap is not skipped silently, and
// EnsureSlot refuses it too.
func TestReaderStopsOnRecreatedSlot(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	e.write(t, 1, 0, 3)
	e.checkDelivered(t, 1, 3)
	require.Eventually(t, func() bool { return r.Stats().Confirmed > 0 }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, stop())
	recorded := r.Stats().Confirmed
	slot := r.Config().Slot
	require.Eventually(t, func() bool {
		return e.db.Exec("SELECT pg_drop_replication_slot(?)", slot).Error == nil
	}, 30*time.Second, 50*time.Millisecond)
	e.write(t, 1, 3, 6) // in no slot: lost

	// Missing while the lease row says the slot existed: refused, not
	// created again.
	for _, f := range []func() error{func() error { return runErr(t, r) }, func() error { return r.EnsureSlot(context.Background()) }} {
		err := f()
		var lost *pgwal.SlotLostError
		require.ErrorAs(t, err, &lost)
		require.Contains(t, err.Error(), "does not exist any more")
		require.False(t, slotExists(e.db.DB, slot), "the slot is not created again")
	}

	require.NoError(t, e.db.Exec("SELECT pg_create_logical_replication_slot(?, 'pgoutput')", slot).Error)
	e.write(t, 1, 6, 9) // in the new slot

	for _, f := range []func() error{func() error { return runErr(t, r) }, func() error { return r.EnsureSlot(context.Background()) }} {
		err := f()
		var lost *pgwal.SlotLostError
		require.ErrorAs(t, err, &lost)
		require.ErrorIs(t, err, pgwal.ErrSlotLost)
		require.GreaterOrEqual(t, lost.Confirmed, recorded, "the error names the position the readers recorded")
		require.Contains(t, err.Error(), "dropped and created again")
		require.Contains(t, err.Error(), "Admin.DropSlot with force, or outboxctl --mode wal --wal-slot "+slot+" wal slot drop --force", "the error says what to do, for this slot")
	}
	require.Equal(t, uint64(3), r.Stats().Received, "nothing read from the new slot")
	st, err := r.SlotStatus(context.Background())
	require.NoError(t, err)
	require.True(t, st.Exists)
	require.Greater(t, st.Confirmed, recorded, "the new slot was not read or advanced")
}

// TestReaderBackpressure: with the publisher blocked, the reader stops
// decoding once MaxPending messages wait (a committed transaction is
// queued whole, so the bound is MaxPending plus one transaction less one),
// keeps its lease and standby updates going, and confirms no position
// past the first unpublished message. Released, it publishes everything
// in order.
func TestReaderBackpressure(t *testing.T) {
	e := setup(t)
	const keys, n, maxPending, perTxn = 5, 60, 20, 3 * 5
	var (
		mu      sync.Mutex
		open    bool
		release = make(chan struct{})
	)
	gate := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		mu.Lock()
		o := open
		mu.Unlock()
		if !o {
			select {
			case <-release:
			case <-ctx.Done():
				return 0, relay.Unavailable(ctx.Err())
			}
		}
		return e.pub.Publish(ctx, msgs)
	})
	r := e.reader(t, gate, "a", func(c *pgwal.Config) { c.BatchSize, c.MaxPending = 5, maxPending })
	stop := run(r)
	e.write(t, keys, 0, 3) // one transaction of 15 messages
	firstEnd := currentLSN(t, e.db.DB)
	e.write(t, keys, 3, n)
	require.Eventually(t, func() bool { return r.Stats().Received >= maxPending }, 30*time.Second, 10*time.Millisecond)

	// Reading stays paused over several standby intervals: the lease is
	// renewed meanwhile and nothing more is decoded.
	leases := e.plugin.Config().Tables.Leases + "_wal"
	expiry := func() int64 {
		var x int64
		require.NoError(t, e.db.Raw("SELECT expires_at_ms FROM "+leases+" WHERE slot = ?", r.Config().Slot).Scan(&x).Error)
		return x
	}
	renewals, last := 0, expiry()
	require.Eventually(t, func() bool {
		got := r.Stats()
		require.LessOrEqual(t, got.Received, uint64(maxPending+perTxn-1), "decoded but unpublished messages stay within MaxPending and one transaction")
		require.Zero(t, got.Published)
		if x := expiry(); x > last {
			renewals, last = renewals+1, x
		}
		return renewals >= 5
	}, 30*time.Second, 20*time.Millisecond)
	st, err := r.SlotStatus(context.Background())
	require.NoError(t, err)
	require.Less(t, r.Stats().Confirmed, firstEnd, "nothing confirmed past the first unpublished transaction")
	require.Less(t, st.Confirmed, firstEnd, "the slot does not move past the first unpublished transaction")
	t.Logf("paused at %d received of %d written; slot confirmed %s, first transaction ended at %s", r.Stats().Received, keys*n, st.Confirmed, firstEnd)

	mu.Lock()
	open = true
	mu.Unlock()
	close(release)
	require.Equal(t, keys*n, e.checkDelivered(t, keys, n), "everything published once, in order")
	end := currentLSN(t, e.db.DB)
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && st.Confirmed >= end
	}, 30*time.Second, 20*time.Millisecond, "the slot confirms everything once published")
	require.NoError(t, stop())
}
