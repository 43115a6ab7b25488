package outboxtest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// ReadTimeout bounds how long Broker.Read waits for records.
const ReadTimeout = 10 * time.Second

// Broker is an in-process Kafka-protocol broker (franz-go's kfake) on a
// loopback port, for end-to-end tests through the Kafka publisher without
// a Kafka installation. It speaks the protocol the publisher uses
// (produce with acks=all and idempotence, metadata), but it is a test
// double: no replication, no persistence, no configuration fidelity.
type Broker struct {
	cluster *kfake.Cluster
	close   sync.Once
}

// StartBroker starts a broker with the given topics, one partition each,
// and stops it when the test ends (or at Close). Topics are not created
// on first use: create others with CreateTopic.
func StartBroker(tb testing.TB, topics ...string) *Broker {
	tb.Helper()
	b, err := NewBroker(topics...)
	if err != nil {
		failure(tb, "%v", err)
		return nil
	}
	tb.Cleanup(b.Close)
	return b
}

// NewBroker starts a broker with the given topics, one partition each,
// outside a test: for a development service or a demo that needs a
// Kafka-protocol endpoint without a Kafka installation. It keeps everything
// in memory; Close stops it. `go run ./cmd/kfake-broker` runs the same
// broker as a process of its own.
func NewBroker(topics ...string) (*Broker, error) {
	opts := []kfake.Opt{kfake.NumBrokers(1)}
	if len(topics) > 0 {
		opts = append(opts, kfake.SeedTopics(1, topics...))
	}
	cluster, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("outboxtest: start the Kafka-protocol broker: %w", err)
	}
	return &Broker{cluster: cluster}, nil
}

// Brokers returns the bootstrap addresses, for publisher.KafkaConfig.Brokers.
func (b *Broker) Brokers() []string { return b.cluster.ListenAddrs() }

// Close stops the broker. It is safe to call more than once; StartBroker
// also registers it as a test cleanup.
func (b *Broker) Close() { b.close.Do(b.cluster.Close) }

// CreateTopic creates a topic with the given number of partitions.
func (b *Broker) CreateTopic(tb testing.TB, topic string, partitions int32) {
	tb.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Brokers()...))
	if err != nil {
		failure(tb, "create topic %s: %v", topic, err)
		return
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), ReadTimeout)
	defer cancel()
	req := kmsg.NewPtrCreateTopicsRequest()
	rt := kmsg.NewCreateTopicsRequestTopic()
	rt.Topic = topic
	rt.NumPartitions = partitions
	rt.ReplicationFactor = 1
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err == nil && len(resp.Topics) == 1 {
		err = kerr.ErrorForCode(resp.Topics[0].ErrorCode)
	}
	if err != nil {
		failure(tb, "create topic %s: %v", topic, err)
	}
}

// Record is a record read back from the broker. Key and Value are nil for
// a null key or value.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []outbox.Header
}

// Header returns the value of the first header named name, and whether
// there is one. The Kafka publisher adds "x-outbox-message-id".
func (r Record) Header(name string) (string, bool) { return header(r.Headers, name) }

// Read consumes topic from its beginning until at least n records
// arrived, and returns every record received, ordered by partition, then
// offset. It fails the test if fewer than n arrive within ReadTimeout.
func (b *Broker) Read(tb testing.TB, topic string, n int) []Record {
	tb.Helper()
	ctx, cancel := context.WithTimeoutCause(context.Background(), ReadTimeout, fmt.Errorf("the read timeout of %v", ReadTimeout))
	defer cancel()
	out, err := b.ReadContext(ctx, topic, n)
	if err != nil {
		failure(tb, "%v", err)
		return nil
	}
	return out
}

// ReadContext is Read outside a test: it returns an error when fewer than
// n records arrived before ctx ended.
func (b *Broker) ReadContext(ctx context.Context, topic string, n int) ([]Record, error) {
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(b.Brokers()...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100*time.Millisecond),
	)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", topic, err)
	}
	defer cl.Close()
	out, lastErr := kafkatest.Poll(ctx, cl, n, func(r *kgo.Record) Record {
		rec := Record{Topic: r.Topic, Partition: r.Partition, Offset: r.Offset, Key: r.Key, Value: r.Value}
		for _, h := range r.Headers {
			rec.Headers = append(rec.Headers, outbox.Header{Key: h.Key, Value: h.Value})
		}
		return rec
	})
	if len(out) < n {
		msg := fmt.Sprintf("read %d of %d records from topic %s before %v", len(out), n, topic, context.Cause(ctx))
		if lastErr != nil {
			msg += fmt.Sprintf(" (last error: %v)", lastErr)
		}
		return out, errors.New(msg)
	}
	slices.SortStableFunc(out, func(a, b Record) int {
		if c := cmp.Compare(a.Partition, b.Partition); c != 0 {
			return c
		}
		return cmp.Compare(a.Offset, b.Offset)
	})
	return out, nil
}
