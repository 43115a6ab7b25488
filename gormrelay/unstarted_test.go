package gormrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// A relay whose publisher was never started fails Start and Run at once
// with the publisher's ErrNotStarted, a misconfiguration (the publishers'
// CheckReady), instead of starting and stopping later in the background:
// no lease is taken and nothing is published, deleted, counted against a
// message or dead-lettered, although the failure policy would dead-letter a
// message at its first failure. Once the publisher is started, the same
// relay delivers everything.
func TestRelayWithUnstartedPublisher(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c := kafkatest.Start(t)
		b := newStoreBundle(t, db, outbox.Config{})
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{MaxAttempts: 1, Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		for _, tc := range []struct {
			name string
			open func() (relay.Publisher, func(context.Context) error, error)
		}{
			{"kafka", func() (relay.Publisher, func(context.Context) error, error) {
				k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: c.Brokers(), Configure: strictSaramaConfig, Logger: dbtest.Logger(t)})
				if err != nil {
					return nil, nil, err
				}
				t.Cleanup(func() { require.NoError(t, k.Close()) })
				return k, k.Start, nil
			}},
			{"transactional", func() (relay.Publisher, func(context.Context) error, error) {
				tx, err := publisher.NewTransactional(publisher.TransactionalConfig{
					Brokers: c.Brokers(), TransactionalIDPrefix: strictPrefix(t), Configure: strictSaramaConfig, Logger: dbtest.Logger(t),
				})
				if err != nil {
					return nil, nil, err
				}
				t.Cleanup(func() { require.NoError(t, tx.Close()) })
				return tx, tx.Start, nil
			}},
		} {
			topic := c.Topic(t, 1)
			b.insert(t, withTopic(topic, keyed(keysN(3), 2))...)
			pub, start, err := tc.open()
			require.NoError(t, err)
			cfg := b.relayConfig(t, tc.name+"-unstarted")
			cfg.FailureHandler = policy

			r, err := relay.New(b.store, pub, cfg)
			require.NoError(t, err)
			for name, err := range map[string]error{"Start": r.Start(t.Context()), "Run": r.Run(t.Context())} {
				require.ErrorIs(t, err, publisher.ErrNotStarted, "%s %s", tc.name, name)
				require.True(t, relay.IsMisconfiguration(err), "%s %s: %v", tc.name, name, err)
				require.ErrorContains(t, err, "call Start before the relay publishes")
			}
			for _, l := range b.leaseRows(t) {
				require.Nil(t, l.Owner, "%s: bucket %d leased", tc.name, l.Bucket)
			}
			require.EqualValues(t, 6, b.count(t), "%s: nothing deleted", tc.name)
			var attempts int64
			require.NoError(t, b.messages().Select("COALESCE(SUM(attempts), 0)").Scan(&attempts).Error)
			require.Zero(t, attempts, "%s: no failure recorded against a message", tc.name)
			require.Empty(t, b.deadRows(t), "%s: nothing dead-lettered", tc.name)
			require.Zero(t, c.RecordCount(t, topic), "%s: nothing published", tc.name)

			require.NoError(t, start(t.Context()))
			require.NoError(t, r.Start(t.Context()))
			running := r
			require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, b.count(c)) }, 60*time.Second, 10*time.Millisecond, tc.name)
			require.Len(t, c.ReadLog(t, topic, 15*time.Second, kafkatest.ReadCommitted()), 6, tc.name)
			require.NoError(t, running.Stop(t.Context()))
		}
	})
}
