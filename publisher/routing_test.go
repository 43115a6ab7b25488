package publisher_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// routed is a publisher option: the routing by size at threshold n, over
// producers slots.
func routed(producers, n int) func(*publisher.KafkaConfig) {
	return func(cfg *publisher.KafkaConfig) {
		cfg.Producers = producers
		cfg.LingerBatch = n
	}
}

// keyedBatch is n messages of bucket over keys keys, numbered from seq on:
// message seq+i has key seq+i mod keys and value seq+i, so that every
// key's values increase with seq.
func keyedBatch(topic string, bucket, seq, n, keys int) []relay.Message {
	msgs := make([]relay.Message, n)
	for i := range msgs {
		s := seq + i
		msgs[i] = relay.Message{
			MessageID: fmt.Sprintf("b%d-%05d", bucket, s),
			Bucket:    bucket,
			Topic:     topic,
			Key:       fmt.Appendf(nil, "b%d-k%d", bucket, s%keys),
			Value:     fmt.Appendf(nil, "%05d", s),
		}
	}
	return msgs
}

// producerOf reads n records of topic and returns the producer ids
// that wrote each message id.
func producerOf(t *testing.T, c *kafkatest.Cluster, topic string, n int) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, r := range readAll(t, c, topic, n) {
		m := toMessages(t, []kafkatest.Record{r}, publisher.MessageIDHeaderDefault)[0]
		out[m.MessageID] = r.ProducerID
	}
	return out
}

// TestKafkaRoutesBatchesBySize: with the routing on, the batches of one
// slot below LingerBatch go through one producer (one producer id) and
// those of at least LingerBatch messages through another, the slot's
// lingering one.
func TestKafkaRoutesBatchesBySize(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2)
	const threshold = 10
	k := newKafka(t, c, routed(1, threshold))

	var small, large []relay.Message
	seq := 0
	for _, n := range []int{1, threshold, threshold - 1, 3 * threshold, 2} {
		msgs := keyedBatch(topic, 0, seq, n, 3)
		seq += n
		acked, err := k.Publish(testCtx(t), msgs)
		require.NoError(t, err)
		require.Equal(t, n, acked)
		if n >= threshold {
			large = append(large, msgs...)
		} else {
			small = append(small, msgs...)
		}
	}
	by := producerOf(t, c, topic, seq)
	require.Len(t, by, seq)
	smallID, largeID := by[small[0].MessageID], by[large[0].MessageID]
	require.NotEqual(t, smallID, largeID, "the two sizes go through two producers")
	for _, m := range small {
		require.Equal(t, smallID, by[m.MessageID], "%s: a small batch's producer", m.MessageID)
	}
	for _, m := range large {
		require.Equal(t, largeID, by[m.MessageID], "%s: a large batch's producer", m.MessageID)
	}
}

// TestKafkaRoutingOffUsesOneProducer: a negative LingerBatch turns the
// routing off: every batch of a slot goes through its one producer.
func TestKafkaRoutingOffUsesOneProducer(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	k := newKafka(t, c, routed(1, -1))
	seq := 0
	for _, n := range []int{1, 100, 2} {
		acked, err := k.Publish(testCtx(t), keyedBatch(topic, 0, seq, n, 3))
		require.NoError(t, err)
		require.Equal(t, n, acked)
		seq += n
	}
	ids := map[int64]bool{}
	for _, id := range producerOf(t, c, topic, seq) {
		ids[id] = true
	}
	require.Len(t, ids, 1)
}

