package publisher_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

func TestKafkaConformance(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	runConformance(t, c, func(t *testing.T) relay.Publisher { return newKafka(t, c) })
}

// runConformance runs the publisher conformance suite on c against the
// publishers newPublisher returns, one per case.
func runConformance(t *testing.T, c *kafkatest.Cluster, newPublisher func(t *testing.T) relay.Publisher) {
	publishertest.Run(t, func(t *testing.T) *publishertest.Sink {
		topic := c.Topic(t, 1)
		return &publishertest.Sink{
			Publisher: newPublisher(t),
			Topic:     topic,
			Read: func(t *testing.T, n int) []relay.Message {
				return toMessages(t, readAll(t, c, topic, n), publisher.MessageIDHeaderDefault)
			},
			Reject: func(m *relay.Message) {
				m.Value = make([]byte, publisher.MaxMessageBytesDefault+1)
			},
		}
	})
}

func TestKafkaHeadersAndKeys(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.MessageIDHeader = "my-id" })

	msgs := []relay.Message{
		{MessageID: "id-1", Topic: topic, Key: []byte("a"), Value: []byte("v1"),
			Headers: []relay.Header{{Key: "trace", Value: []byte("t1")}, {Key: "my-id", Value: []byte("user's own")}}},
		{MessageID: "", Topic: topic, Key: []byte("a"), Value: []byte("v2")},
		{MessageID: "id-3", Topic: topic, Key: []byte("a"), Value: []byte("v3"), Headers: []relay.Header{{Key: "n", Value: nil}}},
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, 3, acked)

	recs := readAll(t, c, topic, 3)
	require.Len(t, recs, 3)
	p := publisher.KeyPartition([]byte("a"), 3)
	for _, r := range recs {
		require.Equal(t, p, r.Partition)
		require.Equal(t, []byte("a"), r.Key)
	}
	require.Equal(t, []kafkatest.Header{
		{Key: "trace", Value: []byte("t1")},
		{Key: "my-id", Value: []byte("user's own")}, // user headers are kept as they are
		{Key: "my-id", Value: []byte("id-1")},       // the stamped id comes last
	}, recs[0].Headers)
	require.Empty(t, recs[1].Headers, "no id header for an empty MessageID")
	require.Equal(t, []kafkatest.Header{{Key: "n", Value: nil}, {Key: "my-id", Value: []byte("id-3")}}, recs[2].Headers)
}

// TestKafkaBatchInFlightAtOnce checks that a batch travels in a handful of
// produce requests, not one round trip per message.
func TestKafkaBatchInFlightAtOnce(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: counts the produce requests the broker receives
	topic := c.Topic(t, 2)
	k := newKafka(t, c)
	requests := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Observe: true, Count: -1})

	msgs := publishertest.Messages(topic, "inflight", 500)
	for i := range msgs {
		msgs[i].Key = fmt.Appendf(nil, "key-%d", i%10)
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)
	t.Logf("%d messages in %d produce requests", len(msgs), requests.Hits())
	require.LessOrEqual(t, requests.Hits(), len(msgs)/5, "at least five messages per request on average")
}

func TestKafkaPerKeyOrder(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 4)
	k := newKafka(t, c)

	const keys, perKey = 10, 50
	var msgs []relay.Message
	for i := range perKey {
		for key := range keys {
			msgs = append(msgs, relay.Message{
				MessageID: fmt.Sprintf("k%d-%03d", key, i),
				Topic:     topic,
				Key:       fmt.Appendf(nil, "key-%d", key),
				Value:     fmt.Appendf(nil, "%d", i),
			})
		}
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)

	recs := readAll(t, c, topic, len(msgs))
	require.Len(t, recs, len(msgs))
	got := map[string][]kafkatest.Record{}
	for _, r := range recs {
		got[string(r.Key)] = append(got[string(r.Key)], r)
	}
	for key := range keys {
		rs := got[fmt.Sprintf("key-%d", key)]
		require.Len(t, rs, perKey)
		for i, r := range rs {
			require.Equal(t, rs[0].Partition, r.Partition, "one key, one partition")
			require.Equal(t, fmt.Appendf(nil, "%d", i), r.Value, "key-%d: record %d out of order", key, i)
		}
	}
}

