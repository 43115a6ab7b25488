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

	// Everything before mark is published and must be confirmed; the
	// last transaction, after it, has a commit position past it.
	e.write(t, keys, 0, n-1)
	var mark string
	require.NoError(t, e.db.Raw("SELECT pg_current_wal_lsn()::text").Scan(&mark).Error)
	markLSN, err := pglogrepl.ParseLSN(mark)
	require.NoError(t, err)
	e.write(t, keys, n-1, n)
	e.checkDelivered(t, keys, n)

	require.Eventually(t, func() bool {
		var confirmed string
		if e.db.Raw("SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&confirmed).Error != nil {
			return false
		}
		lsn, err := pglogrepl.ParseLSN(confirmed)
		return err == nil && lsn >= markLSN
	}, 20*time.Second, 20*time.Millisecond, "the slot confirms the published messages before the next standby interval")
}
