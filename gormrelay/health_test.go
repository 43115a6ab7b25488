package gormrelay_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func healthCheck(t *testing.T, h http.Handler, method string) (int, map[string]any) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), method, "/healthz/outbox", nil))
	require.Equal(t, "application/json", rec.Header().Get("Content-Type"))
	if method == http.MethodHead {
		require.Zero(t, rec.Body.Len())
		return rec.Code, nil
	}
	var body map[string]any
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body))
	return rec.Code, body
}

func TestHealth(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{})
		admin := b.newAdmin(t)
		h := gormrelay.HealthHandler(admin, 5*time.Minute)

		// Empty: healthy, no age.
		require.NoError(t, admin.Healthy(ctx, time.Minute))
		_, _, ok, err := admin.OldestPending(ctx)
		require.NoError(t, err)
		require.False(t, ok)
		code, body := healthCheck(t, h, http.MethodGet)
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, map[string]any{"status": "ok", "max_age_seconds": 300.0}, body)

		// A fresh message in bucket 2, a 10-minute-old head in bucket 5
		// (behind which a newer row waits).
		now := time.Now()
		b.insert(t,
			outbox.MessageRow{Bucket: 2, CreatedAtMs: now.UnixMilli()},
			outbox.MessageRow{Bucket: 5, CreatedAtMs: now.Add(-10 * time.Minute).UnixMilli()},
			outbox.MessageRow{Bucket: 5, CreatedAtMs: now.UnixMilli()},
		)
		age, bucket, ok, err := admin.OldestPending(ctx)
		require.NoError(t, err)
		require.True(t, ok)
		require.Equal(t, 5, bucket)
		require.InDelta(t, (10 * time.Minute).Seconds(), age.Seconds(), 30)

		require.NoError(t, admin.Healthy(ctx, time.Hour))
		err = admin.Healthy(ctx, 5*time.Minute)
		require.ErrorIs(t, err, gormrelay.ErrBacklogTooOld)
		var ae *gormrelay.BacklogAgeError
		require.ErrorAs(t, err, &ae)
		require.Equal(t, 5, ae.Bucket)
		require.Equal(t, 5*time.Minute, ae.MaxAge)
		require.Greater(t, ae.Age, 9*time.Minute)
		require.ErrorIs(t, admin.Healthy(ctx, 0), outbox.ErrInvalidConfig)

		code, body = healthCheck(t, h, http.MethodGet)
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, "unhealthy", body["status"])
		require.Equal(t, 5.0, body["bucket"])
		require.Greater(t, body["oldest_pending_age_seconds"], 540.0)
		code, _ = healthCheck(t, h, http.MethodHead)
		require.Equal(t, http.StatusServiceUnavailable, code)

		code, body = healthCheck(t, gormrelay.HealthHandler(admin, time.Hour), http.MethodGet)
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "ok", body["status"])

		// An unreadable outbox is an error, not healthy.
		missing, err := gormrelay.NewAdmin(db.DB, outbox.Config{Tables: outbox.WithPrefix("missing_"), Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		require.Error(t, missing.Healthy(ctx, time.Hour))
		code, body = healthCheck(t, gormrelay.HealthHandler(missing, time.Hour), http.MethodGet)
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, map[string]any{"status": "error", "max_age_seconds": 3600.0}, body)

		require.Panics(t, func() { gormrelay.HealthHandler(admin, 0) })
	})
}

// More buckets than one probe statement holds.
func TestOldestPendingManyBuckets(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	b := newStoreBundle(t, db, outbox.Config{BucketCount: 300})
	admin := b.newAdmin(t)
	now := time.Now()
	b.insert(t,
		outbox.MessageRow{Bucket: 7, CreatedAtMs: now.UnixMilli()},
		outbox.MessageRow{Bucket: 299, CreatedAtMs: now.Add(-time.Hour).UnixMilli()},
	)
	age, bucket, ok, err := admin.OldestPending(context.Background())
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 299, bucket)
	require.Greater(t, age, 59*time.Minute)
}