func TestKafkaKeyPlacement(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	const partitions = 7
	topic := c.Topic(t, partitions)
	k := newKafka(t, c)

	keys := [][]byte{{}, {}, {}, []byte("21"), []byte("foobar"), []byte("a-little-bit-long-string"), []byte("abc"), {0xff, 0x00, 0x80}}
	for i := range 40 {
		keys = append(keys, fmt.Appendf(nil, "order-%d", i))
	}
	msgs := make([]relay.Message, len(keys))
	for i, key := range keys {
		msgs[i] = relay.Message{MessageID: fmt.Sprint(i), Topic: topic, Key: key, Value: []byte("x")}
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)

	recs := readAll(t, c, topic, len(msgs))
	require.Len(t, recs, len(msgs))
	seen := map[int32]bool{}
	for _, r := range recs {
		require.NotNil(t, r.Key)
		require.Equal(t, publisher.KeyPartition(r.Key, partitions), r.Partition, "key %q", r.Key)
		seen[r.Partition] = true
	}
	require.Greater(t, len(seen), 1, "keys spread over partitions")
	// The empty key is hashed, not sprayed: all three landed together.
	emptyPart := publisher.KeyPartition([]byte{}, partitions)
	n := 0
	for _, r := range recs {
		if len(r.Key) == 0 {
			require.Equal(t, emptyPart, r.Partition)
			n++
		}
	}
	require.Equal(t, 3, n)
}

func TestKafkaPinnedPartition(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)
	k := newKafka(t, c)

	key := []byte("pinned")
	pin := (publisher.KeyPartition(key, 3) + 1) % 3 // not where the key would go
	keyless := int32(2)
	msgs := []relay.Message{
		{MessageID: "pinned-keyed", Topic: topic, Key: key, Value: []byte("1"), Partition: &pin},
		{MessageID: "pinned-keyless", Topic: topic, Value: []byte("2"), Partition: &keyless},
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, 2, acked)
	got := toMessages(t, readAll(t, c, topic, 2), publisher.MessageIDHeaderDefault)
	byID := map[string]int32{}
	for _, m := range got {
		byID[m.MessageID] = *m.Partition
	}
	require.Equal(t, map[string]int32{"pinned-keyed": pin, "pinned-keyless": keyless}, byID)

	t.Run("OutOfRange", func(t *testing.T) {
		t.Parallel()
		bad := int32(3)
		acked, err := k.Publish(testCtx(t), []relay.Message{
			{MessageID: "ok", Topic: topic, Value: []byte("ok"), Partition: &keyless},
			{MessageID: "bad", Topic: topic, Value: []byte("bad"), Partition: &bad},
		})
		require.Equal(t, 1, acked)
		require.ErrorIs(t, err, sarama.ErrInvalidPartition)
		require.True(t, relay.IsPermanent(err))
	})
	t.Run("Negative", func(t *testing.T) {
		t.Parallel()
		neg := int32(-1)
		acked, err := k.Publish(testCtx(t), []relay.Message{{MessageID: "neg", Topic: topic, Partition: &neg}})
		require.Zero(t, acked)
		require.ErrorIs(t, err, sarama.ErrInvalidPartition)
		require.True(t, relay.IsPermanent(err))
	})
}

func TestKafkaKeyless(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 4)
	k := newKafka(t, c)

	msgs := publishertest.Messages(topic, "keyless", 200)
	for i := range msgs {
		msgs[i].Key = nil
	}
	acked, err := k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)

	recs := readAll(t, c, topic, len(msgs))
	require.Len(t, recs, len(msgs))
	seen := map[int32]bool{}
	for _, r := range recs {
		require.Nil(t, r.Key)
		seen[r.Partition] = true
	}
	// Random placement: all 200 in one of 4 partitions has probability 4^-199.
	require.Greater(t, len(seen), 1)
}

