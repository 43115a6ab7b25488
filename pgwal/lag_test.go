package pgwal_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/ops/opsui"
	"github.com/gorm-outbox/outbox/pgwal"
)

// TestAdminLagFromAnotherProcess: an Admin with no reader of its own, on
// a connection pool of its own (as in another process), reads the lag in
// time that the reader holding the lease records at its renewals: the
// age of the oldest message it holds while the broker is down, 0 once it
// published everything, unknown once no reader holds the lease.
func TestAdminLagFromAnotherProcess(t *testing.T) {
	e := setup(t)
	pub, blocked := e.downablePub()
	r := e.reader(t, pub, "reader-a")
	admin := e.otherProcessAdmin(t, r)
	status := func() ops.WALStatus {
		ws, err := admin.WALStatus(context.Background())
		require.NoError(t, err)
		return ws
	}

	stop := run(r)
	e.write(t, 2, 0, 5)
	e.checkDelivered(t, 2, 5)
	var ws ops.WALStatus
	require.Eventually(t, func() bool { ws = status(); return ws.LagSource == "lease" }, 30*time.Second, 10*time.Millisecond,
		"the reader records its lag in its lease: %+v", &ws)
	require.True(t, ws.Oldest.IsZero(), "nothing held: %+v", ws)
	require.Zero(t, ws.LagAgeMs)

	blocked.Store(true)
	before := time.Now().Truncate(time.Millisecond)
	e.write(t, 2, 5, 6)
	after := time.Now()
	require.Eventually(t, func() bool { ws = status(); return ws.LagSource == "lease" && !ws.Oldest.IsZero() }, 30*time.Second, 10*time.Millisecond,
		"the held message's creation time reaches the lease: %+v", &ws)
	require.False(t, ws.Oldest.Before(before), "the oldest held message is the one just written: %s, written from %s", ws.Oldest, before)
	require.False(t, ws.Oldest.After(after), "the oldest held message is the one just written: %s, written until %s", ws.Oldest, after)
	require.Eventually(t, func() bool { ws = status(); return ws.LagAgeMs >= 300 }, 30*time.Second, 10*time.Millisecond,
		"the lag grows while the broker is down: %+v", &ws)
	require.Equal(t, "lease", ws.LagSource)
	// Readiness in that process reads the held message's age.
	ready := opshttp.Health{Operator: admin, MaxAge: 100 * time.Millisecond, MaxRetainedWALBytes: -1}.Handler()
	rec := httptest.NewRecorder()
	ready.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	require.Equal(t, http.StatusServiceUnavailable, rec.Code, rec.Body.String())
	require.Contains(t, rec.Body.String(), `"status":"unhealthy"`)
	// The UI's overview in that process shows it.
	ui := httptest.NewServer(opsui.New(admin, opsui.Options{}))
	defer ui.Close()
	resp, err := http.Get(ui.URL + "/")
	require.NoError(t, err)
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Contains(t, string(page), "age of the oldest message the reader had not published at its last lease renewal")

	blocked.Store(false)
	e.checkDelivered(t, 2, 6)
	require.Eventually(t, func() bool { ws = status(); return ws.LagSource == "lease" && ws.Oldest.IsZero() }, 30*time.Second, 10*time.Millisecond,
		"caught up: %+v", &ws)
	require.Zero(t, ws.LagAgeMs)
	rec = httptest.NewRecorder()
	ready.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())

	require.NoError(t, stop()) // the lease is left to lapse
	require.Eventually(t, func() bool { ws = status(); return !ws.Reader.Held }, 30*time.Second, 10*time.Millisecond)
	require.Empty(t, ws.LagSource, "no reader holds the lease: the lag is unknown")
	require.Zero(t, ws.LagAgeMs)
}

// An Admin of this release reads a lease table that no reader of this
// release migrated yet (a rolling upgrade, the lag columns missing): the
// reader's term and position, the lag unknown, no error, also when the
// application's GORM names every column it selects.
func TestAdminLeaseTableBeforeLagColumns(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "reader-a")
	stop := run(r)
	e.write(t, 1, 0, 3)
	e.checkDelivered(t, 1, 3)
	require.NoError(t, stop())
	table := r.Config().LeaseTable
	require.NoError(t, e.db.DB.Exec("ALTER TABLE "+e.db.DB.Statement.Quote(table)+
		" DROP COLUMN lag_oldest_ms, DROP COLUMN lag_at_ms, DROP COLUMN lag_bucket").Error)
	// QueryFields: GORM names every field of the model in its SELECT, as
	// an application may configure it.
	admin, err := pgwal.NewAdmin(e.db.DB.Session(&gorm.Session{QueryFields: true}), e.plugin, pgwal.Config{Slot: r.Config().Slot, LeaseTable: table})
	require.NoError(t, err)
	ws, err := admin.WALStatus(context.Background())
	require.NoError(t, err, "an old lease table reads without the lag")
	require.Positive(t, ws.Reader.Term, "the reader's term is read: %+v", ws)
	require.NotEmpty(t, ws.Reader.ConfirmedLSN, "its confirmed position is read: %+v", ws)
	require.Empty(t, ws.LagSource, "the lag is unknown: %+v", ws)
	_, _, ok, err := admin.OldestPending(context.Background())
	require.NoError(t, err)
	require.False(t, ok, "no age known")
}