// TestKafkaRoutedOrderUnderFaults publishes the batches of two buckets at
// once, each bucket's batches alternating between sizes below and above
// LingerBatch, one after another as the relay does (a batch's
// unacknowledged tail heads the bucket's next one), while the broker
// answers produce requests with errors: NOT_LEADER once, then more times
// than the producer retries (the records of the failed request fail for
// good while those behind them are sent again), then REQUEST_TIMED_OUT
// after appending. Every message is on the broker, every key's records in
// order (each record's first copy), and each bucket's
// records were written by both of its slot's producers.
func TestKafkaRoutedOrderUnderFaults(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker answers errors on demand
	topic := c.Topic(t, 2)
	const threshold, keys, perBucket = 8, 4, 400
	k := newKafka(t, c, routed(2, threshold))

	faults := []*kfake.FaultHandle{
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotLeaderForPartition, Count: 1}),
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.NotLeaderForPartition, Count: 11}),
		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.RequestTimedOut, Count: 2}),
	}
	sizes := []int{3, 20, 1, 2 * threshold, threshold - 1, threshold}

	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for bucket := range 2 {
		wg.Go(func() {
			all := keyedBatch(topic, bucket, 0, perBucket, keys)
			rest, calls := all, 0
			for i := 0; len(rest) > 0; i++ {
				calls++
				if calls > 1000 {
					errs <- fmt.Errorf("bucket %d: no end after %d calls", bucket, calls)
					return
				}
				n := min(sizes[i%len(sizes)], len(rest))
				acked, err := k.Publish(context.Background(), rest[:n])
				if err != nil && !relay.IsUnavailable(err) {
					errs <- fmt.Errorf("bucket %d: %w", bucket, err)
					return
				}
				rest = rest[acked:]
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, h := range faults {
		require.Positive(t, h.Hits(), "every fault hit")
	}

	recs := readAll(t, c, topic, 2*perBucket)
	byKey := map[string][]string{}
	producers := map[int]map[int64]bool{0: {}, 1: {}}
	for _, r := range recs {
		var bucket int
		_, err := fmt.Sscanf(string(r.Key), "b%d-", &bucket)
		require.NoError(t, err)
		producers[bucket][r.ProducerID] = true
		byKey[string(r.Key)] = append(byKey[string(r.Key)], string(r.Value))
	}
	for key, values := range byKey {
		// A publish that failed after the broker may have appended some of
		// its records is published again: a key may see a run of records
		// again, but each record's first copy comes in order.
		var first []string
		seen := map[string]bool{}
		for _, v := range values {
			if !seen[v] {
				seen[v] = true
				first = append(first, v)
			}
		}
		require.True(t, slices.IsSorted(first), "key %s: every record's first copy in order: %v", key, values)
		require.Len(t, first, perBucket/keys, "key %s: every record", key)
	}
	for bucket, ids := range producers {
		require.Len(t, ids, 2, "bucket %d: written by both producers of its slot", bucket)
	}
}

// TestKafkaRoutedStrayKeepsOrder: a large batch's publish is cancelled
// while the broker holds its produce request, so its records are still in
// the lingering producer when Publish returns. The bucket's next batch is
// small, but goes through the same producer until the cancelled batch's
// records are all reported: written after them, by the same producer, so
// every key stays in order. Routed by size alone, it would overtake them
// through the other producer.
func TestKafkaRoutedStrayKeepsOrder(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce request
	topic := c.Topic(t, 1)
	const threshold, keys = 10, 2
	k := newKafka(t, c, routed(1, threshold))
	held, release := holdProduce(fake)

	large := keyedBatch(topic, 0, 0, 3*threshold, keys)
	ctx, cancel := context.WithCancel(context.Background())
	done := publishAsync(ctx, k, large)
	<-held
	cancel()
	r := <-done
	require.ErrorIs(t, r.err, context.Canceled)

	small := keyedBatch(topic, 0, len(large), 2, keys)
	done = publishAsync(testCtx(t), k, small)
	// The small batch waits behind the held request, or (routed by size
	// alone) is written at once; either way the broker then answers.
	close(release)
	r = <-done
	require.NoError(t, r.err)
	require.Equal(t, len(small), r.acked)

	// How much of the large batch was handed over before the cancellation
	// is up to timing, but at least its first record (in the held request).
	recs := readAll(t, c, topic, 1+len(small))
	var got []string
	by := map[string]int64{}
	for _, m := range toMessages(t, recs, publisher.MessageIDHeaderDefault) {
		got = append(got, m.MessageID)
	}
	for _, r := range recs {
		by[string(r.Value)] = r.ProducerID
	}
	n := len(got) - len(small)
	require.Positive(t, n)
	require.Equal(t, append(ids(large[:n]), ids(small)...), got, "the large batch's records, then the small one's")
	require.Equal(t, by[string(large[0].Value)], by[string(small[0].Value)], "the small batch went through the producer holding the large one")

	// The small batch was written after the cancelled batch's records, so
	// they were all reported: the next small batch goes through the other
	// producer again.
	next := keyedBatch(topic, 0, len(large)+len(small), 2, keys)
	acked, err := k.Publish(testCtx(t), next)
	require.NoError(t, err)
	require.Equal(t, len(next), acked)
	recs = readAll(t, c, topic, len(got)+len(next))
	require.NotEqual(t, by[string(large[0].Value)], recs[len(recs)-1].ProducerID)
}

// holdAllProduce makes the broker hold every produce request until
// release is closed; producers reports the producer ids of the requests
// held so far.
func holdAllProduce(fake *kfake.Cluster) (producers func() map[int64]bool, release chan struct{}) {
	release = make(chan struct{})
	var (
		mu   sync.Mutex
		seen = map[int64]bool{}
	)
	fake.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		select {
		case <-release:
			return nil, nil, false
		default:
		}
		mu.Lock()
		for _, id := range producerIDs(req) {
			seen[id] = true
		}
		mu.Unlock()
		fake.SleepControl(func() { <-release })
		return nil, nil, false // not handled: the control stays, and the request is handled as usual
	})
	return func() map[int64]bool {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(seen)
	}, release
}

// TestKafkaRoutedCloseFlushesBoth: Close while both producers of a slot
// have a batch held by the broker flushes both: it returns once the broker
// answered, both Publish calls get their full answer, and every record is
// on the broker.
func TestKafkaRoutedCloseFlushesBoth(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce requests
	topic := c.Topic(t, 2)
	const threshold = 10
	k, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: c.Brokers(), Configure: fastConfig, LingerBatch: threshold})
	require.NoError(t, err)
	require.NoError(t, k.Start(t.Context()))
	held, release := holdAllProduce(fake)

	batches := [][]relay.Message{keyedBatch(topic, 0, 0, 2, 2), keyedBatch(topic, 0, 2, 5*threshold, 2)}
	var done []<-chan publishResult
	for _, msgs := range batches {
		done = append(done, publishAsync(context.Background(), k, msgs))
	}
	require.Eventually(t, func() bool { return len(held()) == 2 }, 30*time.Second, time.Millisecond,
		"both producers' requests held")

	closed := make(chan error, 1)
	go func() { closed <- k.Close() }()
	close(release)
	require.NoError(t, <-closed)
	want := 0
	for _, d := range done {
		r := <-d
		require.NoError(t, r.err)
		want += r.acked
	}
	require.Equal(t, 2+5*threshold, want)
	require.Equal(t, int64(want), c.RecordCount(t, topic))
	_, err = k.Publish(testCtx(t), batches[0])
	require.ErrorIs(t, err, publisher.ErrClosed)
}