// sizedValue returns a value length for which sarama's size estimate of the
// record the publisher builds for m is exactly limit+delta bytes.
func sizedValue(m relay.Message, limit, delta int) []byte {
	pm := &sarama.ProducerMessage{Key: sarama.ByteEncoder(m.Key)}
	for _, h := range m.Headers {
		pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
	}
	pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(publisher.MessageIDHeaderDefault), Value: []byte(m.MessageID)})
	overhead := pm.ByteSize(2) // record format v2, Kafka >= 0.11
	v := make([]byte, limit-overhead+delta)
	_, _ = rand.Read(v)
	return v
}

func TestKafkaSizeBand(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	k := newKafka(t, c)

	msgs := publishertest.Messages(topic, "size", 5)
	msgs[1].Value = sizedValue(msgs[1], publisher.MaxMessageBytesDefault, 0) // exactly the limit: accepted
	msgs[3].Value = sizedValue(msgs[3], publisher.MaxMessageBytesDefault, 1) // one byte over: rejected
	acked, err := k.Publish(testCtx(t), msgs)
	require.Equal(t, 3, acked, "the prefix before the oversized record is acknowledged")
	require.True(t, publisher.IsTooLarge(err), "%v", err)
	require.True(t, relay.IsPermanent(err), "%v", err)
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.Equal(t, 3, perr.Index)
	require.Equal(t, msgs[3].MessageID, perr.MessageID)
	var cerr sarama.ConfigurationError
	require.ErrorAs(t, err, &cerr, "sarama rejected it client-side")
	// The cause comes first, in words and with its numbers; then where;
	// then sarama's own text, whole.
	size := publisher.MaxMessageBytesDefault + 1
	require.Equal(t, size, perr.Size)
	require.Equal(t, publisher.MaxMessageBytesDefault, perr.Limit)
	require.Nil(t, perr.Partition, "refused before it was partitioned")
	require.False(t, perr.MaybeWritten, "refused before it was sent")
	require.True(t, strings.HasPrefix(err.Error(),
		`record too large: 1,000,001 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic `+topic+`; message id "`+msgs[3].MessageID+`", key "`),
		"%v", err)
	require.Contains(t, err.Error(), "; sink error: permanent: publisher: message too large: "+cerr.Error())
	require.Contains(t, cerr.Error(), "1000001 > 1000000")
	require.NotContains(t, err.Error(), "message 3", "a batch position is no identity")

	// The record after the oversized one, of the same key, is held back
	// (see TestKafkaPartialFailure); the oversized one is never written.
	got := toMessages(t, readAll(t, c, topic, 3), publisher.MessageIDHeaderDefault)
	require.Equal(t, []string{msgs[0].MessageID, msgs[1].MessageID, msgs[2].MessageID}, ids(got))
	require.Equal(t, msgs[1].Value, got[1].Value)
}

// TestKafkaBrokerRejectsTooLarge covers a record under MaxMessageBytes that
// the topic's own max.message.bytes refuses: the broker answers
// MESSAGE_TOO_LARGE, for the whole batch the record travelled in.
func TestKafkaBrokerRejectsTooLarge(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1, kafkatest.TopicConfig("max.message.bytes", "10000"))
	k := newKafka(t, c)

	msgs := publishertest.Messages(topic, "broker-size", 1)
	msgs[0].Value = make([]byte, 20_000)
	_, _ = rand.Read(msgs[0].Value)
	acked, err := k.Publish(testCtx(t), msgs)
	require.Zero(t, acked)
	require.ErrorIs(t, err, sarama.ErrMessageSizeTooLarge)
	require.True(t, publisher.IsTooLarge(err))
	require.True(t, relay.IsPermanent(err))
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.NotNil(t, perr.Partition)
	require.Equal(t, int32(0), *perr.Partition)
	require.Greater(t, perr.Size, 20_000)
	require.True(t, strings.HasPrefix(err.Error(), "record too large for the broker (MESSAGE_TOO_LARGE): the broker refused the record batch it travelled in; "+
		"the record is "+groupDigits(perr.Size)+" bytes, the producer's limit 1,000,000 (Producer.MaxMessageBytes); the topic's max.message.bytes"), "%v", err)
	require.Contains(t, err.Error(), "; topic "+topic+", partition 0; message id ")
	require.Contains(t, err.Error(), sarama.ErrMessageSizeTooLarge.Error())
}

