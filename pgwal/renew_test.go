package pgwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/pgwal"
)

// TestReaderStreamsWhileRenewing: the lease renewal (a commit, so a disk
// flush) runs beside the stream, not in it: while another transaction
// holds the lease row and the renewal waits for it, messages written
// meanwhile are still published; the position reaches the server once
// the renewal completes.
func TestReaderStreamsWhileRenewing(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a", func(c *pgwal.Config) {
		// A renewal may wait LeaseDuration/3 = 20s before it fails.
		c.LeaseDuration, c.StandbyInterval = time.Minute, 100*time.Millisecond
	})
	stop := run(r)
	defer func() { require.NoError(t, stop()) }()
	e.write(t, 2, 0, 3)
	e.checkDelivered(t, 2, 3)

	// Hold the lease row until the messages below are published.
	lock := e.db.Begin()
	require.NoError(t, lock.Error)
	defer lock.Rollback()
	require.NoError(t, lock.Exec("SELECT 1 FROM "+lock.Statement.Quote(r.Config().LeaseTable)+" WHERE slot = ? FOR UPDATE", r.Config().Slot).Error)
	require.Eventually(t, func() bool {
		var waiting int64
		e.db.Raw("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%' AND query LIKE ?", "%"+r.Config().LeaseTable+"%").Scan(&waiting)
		return waiting > 0
	}, 30*time.Second, 10*time.Millisecond, "a renewal waits for the lease row")
	confirmed := r.Stats().Confirmed

	e.write(t, 2, 3, 10)
	e.checkDelivered(t, 2, 10) // within the renewal's 20 s
	require.Equal(t, confirmed, r.Stats().Confirmed, "nothing is confirmed before the lease records it")
	require.NoError(t, lock.Rollback().Error)
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && r.Stats().Confirmed > confirmed && st.Confirmed >= r.Stats().Confirmed
	}, 30*time.Second, 20*time.Millisecond, "the renewed position reaches the server")
}