// TestKafkaReplacesLingeringProducer: the brokers refuse the lingering
// producer's idempotence state. The publisher replaces that producer
// alone: the slot's other producer keeps its producer id, small batches
// go on through it, and large batches resume through the replacement.
func TestKafkaReplacesLingeringProducer(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t)
	topic := c.Topic(t, 1)
	const threshold = 10
	obs := &replacedCounter{}
	k := newKafka(t, c, routed(1, threshold), func(cfg *publisher.KafkaConfig) { cfg.Observer = obs })

	small1 := keyedBatch(topic, 0, 0, 2, 1)
	acked, err := k.Publish(testCtx(t), small1)
	require.NoError(t, err)
	require.Equal(t, 2, acked)

	seen := wedge(fake, kerr.OutOfOrderSequenceNumber) // the next producer id the brokers see
	_, err = k.Publish(testCtx(t), keyedBatch(topic, 0, 2, threshold, 1))
	require.ErrorIs(t, err, sarama.ErrOutOfOrderSequenceNumber)
	wedged := seen()[0]

	large := keyedBatch(topic, 0, 2, 2*threshold, 1)
	eventuallyPublishes(t, k, large)
	small2 := keyedBatch(topic, 0, 2+len(large), 2, 1)
	acked, err = k.Publish(testCtx(t), small2)
	require.NoError(t, err)
	require.Equal(t, 2, acked)

	require.Equal(t, int64(1), k.Replacements())
	require.Equal(t, []string{publisher.ReplaceProducerState}, obs.get())
	by := producerOf(t, c, topic, len(small1)+len(large)+len(small2))
	free := by[small1[0].MessageID]
	require.Equal(t, free, by[small2[0].MessageID], "the small batches' producer was not replaced")
	require.NotEqual(t, wedged, free, "the refused producer was the lingering one")
	require.NotEqual(t, wedged, by[large[0].MessageID], "large batches resumed through a new producer")
	require.NotEqual(t, free, by[large[0].MessageID])
}

// A negative Linger is a *relay.ConfigError naming it; the defaults are
// LingerBatchDefault and LingerDefault.
func TestKafkaLingerConfig(t *testing.T) {
	t.Parallel()
	_, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{"127.0.0.1:1"}, Linger: -time.Millisecond})
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "KafkaConfig.Linger", ce.Field)
	require.ErrorIs(t, err, relay.ErrInvalidConfig)
	cfg := publisher.KafkaConfig{}.WithDefaults()
	require.Equal(t, publisher.LingerBatchDefault, cfg.LingerBatch)
	require.Equal(t, publisher.LingerDefault, cfg.Linger)
}