// groupDigits writes n with thousands separators, as the errors do.
func groupDigits(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// TestKafkaPartialFailure is the case that decides what at-least-once means
// for consumers. Rows 1, 2 and 3 share a key; row 1 is too large.
//
// sarama rejects row 1 client-side, before sending it, while rows 2 and 3
// are already in the producer's pipeline. The publisher's order gate holds
// them back: a record is written only after the previous record of its key
// in the batch reached the produce request. Publish reports acked=0 with a
// permanent too-large error and the broker holds nothing, so the key is
// never written out of order.
func TestKafkaPartialFailure(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)
	k := newKafka(t, c)

	msgs := publishertest.Messages(topic, "row", 3)
	msgs[0].Value = make([]byte, publisher.MaxMessageBytesDefault+1)
	other := relay.Message{MessageID: "other-key", Topic: topic, Key: []byte("another key"), Value: []byte("v")}
	batch := append(slices.Clone(msgs), other)
	acked, err := k.Publish(testCtx(t), batch)
	require.Zero(t, acked)
	require.True(t, relay.IsPermanent(err))
	require.True(t, publisher.IsTooLarge(err))
	// The other key's message is written but outside the acknowledged
	// prefix: the error says a copy of it may be out already. Rows 2 and 3
	// were held back, never written.
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.Equal(t, []string{other.MessageID}, perr.LaterMaybeWritten)

	// Publish waited for every result of the batch, so what the broker
	// holds is final: only the message of the other key.
	got := toMessages(t, readAll(t, c, topic, 1), publisher.MessageIDHeaderDefault)
	require.Equal(t, []string{other.MessageID}, ids(got))

	// The relay retries the unacknowledged tail (here with row 1 fixed):
	// the key arrives complete and in order.
	msgs[0].Value = []byte("fixed")
	acked, err = k.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	got = toMessages(t, readAll(t, c, topic, 4), publisher.MessageIDHeaderDefault)
	var key []string
	for _, m := range got {
		if string(m.Key) == string(msgs[0].Key) {
			key = append(key, m.MessageID)
		}
	}
	require.Equal(t, ids(msgs), key)
}

func TestKafkaUnknownTopicIsRetryable(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	if c.AutoCreatesTopics(t) {
		t.Skip("the cluster creates topics on demand (auto.create.topics.enable); scripts/kafka.sh runs Apache Kafka without it")
	}
	k := newKafka(t, c)

	acked, err := k.Publish(testCtx(t), publishertest.Messages("no-such-topic", "x", 2))
	require.Zero(t, acked)
	require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition)
	require.False(t, relay.IsPermanent(err), "%v", err)
	require.True(t, strings.HasPrefix(err.Error(), `unknown topic "no-such-topic": the cluster has no such topic`), "%v", err)

	requireUnknownTopicCounted(t, k)
}

// requireUnknownTopicCounted publishes to a missing topic until sarama's
// circuit breaker of the topic opened (three failed lookups) and fails
// its messages without a lookup: every failure is still the unknown
// topic's (transient, counted by the relay), never an outage
// (relay.Unavailable, which the relay does not count).
func requireUnknownTopicCounted(t *testing.T, p relay.Publisher) {
	t.Helper()
	breakerSeen := false
	for i := range 6 {
		acked, err := p.Publish(testCtx(t), publishertest.Messages("no-such-topic", fmt.Sprint("again-", i), 1))
		require.Zero(t, acked)
		require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition, "publish %d", i)
		require.False(t, relay.IsUnavailable(err), "publish %d: %v", i, err)
		require.False(t, relay.IsPermanent(err), "publish %d: %v", i, err)
		require.True(t, strings.HasPrefix(err.Error(), `unknown topic "no-such-topic": the cluster has no such topic`), "%v", err)
		breakerSeen = breakerSeen || errors.Is(err, breaker.ErrBreakerOpen)
	}
	require.True(t, breakerSeen, "the topic's circuit breaker opened")
}

