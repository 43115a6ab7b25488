package publisher_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// outage makes the kfake broker drop every request, as an unreachable
// cluster would, while the returned flag is set.
func outage(fake *kfake.Cluster) *atomic.Bool {
	down := new(atomic.Bool)
	fake.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if down.Load() {
			return nil, errors.New("outage: connection dropped"), true
		}
		return nil, nil, false
	})
	return down
}

// ProbeSink fails while no broker answers, though the publisher's
// producers hold connections and metadata from before the outage and its
// CheckReady still answers, and succeeds once the brokers answer again:
// it asks a broker, not the publisher's state.
func TestProbeSinkSeesTheBrokersGoAndReturn(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t)
	topic := c.Topic(t, 1)
	down := outage(fake)
	obs := &replacedCounter{}
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.Observer = obs; cfg.Producers = 1 })
	tx, err := publisher.NewTransactional(publisher.TransactionalConfig{Brokers: c.Brokers(), Configure: fastConfig, TransactionalIDPrefix: "probe-"})
	require.NoError(t, err)
	probers := map[string]relay.SinkProber{"kafka": k, "transactional": tx,
		"tracing": publisher.TracingPublisher(k, nil).(relay.SinkProber)}

	ctx := testCtx(t)
	n, err := k.Publish(ctx, publishertest.Messages(topic, "before", 3))
	require.NoError(t, err)
	require.Equal(t, 3, n)
	for name, p := range probers {
		require.NoError(t, p.ProbeSink(ctx), name)
	}

	down.Store(true)
	// Enough failed publishes to open sarama's circuit breakers.
	for range 4 {
		_, err = k.Publish(ctx, publishertest.Messages(topic, "during", 1))
		require.True(t, relay.IsUnavailable(err), "a publish fails as unavailable meanwhile: %v", err)
	}
	for name, p := range probers {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		require.Error(t, p.ProbeSink(pctx), name)
		cancel()
	}
	require.NoError(t, k.CheckReady(ctx), "CheckReady reads the publisher's state only")
	require.Zero(t, k.Replacements())

	down.Store(false)
	for name, p := range probers {
		require.NoError(t, p.ProbeSink(ctx), name)
	}
	// The failing producer was replaced by the probe that answered: the
	// next publish goes through, not held back by the old producer's open
	// breakers.
	require.Equal(t, []string{publisher.ReplaceBrokersBack}, obs.get())
	n, err = k.Publish(ctx, publishertest.Messages(topic, "after", 1))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, k.ProbeSink(ctx))
	require.Equal(t, int64(1), k.Replacements(), "a probe replaces only a failing producer")
}

// A producer that fails while the brokers answer every probe (here the
// cluster refuses its produce requests with NOT_LEADER_FOR_PARTITION) is
// not replaced by the probes: only one that failed through an outage is.
func TestProbeSinkKeepsAProducerFailingWhileBrokersAnswer(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t)
	topic := c.Topic(t, 1)
	wedge(fake, kerr.NotLeaderForPartition)
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) {
		cfg.Producers = 1
		cfg.Configure = func(sc *sarama.Config) error {
			_ = fastConfig(sc)
			sc.Producer.Retry.Max = 1
			return nil
		}
	})
	ctx := testCtx(t)
	for range 3 {
		_, err := k.Publish(ctx, publishertest.Messages(topic, "m", 1))
		require.True(t, relay.IsUnavailable(err), "%v", err)
		require.NoError(t, k.ProbeSink(ctx))
	}
	require.Zero(t, k.Replacements())
}

// A topic that does not exist fails its messages, but says nothing about
// the producer: however long it lasts, the producer is not replaced.
func TestKafkaNoReplacementForUnknownTopic(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	if c.AutoCreatesTopics(t) {
		t.Skip("the cluster creates topics on first use")
	}
	topic := c.Topic(t, 1)
	obs := &replacedCounter{}
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) {
		cfg.Observer = obs
		cfg.StallTimeout = time.Millisecond
		cfg.Producers = 1
	})
	for range 5 {
		_, err := k.Publish(testCtx(t), publishertest.Messages(topic+"-missing", "m", 1))
		require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition)
	}
	require.Zero(t, k.Replacements(), "replaced for %v", obs.get())
	n, err := k.Publish(testCtx(t), publishertest.Messages(topic, "ok", 1))
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// closedAddr is a local address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nothing listens there now
	return addr
}

// A probe of brokers that are not there fails within its context, names
// each broker, and logs nothing; a wrapped publisher that cannot probe
// fails its probe.
func TestProbeSinkNoBroker(t *testing.T) {
	t.Parallel()
	addr := closedAddr(t)
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{addr, addr}, Configure: fastConfig})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(testCtx(t), time.Second)
	defer cancel()
	err = k.ProbeSink(ctx)
	require.Error(t, err)
	require.Contains(t, err.Error(), addr)

	done, cancelDone := context.WithCancel(testCtx(t))
	cancelDone()
	require.ErrorIs(t, k.ProbeSink(done), context.Canceled)

	fn := publisher.TracingPublisher(relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) { return 0, nil }), nil)
	require.Error(t, fn.(relay.SinkProber).ProbeSink(testCtx(t)))
}

// A Kafka publisher whose brokers are not there fails to start with the
// cause once, not once per producer.
func TestKafkaStartNoBrokerSaysItOnce(t *testing.T) {
	t.Parallel()
	addr := closedAddr(t)
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{addr}, Producers: 4, Configure: fastConfig})
	require.NoError(t, err)
	err = k.Start(testCtx(t))
	require.Error(t, err)
	require.Equal(t, 1, strings.Count(err.Error(), "start Kafka producer"), err.Error())
	require.ErrorIs(t, err, sarama.ErrOutOfBrokers)
}

// BenchmarkProbeSink is the cost of one probe (a new connection to the
// first broker, its ApiVersions round trips, and the close) beside the
// cost of publishing one message, in the same run. Against a real
// cluster: KAFKA_BROKERS=host:port go test -run '^$' -bench ProbeSink
// -count 3 (the two alternate).
func BenchmarkProbeSink(b *testing.B) {
	c := kafkatest.Start(b)
	topic := c.Topic(b, 1)
	k := newKafka(b, c)
	ctx := testCtx(b)
	b.Run("probe", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := k.ProbeSink(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
	msgs := publishertest.Messages(topic, "bench", 1)
	b.Run("publish1", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := k.Publish(ctx, msgs); err != nil {
				b.Fatal(err)
			}
		}
	})
}
