package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
)

// probe returns the status code of GET path.
func probe(t require.TestingT, addr, path string) int {
	resp, err := http.Get("http://" + addr + path)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

// The API's readiness does not depend on the outbox's delivery: while
// events wait (here every bucket is paused, as in a Kafka outage nothing
// is published) /healthz, the outbox's check, fails on their age, and
// /readyz keeps the API in the load balancer, taking orders.
func TestReadyzDoesNotDependOnDelivery(t *testing.T) {
	t.Parallel()
	dbPath := filepath.Join(t.TempDir(), "orders.db")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	app, served := serveInBackground(t, ctx, Config{
		Addr: "127.0.0.1:0", DatabaseURL: dbPath, Topic: "orders_ready", HealthMaxAge: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-served)
	})

	db, err := openDatabase(dbPath)
	require.NoError(t, err)
	admin, err := gormrelay.NewAdmin(db, outbox.Config{})
	require.NoError(t, err)
	for b := range outbox.BucketCountDefault {
		require.NoError(t, admin.PauseBucket(ctx, b))
	}
	// The relay releases a paused bucket at its next lease maintenance.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		leases, err := admin.Leases(ctx)
		require.NoError(c, err)
		for _, l := range leases {
			assert.False(c, l.Held, "bucket %d", l.Bucket)
		}
	}, 10*time.Second, 20*time.Millisecond)
	c := client{t: t, base: "http://" + app.Addr()}
	c.do("POST", "/orders", map[string]any{"customer": "c1", "total": 100}, http.StatusCreated)

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, http.StatusServiceUnavailable, probe(c, app.Addr(), "/healthz"))
	}, 10*time.Second, 20*time.Millisecond, "the outbox's check fails on the waiting event")
	require.Equal(t, http.StatusOK, probe(t, app.Addr(), "/readyz"), "the API stays ready")
	require.Equal(t, http.StatusOK, probe(t, app.Addr(), "/livez"))
	c.do("POST", "/orders", map[string]any{"customer": "c2", "total": 200}, http.StatusCreated)

	// Delivery resumes: the outbox's check passes again.
	for b := range outbox.BucketCountDefault {
		require.NoError(t, admin.ResumeBucket(ctx, b))
	}
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, http.StatusOK, probe(c, app.Addr(), "/healthz"))
	}, 10*time.Second, 20*time.Millisecond)
}
