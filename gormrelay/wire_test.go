package gormrelay_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// New wires the plugin's tables, bucket count and hints: a commit is
// published without a poll (PollInterval is an hour), on every database.
func TestNewWiresPluginHintsAndBuckets(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		p, err := outbox.NewPlugin(outbox.Config{BucketCount: 4, Tables: outbox.WithPrefix("wired_")})
		require.NoError(t, err)
		require.NoError(t, db.DB.Use(p))
		require.NoError(t, p.AutoMigrate(ctx, db.DB))
		rec := newRecorder()
		cfg := fastConfig(t, "wired")
		cfg.BucketCount = 0 // New takes the plugin's
		cfg.PollInterval = time.Hour
		r, err := gormrelay.New(db.DB, p, rec.publisher("wired", nil), gormrelay.WithRelayConfig(cfg))
		require.NoError(t, err)
		require.NoError(t, r.Start(ctx))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			require.NoError(t, r.Stop(ctx))
		})
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, r.Leases(), 4) }, deliverWithin, 10*time.Millisecond)
		require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
		}))
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, rec.acked(), 1) }, deliverWithin, 10*time.Millisecond)
	})
}

// WithLogger reaches the store: without WithFailurePolicy the store's own
// policy dead-letters, and its line goes to WithLogger's logger, not to
// the plugin's.
func TestNewWithLoggerReachesTheStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := dbtest.Open(t, dbtest.SQLite)
	var pluginLogs, relayLogs dbtest.LogBuffer
	p, err := outbox.NewPlugin(outbox.Config{BucketCount: 4, Logger: slog.New(slog.NewTextHandler(&pluginLogs, nil))})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(ctx, db.DB))
	pub := relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
		return 0, relay.Permanent(errors.New("record rejected"))
	})
	cfg := fastConfig(t, "logged")
	cfg.BucketCount = 0
	r, err := gormrelay.New(db.DB, p, pub, gormrelay.WithRelayConfig(cfg),
		gormrelay.WithLogger(slog.New(slog.NewTextHandler(&relayLogs, nil))))
	require.NoError(t, err)
	require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("k"), Value: []byte("v")})
	}))
	require.NoError(t, r.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, r.Stop(ctx))
	})
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Contains(c, relayLogs.String(), "outbox: message dead-lettered")
	}, deliverWithin, 10*time.Millisecond)
	require.NotContains(t, pluginLogs.String(), "dead-lettered")
}

func TestNewRefusesBadWiring(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	p, err := outbox.NewPlugin(outbox.Config{BucketCount: 4})
	require.NoError(t, err)
	pub := relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil })
	for field, err := range map[string]error{
		"plugin":      second(gormrelay.New(db.DB, nil, pub)),
		"publisher":   second(gormrelay.New(db.DB, p, nil)),
		"db":          second(gormrelay.New(nil, p, pub)),
		"BucketCount": second(gormrelay.New(db.DB, p, pub, gormrelay.WithRelayConfig(relay.Config{BucketCount: 8}))),
		"MaxAttempts": second(gormrelay.New(db.DB, p, pub, gormrelay.WithFailurePolicy(gormrelay.FailurePolicyConfig{MaxAttempts: -1}))),
	} {
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, field)
		require.Equal(t, field, ce.Field)
	}
}

func second[T any](_ T, err error) error { return err }