func TestKafkaInvalidTopicIsNamed(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	k := newKafka(t, c)

	acked, err := k.Publish(testCtx(t), publishertest.Messages("no spaces allowed", "x", 1))
	require.Zero(t, acked)
	require.True(t, relay.IsPermanent(err), "%v", err)
	require.True(t, strings.HasPrefix(err.Error(), `invalid topic name "no spaces allowed": Kafka topic names are`), "%v", err)
	require.ErrorIs(t, err, sarama.ErrInvalidTopic)

	acked, err = k.Publish(testCtx(t), publishertest.Messages("", "x", 1))
	require.Zero(t, acked)
	require.True(t, strings.HasPrefix(err.Error(), `message has no topic; topic (none); message id "x-`), "%v", err)
}

func TestKafkaAuthorizationFailureIsPermanent(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the test cluster runs without an authorizer
	topic := c.Topic(t, 1)
	k := newKafka(t, c)

	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
	acked, err := k.Publish(testCtx(t), publishertest.Messages(topic, "denied", 3))
	require.Zero(t, acked)
	require.ErrorIs(t, err, sarama.ErrTopicAuthorizationFailed)
	require.True(t, relay.IsPermanent(err))
}

// publishAndCount publishes n messages of one key as the relay does: the
// whole batch, then what follows the acknowledged prefix, until every
// message is acknowledged. A retry inside the producer may cut the batch
// (the order gate holds back what waits for an acknowledgement), but only
// with an unavailable error, and the broker then holds each message exactly
// once, in order.
func publishAndCount(t *testing.T, c *kafkatest.Cluster, k *publisher.Kafka, topic string, n int) {
	t.Helper()
	msgs := publishertest.Messages(topic, "fault", n)
	rest, calls := msgs, 0
	for len(rest) > 0 {
		calls++
		require.LessOrEqual(t, calls, 10, "publishing %d messages took too many calls", n)
		acked, err := k.Publish(testCtx(t), rest)
		if err != nil {
			require.True(t, relay.IsUnavailable(err), "a cut batch must be unavailable, not %v", err)
		}
		require.True(t, acked > 0 || err != nil, "no progress without an error")
		rest = rest[acked:]
	}
	t.Logf("%d messages published in %d calls", n, calls)
	require.Equal(t, int64(n), c.RecordCount(t, topic), "no duplicates on the broker")
	got := toMessages(t, readAll(t, c, topic, n), publisher.MessageIDHeaderDefault)
	require.Equal(t, ids(msgs), ids(got))
}

// TestKafkaProduceFaults has the broker answer a partition's produce
// requests with an error a number of times, then normally:
//   - NOT_LEADER once: the producer refreshes metadata and retries;
//   - NOT_LEADER one time more than the producer retries (fastConfig: 10):
//     the first request's records fail for good while the records that
//     waited behind them are sent again under a bumped producer epoch, and
//     without the order gate on retries they would be written ahead of the
//     failed ones;
//   - REQUEST_TIMED_OUT after appending, as a broker does when replication
//     outlasts the request timeout: only the idempotent producer's
//     sequence numbers keep the retry from writing the records twice.
//
// Published as the relay does, the broker holds every message once, in
// submission order.
func TestKafkaProduceFaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		err   *kerr.Error
		count int
	}{
		{"not leader once", kerr.NotLeaderForPartition, 1},
		{"retries run out", kerr.NotLeaderForPartition, 11},
		{"appended but failed", kerr.RequestTimedOut, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := kafkatest.Start(t)
			fake := c.RequireFake(t) // kfake only: the broker answers errors on demand
			topic := c.Topic(t, 1)
			k := newKafka(t, c)

			h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: tc.err, Count: tc.count})
			publishAndCount(t, c, k, topic, 300)
			require.Equal(t, tc.count, h.Hits())
		})
	}
}

