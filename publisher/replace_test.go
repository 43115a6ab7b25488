package publisher_test

import (
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// producerIDs returns the producer ids of a produce request's batches.
func producerIDs(req kmsg.Request) []int64 {
	pr, ok := req.(*kmsg.ProduceRequest)
	if !ok {
		return nil
	}
	var out []int64
	for _, t := range pr.Topics {
		for _, p := range t.Partitions {
			var b kmsg.RecordBatch
			if err := b.ReadFrom(p.Records); err == nil {
				out = append(out, b.ProducerID)
			}
		}
	}
	return out
}

// wedge makes the cluster refuse, with code, every produce request of the
// first producer id it sees, forever, while it serves every other
// producer: a producer whose state the brokers no longer accept, on a
// healthy cluster.
func wedge(fake *kfake.Cluster, code *kerr.Error) (ids func() []int64) {
	var (
		mu   sync.Mutex
		seen []int64
	)
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: code, Count: -1, When: func(req kmsg.Request) bool {
		mu.Lock()
		defer mu.Unlock()
		wedged := false
		for _, id := range producerIDs(req) {
			if len(seen) == 0 || seen[len(seen)-1] != id {
				seen = append(seen, id)
			}
			wedged = wedged || id == seen[0]
		}
		return wedged
	}})
	return func() []int64 {
		mu.Lock()
		defer mu.Unlock()
		return append([]int64(nil), seen...)
	}
}

type replacedCounter struct {
	mu      sync.Mutex
	reasons []string
}

func (r *replacedCounter) ProducerReplaced(reason string) {
	r.mu.Lock()
	r.reasons = append(r.reasons, reason)
	r.mu.Unlock()
}

func (r *replacedCounter) get() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.reasons...)
}

// TestKafkaReplacesProducerRefusedByBrokers: the brokers refuse the
// producer's sequence state (here OUT_OF_ORDER_SEQUENCE_NUMBER for every
// request of its producer id) while the cluster is otherwise healthy. The
// publisher replaces the producer (a new producer id) and publishing
// resumes; the failures meanwhile are unavailable, not the messages' fault.
func TestKafkaReplacesProducerRefusedByBrokers(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t)
	topic := c.Topic(t, 2)
	producers := wedge(fake, kerr.OutOfOrderSequenceNumber)
	obs := &replacedCounter{}
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.Observer = obs })

	acked, err := k.Publish(testCtx(t), publishertest.Messages(topic, "wedged", 5))
	require.Zero(t, acked)
	require.ErrorIs(t, err, sarama.ErrOutOfOrderSequenceNumber)
	require.True(t, relay.IsUnavailable(err), "%v", err)
	require.False(t, relay.IsPermanent(err), "%v", err)

	// The relay retries after its backoff; the replacement runs in the
	// background meanwhile.
	msgs := publishertest.Messages(topic, "after", 20)
	eventuallyPublishes(t, k, msgs)
	require.Equal(t, int64(1), k.Replacements())
	require.Equal(t, []string{publisher.ReplaceProducerState}, obs.get())
	require.GreaterOrEqual(t, len(producers()), 2, "the new producer has a new producer id")
	got := toMessages(t, readAll(t, c, topic, len(msgs)), publisher.MessageIDHeaderDefault)
	require.Equal(t, ids(msgs), ids(got), "everything written once, in order")
}

// TestKafkaReplacesStalledProducer: every publish of the producer fails
// with a retriable error (NOT_LEADER_FOR_PARTITION, here only for its
// producer id) for longer than StallTimeout, not a single message
// acknowledged: the publisher replaces it, and publishing resumes.
func TestKafkaReplacesStalledProducer(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t)
	topic := c.Topic(t, 1)
	wedge(fake, kerr.NotLeaderForPartition)
	obs := &replacedCounter{}
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) {
		cfg.Observer = obs
		cfg.StallTimeout = 300 * time.Millisecond
		cfg.Configure = func(sc *sarama.Config) error {
			_ = fastConfig(sc)
			sc.Producer.Retry.Max = 1
			return nil
		}
	})

	msgs := publishertest.Messages(topic, "stalled", 10)
	eventuallyPublishes(t, k, msgs)
	require.Equal(t, int64(1), k.Replacements())
	require.Equal(t, []string{publisher.ReplaceStalled}, obs.get())
}

// TestKafkaNoReplacementWhileHealthy: failures that are about the
// message, and successes, never replace the producer.
func TestKafkaNoReplacementWhileHealthy(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.StallTimeout = time.Millisecond })
	for range 5 {
		msgs := publishertest.Messages(topic, "big", 2)
		msgs[0].Value = make([]byte, publisher.MaxMessageBytesDefault+1)
		_, err := k.Publish(testCtx(t), msgs)
		require.True(t, relay.IsPermanent(err))
		acked, err := k.Publish(testCtx(t), msgs[1:])
		require.NoError(t, err)
		require.Equal(t, 1, acked)
	}
	require.Zero(t, k.Replacements())
}

