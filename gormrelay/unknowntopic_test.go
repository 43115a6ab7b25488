package gormrelay_test

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
)

// A message to a topic the cluster does not have is retried, and every
// failed publish counts as one of its attempts, those failed by sarama's
// circuit breaker of the topic (open after three failed lookups) too: it
// is dead-lettered after exactly MaxAttempts publishes, none of them
// reported as an outage, and the other key of its bucket is then
// delivered. The time from the first attempt to the dead letter is
// logged; the bound is the sum of the bucket's backoffs (see
// docs/failure-policy.md).
func TestUnknownTopicCountsEveryAttempt(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		cluster := kafkatest.Start(t)
		if cluster.AutoCreatesTopics(t) {
			t.Skip("the cluster creates topics on demand (auto.create.topics.enable); scripts/kafka.sh runs Apache Kafka without it")
		}
		good := cluster.Topic(t, 1)
		missing := good + "-missing"
		k := publishertest.StartKafka(t, publisher.KafkaConfig{
			Brokers: cluster.Brokers(),
			Logger:  dbtest.Logger(t),
			Configure: func(sc *sarama.Config) error {
				sc.Metadata.Retry.Max = 1
				sc.Metadata.Retry.Backoff = 10 * time.Millisecond
				return nil
			},
		})

		const maxAttempts = 8 // well past the breaker's three failures
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{MaxAttempts: maxAttempts, Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		stats := &publishStats{}
		cfg := b.relayConfig(t, "unknown-topic")
		cfg.FailureHandler = policy
		cfg.Observer = stats
		b.insert(t,
			outbox.MessageRow{MessageID: "lost", Topic: missing, Key: []byte("a"), Value: []byte("1")},
			outbox.MessageRow{MessageID: "next", Topic: good, Key: []byte("b"), Value: []byte("2")})
		began := time.Now()
		startRelay(t, b.store, k, cfg)

		dead := b.waitDeadLetters(t, 1)
		took := time.Since(began)
		require.Equal(t, "lost", dead[0].MessageID)
		require.Equal(t, maxAttempts, dead[0].Attempts)
		require.True(t, strings.HasPrefix(dead[0].LastError, `unknown topic "`+missing+`"`), dead[0].LastError)

		unavailable, failed := stats.get()
		require.Zero(t, unavailable, "no failure of the missing topic passes for an outage")
		require.Len(t, failed, maxAttempts, "every failed publish counted")
		breaker := 0
		for _, err := range failed {
			require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition)
			if strings.Contains(err.Error(), "circuit breaker") {
				breaker++
			}
		}
		require.Positive(t, breaker, "the topic's circuit breaker opened")

		recs := cluster.ReadAll(t, good, 1, deliverWithin)
		require.Equal(t, "2", string(recs[0].Value), "the bucket's other key is delivered")
		t.Logf("unknown topic: dead-lettered after %d attempts (%d failed by the open circuit breaker), %s after the relay started (BackoffMin %s, BackoffMax %s)",
			dead[0].Attempts, breaker, took.Round(time.Millisecond), cfg.BackoffMin, cfg.BackoffMax)
	})
}