// TestKafkaFaultDroppedReply has the broker swallow a produce request
// without answering: the producer times out, reconnects and retries.
func TestKafkaFaultDroppedReply(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker swallows a produce request
	topic := c.Topic(t, 1)
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) {
		cfg.Configure = func(sc *sarama.Config) error {
			_ = fastConfig(sc)
			sc.Net.ReadTimeout = 500 * time.Millisecond
			return nil
		}
	})

	var n atomic.Int32
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		n.Add(1)
		// Handled with neither response nor error: the broker keeps the
		// connection and never answers. Handling drops this control, so
		// only the first produce request is swallowed.
		return nil, nil, true
	})
	publishAndCount(t, c, k, topic, 300)
	require.Equal(t, int32(1), n.Load())
}

// holdProduce makes the broker hold the first produce request until release
// is closed; held is closed once it is held.
func holdProduce(fake *kfake.Cluster) (held, release chan struct{}) {
	return kafkatest.HoldRequest(fake, kmsg.Produce, nil)
}

func TestKafkaContextCancelledMidPublish(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce request
	topic := c.Topic(t, 1)
	k := newKafka(t, c)
	held, release := holdProduce(fake)

	msgs := publishertest.Messages(topic, "cancelled", 20)
	ctx, cancel := context.WithCancel(context.Background())
	done := publishAsync(ctx, k, msgs)
	<-held
	cancel()
	r := <-done
	require.Zero(t, r.acked)
	require.ErrorIs(t, r.err, context.Canceled)

	// The records were handed to the producer before the cancellation; they
	// still land once the broker answers, and their results are dropped
	// without blocking the publisher.
	close(release)
	marker := publishertest.Messages(topic, "marker", 1)
	acked, err := k.Publish(testCtx(t), marker)
	require.NoError(t, err)
	require.Equal(t, 1, acked)
	// How many were handed over before the cancellation is up to timing,
	// but at least the first (it is in the held request), and in order.
	got := ids(toMessages(t, readAll(t, c, topic, 2), publisher.MessageIDHeaderDefault))
	require.GreaterOrEqual(t, len(got), 2)
	require.Equal(t, marker[0].MessageID, got[len(got)-1])
	require.Equal(t, ids(msgs)[:len(got)-1], got[:len(got)-1])
}

// heldPublish starts a Kafka publisher on a kfake cluster that holds the
// first produce request, and publishes n messages to a new topic of
// partitions partitions on a goroutine: once it returns, the batch is on
// its way (Publish is past its closed check) and the broker holds it
// until release is closed. The Publish's answer arrives on done.
func heldPublish(t *testing.T, partitions int32, n int, label string) (c *kafkatest.Cluster, k *publisher.Kafka, msgs []relay.Message, done <-chan publishResult, release chan struct{}) {
	t.Helper()
	c = kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce request
	topic := c.Topic(t, partitions)
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: c.Brokers(), Configure: fastConfig})
	require.NoError(t, err)
	require.NoError(t, k.Start(t.Context()))
	held, release := holdProduce(fake)

	msgs = publishertest.Messages(topic, label, n)
	done = publishAsync(context.Background(), k, msgs)
	<-held
	return c, k, msgs, done, release
}

func TestKafkaCloseFlushes(t *testing.T) {
	t.Parallel()
	c, k, msgs, done, release := heldPublish(t, 2, 50, "flush")

	closed := make(chan error, 1)
	go func() { closed <- k.Close() }()
	close(release)
	require.NoError(t, <-closed)
	// Close returned only after the in-flight records were acknowledged,
	// and the Publish that sent them got its full answer.
	require.Equal(t, int64(len(msgs)), c.RecordCount(t, msgs[0].Topic))
	r := <-done
	require.NoError(t, r.err)
	require.Equal(t, len(msgs), r.acked)
}

