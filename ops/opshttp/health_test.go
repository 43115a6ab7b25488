package opshttp_test

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/relay"
)

// Readiness reads the oldest pending message through the operator API of
// each implementation: ok while it is young enough, 503 with its bucket
// once it is older than MaxAge.
func TestHealthReadiness(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, b *opstest.Backend) {
		srv := httptest.NewServer(opshttp.Health{Operator: b.Op, MaxAge: time.Minute, Logger: dbtest.Logger(t)}.Handler())
		defer srv.Close()
		code, body := opstest.GetJSON(t, srv, "/readyz")
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "ok", body["status"])
		require.NotContains(t, body, "bucket", "nothing pending")

		b.Insert(t, relay.Message{MessageID: "young", Bucket: 1, Topic: "t", CreatedAt: time.Now()})
		code, body = opstest.GetJSON(t, srv, "/healthz")
		require.Equal(t, http.StatusOK, code)
		require.EqualValues(t, 1, body["bucket"])

		b.Insert(t, relay.Message{MessageID: "old", Bucket: 3, Topic: "t", CreatedAt: time.Now().Add(-time.Hour)})
		code, body = opstest.GetJSON(t, srv, "/readyz")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, "unhealthy", body["status"])
		require.EqualValues(t, 3, body["bucket"])
		require.GreaterOrEqual(t, body["oldest_pending_age_seconds"], 3599.0)

		// Liveness reads no database: the old message does not fail it.
		code, body = opstest.GetJSON(t, srv, "/livez")
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "ok", body["status"])
	})
}
