package publisher_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// sarama's broker metrics are rcrowley/go-metrics meters; the first
		// meter ever created starts one process-wide ticking goroutine that
		// the library never stops. It is not per producer, so it cannot
		// pile up.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// An open circuit breaker of a sarama producer (a topic that does
		// not exist) sleeps out its 10s open period on a goroutine of its
		// own, even after the producer closed; it then ends.
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
	)
}

// fastConfig keeps retries and timeouts short so fault tests stay fast.
func fastConfig(sc *sarama.Config) error {
	sc.ClientID = "outbox-publisher-test"
	sc.Producer.Retry.Max = 10
	sc.Producer.Retry.Backoff = 10 * time.Millisecond
	sc.Producer.Timeout = 3 * time.Second
	sc.Metadata.Retry.Max = 5
	sc.Metadata.Retry.Backoff = 10 * time.Millisecond
	sc.Net.DialTimeout = 3 * time.Second
	sc.Net.ReadTimeout = 3 * time.Second
	sc.Net.WriteTimeout = 3 * time.Second
	return nil
}

// newKafka returns a started Kafka publisher on c, closed when the test
// ends.
func newKafka(t testing.TB, c *kafkatest.Cluster, mods ...func(*publisher.KafkaConfig)) *publisher.Kafka {
	t.Helper()
	cfg := publisher.KafkaConfig{
		Brokers:   c.Brokers(),
		Configure: fastConfig,
		Logger:    slog.New(slog.DiscardHandler),
	}
	for _, mod := range mods {
		mod(&cfg)
	}
	return publishertest.StartKafka(t, cfg)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// toMessages turns records into messages the way a consumer would: the
// message id header, which must be the last header, becomes MessageID.
func toMessages(t testing.TB, recs []kafkatest.Record, idHeader string) []relay.Message {
	t.Helper()
	out := make([]relay.Message, 0, len(recs))
	for _, r := range recs {
		m := relay.Message{Topic: r.Topic, Key: r.Key, Value: r.Value}
		p := r.Partition
		m.Partition = &p
		hs := r.Headers
		if n := len(hs); n > 0 && hs[n-1].Key == idHeader {
			m.MessageID = string(hs[n-1].Value)
			hs = hs[:n-1]
		}
		for _, h := range hs {
			require.NotEqual(t, idHeader, h.Key, "the message id header comes last and once")
			m.Headers = append(m.Headers, relay.Header{Key: h.Key, Value: h.Value})
		}
		out = append(out, m)
	}
	return out
}

// readAll reads everything topic holds once it holds at least n records.
func readAll(t testing.TB, c *kafkatest.Cluster, topic string, n int) []kafkatest.Record {
	t.Helper()
	recs := c.ReadAll(t, topic, n, 15*time.Second)
	if held := int(c.RecordCount(t, topic)); held > len(recs) {
		recs = c.ReadAll(t, topic, held, 15*time.Second)
	}
	return recs
}

func ids(msgs []relay.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.MessageID
	}
	return out
}