// Stop is bounded by its context even when the broker never answers: with
// a produce request held, Stop returns the context's error while the flush
// goes on in the background, so a shutdown fits a termination grace period.
// The flush still completes once the broker answers: Stopped closes, the
// Publish that was waiting gets its full answer, and every record is on
// the broker. Close, which has no deadline, would still be waiting.
func TestKafkaStopBoundedByContext(t *testing.T) {
	t.Parallel()
	c, k, msgs, done, release := heldPublish(t, 1, 20, "bounded")

	ctx, cancel := context.WithCancel(testCtx(t))
	stopped := make(chan error, 1)
	go func() { stopped <- k.Stop(ctx) }()
	cancel()
	require.ErrorIs(t, <-stopped, context.Canceled)
	select {
	case <-k.Stopped():
		t.Fatal("Stopped closed while the broker still held the flush")
	case r := <-done:
		t.Fatalf("Publish returned (%d, %v) while the broker still held its batch", r.acked, r.err)
	default:
	}
	_, err := k.Publish(testCtx(t), msgs[:1])
	require.ErrorIs(t, err, publisher.ErrClosed, "a stopping publisher takes no new batch")

	close(release)
	<-k.Stopped()
	require.NoError(t, k.Err())
	r := <-done
	require.NoError(t, r.err)
	require.Equal(t, len(msgs), r.acked)
	require.Equal(t, ids(msgs), ids(toMessages(t, readAll(t, c, msgs[0].Topic, len(msgs)), publisher.MessageIDHeaderDefault)))
}

// TestKafkaCloseDuringPublish closes the publisher while a large batch is
// on its way, with no broker fault, so it runs on Apache Kafka as well:
// Close waits for what was handed to the producer, the Publish returns
// (with the whole batch or an acknowledged prefix and an error), and every
// record it reports acknowledged is on the broker.
func TestKafkaCloseDuringPublish(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2)
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: c.Brokers(), Configure: fastConfig})
	require.NoError(t, err)
	require.NoError(t, k.Start(t.Context()))

	msgs := publishertest.Messages(topic, "close", 5000)
	done := publishAsync(context.Background(), k, msgs)
	// Wait until the batch is on its way: the first records are stored.
	// (Polled on the test goroutine: RecordCount fails t on an admin error.)
	for deadline := time.Now().Add(30 * time.Second); c.RecordCount(t, topic) == 0; {
		require.True(t, time.Now().Before(deadline), "no record of the batch reached the broker within 30 s")
		time.Sleep(time.Millisecond)
	}

	require.NoError(t, k.Close())
	r := <-done // Close returned, so Publish has its answer
	if r.err == nil {
		require.Equal(t, len(msgs), r.acked)
	} else {
		require.ErrorIs(t, r.err, publisher.ErrClosed)
	}
	require.GreaterOrEqual(t, c.RecordCount(t, topic), int64(r.acked), "every acknowledged record is on the broker")
	got := ids(toMessages(t, c.ReadLog(t, topic, 30*time.Second), publisher.MessageIDHeaderDefault))
	seen := map[string]bool{}
	for _, id := range got {
		seen[id] = true
	}
	for _, m := range msgs[:r.acked] {
		require.True(t, seen[m.MessageID], "acknowledged message %s is on the broker", m.MessageID)
	}
}

func TestKafkaPublishAfterClose(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: c.Brokers(), Configure: fastConfig})
	require.NoError(t, err)
	require.NoError(t, k.Start(t.Context()))
	require.NoError(t, k.Close())
	require.NoError(t, k.Close(), "Close is idempotent")

	acked, err := k.Publish(testCtx(t), publishertest.Messages(topic, "late", 1))
	require.Zero(t, acked)
	require.ErrorIs(t, err, publisher.ErrClosed)
	_, err = k.Publish(testCtx(t), nil)
	require.ErrorIs(t, err, publisher.ErrClosed)
}

func TestKafkaConcurrentPublish(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 4)
	k := newKafka(t, c)

	const workers, batches, size = 6, 5, 100
	publishConcurrently(t, k, workers, batches, func(w, b int) []relay.Message {
		msgs := publishertest.Messages(topic, fmt.Sprintf("w%d-b%d", w, b), size)
		for i := range msgs {
			msgs[i].Key = fmt.Appendf(nil, "worker-%d", w)
		}
		return msgs
	})

	const total = workers * batches * size
	require.Equal(t, int64(total), c.RecordCount(t, topic))
	got := toMessages(t, readAll(t, c, topic, total), publisher.MessageIDHeaderDefault)
	perWorker := map[string][]string{}
	for _, m := range got {
		perWorker[string(m.Key)] = append(perWorker[string(m.Key)], m.MessageID)
	}
	for w := range workers {
		var want []string
		for b := range batches {
			want = append(want, ids(publishertest.Messages(topic, fmt.Sprintf("w%d-b%d", w, b), size))...)
		}
		require.Equal(t, want, perWorker[fmt.Sprintf("worker-%d", w)], "worker %d: order within its key", w)
	}
}

