package pgwal_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgwal"
)

const (
	logWaiting = "pgwal: waiting for the slot's lease, held by another reader"
	logReading = "pgwal: reading the slot"
)

// TestReaderLogsWhileWaiting: a reader that finds the slot's lease held
// by another says so once, naming the holder and when its lease lapses
// unless renewed, and not again at every check while the holder renews;
// it logs "reading the slot" only once it took over and reads.
func TestReaderLogsWhileWaiting(t *testing.T) {
	e := setup(t)
	a := e.reader(t, e.pub, "a")
	stopA := run(a)
	e.write(t, 1, 0, 2)
	e.checkDelivered(t, 1, 2)
	log, logs := dbtest.WatchLog(t, logWaiting, logReading)
	b := e.reader(t, e.pub, "b", func(c *pgwal.Config) { c.Logger = log })
	stopB := run(b)
	t.Cleanup(func() { _ = stopB() })

	var rec slog.Record
	select {
	case rec = <-logs:
	case <-time.After(30 * time.Second):
		t.Fatal("no line while waiting for the lease")
	}
	require.Equal(t, logWaiting, rec.Message)
	holder, _ := dbtest.Attr(rec, "holder")
	require.Equal(t, "a", holder.String())
	v, ok := dbtest.Attr(rec, "expires_at")
	require.True(t, ok)
	expires, err := time.Parse(time.RFC3339Nano, v.String())
	require.NoError(t, err)

	// a renews its lease twice more while b checks every standby
	// interval: b says nothing more.
	admin, err := a.Admin(e.plugin)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		ws, err := admin.WALStatus(context.Background())
		require.NoError(t, err)
		return ws.Reader.Owner == "a" && ws.Reader.ExpiresAt.After(expires.Add(2*a.Config().StandbyInterval))
	}, 30*time.Second, 10*time.Millisecond)
	select {
	case rec = <-logs:
		t.Fatalf("a second line while the same holder renews: %s %v", rec.Message, rec)
	default:
	}
	require.Zero(t, b.Stats().Received)

	require.NoError(t, stopA()) // its lease lapses
	select {
	case rec = <-logs:
	case <-time.After(30 * time.Second):
		t.Fatal("b never logged reading the slot")
	}
	require.Equal(t, logReading, rec.Message, "b reads once a's lease lapsed")
}