// eventuallyPublishes retries publishing msgs, as the relay would after
// its backoff, until the whole batch is acknowledged.
func eventuallyPublishes(t *testing.T, k *publisher.Kafka, msgs []relay.Message) {
	t.Helper()
	assert.EventuallyWithT(t, func(c *assert.CollectT) {
		acked, err := k.Publish(testCtx(t), msgs)
		assert.NoError(c, err)
		assert.Equal(c, len(msgs), acked)
	}, 30*time.Second, 50*time.Millisecond)
}

// TestKafkaReplacesProducerWhenOneBucketStalls: one bucket's partition is
// led by a broker that kfake removed and added back behind the same
// address. sarama keeps its connection to the removed broker, which
// answers NOT_LEADER_FOR_PARTITION while the metadata names it the leader,
// so every publish of that bucket fails, while another bucket's publishes
// through the same producer go through. The publisher replaces the
// producer once the bucket has failed for StallTimeout, and the bucket's
// messages go through on the new producer's connections.
func TestKafkaReplacesProducerWhenOneBucketStalls(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.NumBrokers(2))
	fake := c.RequireFake(t) // kfake only: a broker is removed and added back
	topic := c.Topic(t, 2)
	require.NoError(t, fake.MoveTopicPartition(topic, 0, 0))
	require.NoError(t, fake.MoveTopicPartition(topic, 1, 1))
	obs := &replacedCounter{}
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) {
		cfg.Observer = obs
		cfg.StallTimeout = 2 * time.Second
		cfg.Producers = 1 // both buckets on one producer
		cfg.LingerBatch = -1
		cfg.Configure = func(sc *sarama.Config) error {
			_ = fastConfig(sc)
			sc.Producer.Retry.Max = 2
			return nil
		}
	})
	// Bucket 0 writes to partition 0, bucket 1 to partition 1.
	batch := func(bucket int, prefix string) []relay.Message {
		msgs := publishertest.Messages(topic, prefix, 1)
		p := int32(bucket)
		msgs[0].Partition, msgs[0].Bucket = &p, bucket
		return msgs
	}
	ctx := testCtx(t)
	for b := range 2 {
		acked, err := k.Publish(ctx, batch(b, "before"))
		require.NoError(t, err)
		require.Equal(t, 1, acked)
	}

	readdFirstNode(t, fake, topic)
	require.NoError(t, fake.MoveTopicPartition(topic, 1, 1)) // adding a node moved partitions

	start := time.Now()
	var failures, others int
	require.Eventually(t, func() bool {
		// The other bucket goes through (it may fail while the cluster
		// changes): the producer as a whole does not fail every publish.
		acked, err := k.Publish(ctx, batch(1, "other"))
		if err == nil {
			require.Equal(t, 1, acked)
			others++
		} else {
			require.True(t, relay.IsUnavailable(err), "%v", err)
		}
		acked, err = k.Publish(ctx, batch(0, "after"))
		if err == nil {
			require.Equal(t, 1, acked)
			return true
		}
		failures++
		require.True(t, relay.IsUnavailable(err), "%v", err)
		if k.Replacements() == 0 {
			require.ErrorIs(t, err, sarama.ErrNotLeaderForPartition, "the removed broker's connection answers")
		}
		return false
	}, time.Minute, 20*time.Millisecond, "bucket 0's message goes through")
	require.Equal(t, int64(1), k.Replacements())
	require.Equal(t, []string{publisher.ReplaceStalled}, obs.get())
	require.Greater(t, others, failures/2, "bucket 1's publishes went through while bucket 0's failed")
	t.Logf("%d failed publishes of bucket 0 (and %d of bucket 1 through), then a replacement; through after %s",
		failures, others, time.Since(start).Round(time.Millisecond))
}

// readdFirstNode removes fake's node 0 and adds it back behind the same
// address, leading partition 0 of topic again. A client's connection to
// the removed broker stays open, and the removed broker answers it
// NOT_LEADER_FOR_PARTITION while the metadata names node 0 the leader.
func readdFirstNode(t *testing.T, fake *kfake.Cluster, topic string) {
	t.Helper()
	_, portText, _ := strings.Cut(fake.ListenAddrs()[0], ":")
	port, err := strconv.Atoi(portText)
	require.NoError(t, err)
	require.NoError(t, fake.RemoveNode(0))
	_, _, err = fake.AddNode(0, port)
	require.NoError(t, err)
	require.NoError(t, fake.MoveTopicPartition(topic, 0, 0))
}