// TestKafkaBrokerRemovedMidBatch removes a broker while it holds a produce
// request of a large batch on a three-broker cluster, and adds a new broker:
// the held request is answered NOT_LEADER_FOR_PARTITION by the departed
// broker, and the producer must move to the new leaders. The relay's loop
// (republish the unacknowledged tail) must end with every message on the
// cluster.
func TestKafkaBrokerRemovedMidBatch(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.NumBrokers(3))
	fake := c.RequireFake(t) // kfake only: a broker removed while it holds a request; real broker kills run in test/chaos
	const partitions = 6
	topic := c.Topic(t, partitions)
	k := newKafka(t, c)

	msgs := publishertest.Messages(topic, "failover", 3000)
	for i := range msgs {
		msgs[i].Key = fmt.Appendf(nil, "key-%d", i%50)
		msgs[i].Value = make([]byte, 1024)
	}

	heldOn := make(chan int32, 1)
	release := make(chan struct{})
	var once sync.Once
	fake.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		first := false
		once.Do(func() { first = true })
		if !first {
			fake.DropControl()
			return nil, nil, false
		}
		heldOn <- fake.CurrentNode()
		fake.SleepControl(func() { <-release })
		return nil, nil, false
	})

	done := publishAsync(context.Background(), k, msgs)
	victim := <-heldOn
	require.NoError(t, fake.RemoveNode(victim))
	_, _, err := fake.AddNode(-1, 0)
	require.NoError(t, err)
	close(release)

	r := <-done
	acked, attempts := r.acked, 1
	t.Logf("first attempt: %d of %d acknowledged, error %v", r.acked, len(msgs), r.err)
	for acked < len(msgs) {
		require.Less(t, attempts, 20, "still %d unacknowledged after %d attempts, last error %v", len(msgs)-acked, attempts, r.err)
		n, err := k.Publish(testCtx(t), msgs[acked:])
		r.err = err
		acked += n
		attempts++
	}
	t.Logf("all %d acknowledged after %d publish attempts", len(msgs), attempts)
	if attempts == 1 {
		// sarama retried internally; idempotence kept the retries of the
		// failed request from duplicating anything, leader change or not.
		require.Equal(t, int64(len(msgs)), c.RecordCount(t, topic))
	}

	got := toMessages(t, readAll(t, c, topic, len(msgs)), publisher.MessageIDHeaderDefault)
	held := map[string]bool{}
	for _, m := range got {
		held[m.MessageID] = true
	}
	for _, m := range msgs {
		require.True(t, held[m.MessageID], "message %s lost", m.MessageID)
	}
}

func TestNewKafkaErrors(t *testing.T) {
	t.Parallel()
	_, err := publisher.NewKafka(publisher.KafkaConfig{})
	require.ErrorContains(t, err, "Brokers")

	_, err = publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, MaxMessageBytes: -1})
	require.ErrorContains(t, err, "MaxMessageBytes")

	boom := errors.New("boom")
	_, err = publisher.NewKafka(publisher.KafkaConfig{
		Brokers:   []string{"127.0.0.1:1"},
		Configure: func(*sarama.Config) error { return boom },
	})
	require.ErrorIs(t, err, boom)

	_, err = publisher.NewKafka(publisher.KafkaConfig{
		Brokers:   []string{"127.0.0.1:1"},
		Configure: func(sc *sarama.Config) error { sc.Producer.Transaction.ID = "tx"; return nil },
	})
	require.ErrorContains(t, err, "Transaction.ID")

	for _, n := range []int{-1, publisher.ProducersMax + 1} {
		_, err = publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, Producers: n})
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, "Producers %d", n)
		require.Equal(t, "KafkaConfig.Producers", ce.Field)
	}
	require.Equal(t, publisher.ProducersDefault, publisher.KafkaConfig{}.WithDefaults().Producers)
}
