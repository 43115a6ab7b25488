package gormrelay_test

import (
	"context"
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

func TestNewRefusesBadWiring(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	p, err := outbox.NewPlugin(outbox.Config{BucketCount: 4})
	require.NoError(t, err)
	pub := relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil })
	for field, err := range map[string]error{
		"plugin":                   second(gormrelay.New(db.DB, nil, pub)),
		"publisher":                second(gormrelay.New(db.DB, p, nil)),
		"db":                       second(gormrelay.New(nil, p, pub)),
		"relay.Config.BucketCount": second(gormrelay.New(db.DB, p, pub, gormrelay.WithRelayConfig(relay.Config{BucketCount: 8}))),
		"MaxAttempts":              second(gormrelay.New(db.DB, p, pub, gormrelay.WithFailurePolicy(gormrelay.FailurePolicyConfig{MaxAttempts: -1}))),
	} {
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, field)
		require.Equal(t, field, ce.Field)
	}
}

func second[T any](_ T, err error) error { return err }
