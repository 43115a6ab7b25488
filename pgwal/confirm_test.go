package pgwal_test

import (
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/pgwal"
)

// TestReaderConfirmsOnProgress: once messages are published the reader
// records and confirms its position within ConfirmInterval, not at the
// next StandbyInterval, so a reader that dies publishes again only what
// it published since. The standby interval here is longer than the
// poll's deadline: only the early renewal can confirm in time.
func TestReaderConfirmsOnProgress(t *testing.T) {
	e := setup(t)
	const keys, n = 4, 30
	r := e.reader(t, e.pub, "a", func(c *pgwal.Config) {
		c.LeaseDuration = 3 * time.Minute
		c.StandbyInterval = time.Minute
		c.ConfirmInterval = 100 * time.Millisecond
	})
	stop := run(r)
	defer func() { require.NoError(t, stop()) }()
	slot := r.Config().Slot
	require.Eventually(t, func() bool { return slotActive(e.db.DB, slot) }, 60*time.Second, 10*time.Millisecond)

	mark := e.writeAcross(t, keys, n)
	e.checkDelivered(t, keys, n)

	require.Eventually(t, func() bool {
		lsn, err := e.slotConfirmed(slot)
		return err == nil && lsn >= mark
	}, 20*time.Second, 20*time.Millisecond, "the slot confirms the published messages before the next standby interval")
}

// writeAcross writes n messages of each of keys and returns a WAL
// position read before the last transaction: that transaction's commit
// is past it, so a slot confirmed through every message is confirmed
// past it.
func (e *env) writeAcross(t *testing.T, keys, n int) pglogrepl.LSN {
	t.Helper()
	e.write(t, keys, 0, n-1)
	var mark string
	require.NoError(t, e.db.Raw("SELECT pg_current_wal_lsn()::text").Scan(&mark).Error)
	lsn, err := pglogrepl.ParseLSN(mark)
	require.NoError(t, err)
	e.write(t, keys, n-1, n)
	return lsn
}

// slotConfirmed reads the slot's confirmed position (0 when it has none).
func (e *env) slotConfirmed(slot string) (pglogrepl.LSN, error) {
	var confirmed string
	if err := e.db.Raw("SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&confirmed).Error; err != nil {
		return 0, err
	}
	return pglogrepl.ParseLSN(confirmed)
}

// TestReaderConfirmsWhenStopped: a reader told to stop records and
// confirms what it published since its last renewal, so the next reader
// does not publish it again. Neither the standby interval nor the
// confirm interval comes round during the test: only the confirm at the
// stop can move the slot.
func TestReaderConfirmsWhenStopped(t *testing.T) {
	e := setup(t)
	const keys, n = 4, 30
	slow := func(c *pgwal.Config) {
		c.LeaseDuration = 3 * time.Minute
		c.StandbyInterval = time.Minute
		c.ConfirmInterval = time.Minute
	}
	r := e.reader(t, e.pub, "a", slow)
	stop := run(r)
	slot := r.Config().Slot
	require.Eventually(t, func() bool { return slotActive(e.db.DB, slot) }, 60*time.Second, 10*time.Millisecond)

	mark := e.writeAcross(t, keys, n)
	e.checkDelivered(t, keys, n)
	require.Eventually(t, func() bool { return r.Stats().Published >= keys*n }, 20*time.Second, 10*time.Millisecond)
	require.NoError(t, stop())

	lsn, err := e.slotConfirmed(slot)
	require.NoError(t, err)
	require.GreaterOrEqual(t, lsn, mark, "the slot is confirmed past the messages published before the stop")

	// The next reader publishes nothing again. It has the same relay id:
	// a reader with a publisher of the caller's leaves its lease to lapse
	// (Run), and the same id takes it back at once.
	r2 := e.reader(t, e.pub, "a", slow)
	stop2 := run(r2)
	require.Eventually(t, func() bool { return slotActive(e.db.DB, slot) }, 60*time.Second, 10*time.Millisecond)
	e.write(t, keys, n, n+1)
	e.checkDelivered(t, keys, n+1)
	require.NoError(t, stop2())
	require.Equal(t, uint64(keys), r2.Stats().Published, "the next reader published only the messages written after the stop")
}
