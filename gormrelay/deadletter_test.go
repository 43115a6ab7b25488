package gormrelay_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// TestDeadLetterForTheOnCall runs the default failure policy against the
// Kafka protocol with one batch of three messages in one bucket:
//
//   - big (key "b"), one byte over the producer's MaxMessageBytes;
//   - first and second (key "k"), written by the broker in the same
//     produce round but outside the acknowledged prefix, since big failed
//     before them.
//
// After that first publish the topic refuses writes (authorization), so
// the relay dead-letters big (too large), then first (refused), and parks
// second behind it. The dead letters read as an operator needs them: the
// cause first with its numbers, no batch position, and for first and
// second that a copy may already have been delivered, which the topic
// confirms.
func TestDeadLetterForTheOnCall(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		cluster := kafkatest.Start(t)
		fake := cluster.RequireFake(t)
		topic := cluster.Topic(t, 1)
		k := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: cluster.Brokers(), Logger: dbtest.Logger(t)})

		// The first publish goes to Kafka as it is; then the topic
		// refuses every write.
		var calls atomic.Int32
		pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			acked, err := k.Publish(ctx, msgs)
			if calls.Add(1) == 1 {
				fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
			}
			return acked, err
		})

		big := outbox.MessageRow{MessageID: "big", Topic: topic, Key: []byte("b")}
		big.Value = make([]byte, publisher.MaxMessageBytesDefault+1-recordOverhead(t, big))
		b.insert(t, big,
			outbox.MessageRow{MessageID: "first", Topic: topic, Key: []byte("k"), Value: []byte("1")},
			outbox.MessageRow{MessageID: "second", Topic: topic, Key: []byte("k"), Value: []byte("2")})
		startRelay(t, b.store, pub, b.relayConfig(t, "oncall"))

		dead := b.waitDeadLetters(t, 3)
		const laterNote = `may have been delivered: it was sent in a batch whose earlier message "big" failed; the broker acknowledged it or did not answer, and the relay publishes it again`
		byID := map[string]gormrelay.DeadLetter{}
		for _, d := range dead {
			byID[d.MessageID] = d
		}

		d := byID["big"]
		require.Equal(t, gormrelay.DeadLetterFailed, d.State)
		require.True(t, strings.HasPrefix(d.LastError,
			`record too large: 1,000,001 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic `+topic+`; message id "big", key "b"; sink error: `),
			d.LastError)
		require.Contains(t, d.LastError, "Attempt to produce message larger than configured Producer.MaxMessageBytes: 1000001 > 1000000")
		require.NotContains(t, d.LastError, "message 0")
		require.False(t, d.MaybeDelivered, "refused before it was sent: %s", d.LastError)

		d = byID["first"]
		require.Equal(t, gormrelay.DeadLetterFailed, d.State)
		require.True(t, strings.HasPrefix(d.LastError, `not authorized to write to topic "`+topic+`"; topic `+topic+`, partition 0; message id "first", key "k"`), d.LastError)
		require.True(t, d.MaybeDelivered, d.LastError)
		require.Equal(t, laterNote, d.DeliveryNote, "the note survives the message's own failure")
		require.True(t, strings.HasSuffix(d.LastError, "\n"+laterNote), d.LastError)

		d = byID["second"]
		require.Equal(t, gormrelay.DeadLetterParked, d.State)
		require.True(t, d.MaybeDelivered, d.LastError)
		require.Equal(t, laterNote, d.DeliveryNote)

		// It was: both reached the topic before they became dead letters.
		got := map[string]bool{}
		for _, r := range cluster.ReadAll(t, topic, 2, 30*time.Second) {
			got[string(r.Value)] = true
		}
		require.Equal(t, map[string]bool{"1": true, "2": true}, got)
	})
}

// recordOverhead is what the producer counts of m beyond its value: key,
// framing and the message-id header (record format v2).
func recordOverhead(t *testing.T, m outbox.MessageRow) int {
	t.Helper()
	pm := sarama.ProducerMessage{Key: sarama.ByteEncoder(m.Key), Value: sarama.ByteEncoder{},
		Headers: []sarama.RecordHeader{{Key: []byte(publisher.MessageIDHeaderDefault), Value: []byte(m.MessageID)}}}
	return pm.ByteSize(2)
}

// TestDeadLetterBrokerTooLarge: a record under the producer's limit that
// the topic's max.message.bytes refuses is dead-lettered with the broker's
// refusal in words and the record's size.
func TestDeadLetterBrokerTooLarge(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		cluster := kafkatest.Start(t)
		topic := cluster.Topic(t, 1, kafkatest.TopicConfig("max.message.bytes", "10000"))
		k := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: cluster.Brokers(), Logger: dbtest.Logger(t)})

		b.insert(t,
			outbox.MessageRow{MessageID: "small", Topic: topic, Key: []byte("s"), Value: []byte("fits")},
			outbox.MessageRow{MessageID: "wide", Topic: topic, Key: []byte("w"), Value: make([]byte, 20_000)})
		startRelay(t, b.store, k, b.relayConfig(t, "broker-size"))

		dead := b.waitDeadLetters(t, 1)
		d := dead[0]
		require.Equal(t, "wide", d.MessageID)
		require.True(t, strings.HasPrefix(d.LastError, "record too large for the broker (MESSAGE_TOO_LARGE): the broker refused the record batch it travelled in; the record is 20,"), d.LastError)
		require.Contains(t, d.LastError, " bytes, the producer's limit 1,000,000 (Producer.MaxMessageBytes); the topic's max.message.bytes (or the broker's message.max.bytes) is lower; topic "+topic+", partition 0; message id \"wide\", key \"w\"; sink error: ")
		require.Contains(t, d.LastError, sarama.ErrMessageSizeTooLarge.Error())
		require.False(t, d.MaybeDelivered, d.LastError)
		// The small one was published (the relay split the refused batch).
		recs := cluster.ReadAll(t, topic, 1, 30*time.Second)
		require.Equal(t, "fits", string(recs[0].Value))
	})
}

// waitDeadLetters waits until the outbox holds n dead letters and returns
// them.
func (b *storeBundle) waitDeadLetters(t *testing.T, n int) []gormrelay.DeadLetter {
	t.Helper()
	var dead []gormrelay.DeadLetter
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		page, err := b.newAdmin(t).DeadLetters(context.Background(), gormrelay.DeadLetterQuery{})
		if assert.NoError(c, err) {
			dead = page.Items
			assert.Len(c, dead, n)
		}
	}, 30*time.Second, 20*time.Millisecond)
	return dead
}
