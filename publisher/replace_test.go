package publisher_test

import (
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
