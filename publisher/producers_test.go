package publisher_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// publishConcurrently publishes batches batches(w, 0..n-1) from each of
// workers goroutines, each worker's one after another, and requires every
// one acknowledged in full.
func publishConcurrently(t *testing.T, k *publisher.Kafka, workers, n int, batch func(w, b int) []relay.Message) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for b := range n {
				msgs := batch(w, b)
				acked, err := k.Publish(context.Background(), msgs)
				if err == nil && acked != len(msgs) {
					err = fmt.Errorf("worker %d batch %d: acked %d of %d", w, b, acked, len(msgs))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// bucketBatch is batch b of bucket: size messages over keys keys of the
// bucket, with increasing values per key across the bucket's batches.
func bucketBatch(topic string, bucket, b, size, keys int) []relay.Message {
	return keyedBatch(topic, bucket, b*size, size, keys)
}

// TestKafkaProducersPinBuckets publishes the batches of several buckets at
// once through a publisher with several producers, each bucket's batches
// one after another as the relay does: every bucket is written by one
// producer, bucket b by the same as bucket b+Producers, the buckets
// spread over all the producers, and every key's records are in order.
func TestKafkaProducersPinBuckets(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 4)
	const producers, buckets, batches, size, keys = 3, 6, 4, 50, 5
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.Producers = producers })

	publishConcurrently(t, k, buckets, batches, func(bucket, b int) []relay.Message {
		return bucketBatch(topic, bucket, b, size, keys)
	})

	const total = buckets * batches * size
	recs := readAll(t, c, topic, total)
	require.Len(t, recs, total)
	producerOf := map[int]int64{} // bucket → producer id
	byKey := map[string][]string{}
	for _, r := range recs {
		var bucket int
		_, err := fmt.Sscanf(string(r.Key), "b%d-", &bucket)
		require.NoError(t, err)
		require.GreaterOrEqual(t, r.ProducerID, int64(0), "an idempotent producer wrote the record")
		if id, ok := producerOf[bucket]; ok {
			require.Equal(t, id, r.ProducerID, "bucket %d: written by one producer", bucket)
		}
		producerOf[bucket] = r.ProducerID
		byKey[string(r.Key)] = append(byKey[string(r.Key)], string(r.Value))
	}
	distinct := map[int64]bool{}
	for bucket := range buckets {
		distinct[producerOf[bucket]] = true
		if bucket >= producers {
			require.Equal(t, producerOf[bucket-producers], producerOf[bucket],
				"buckets %d and %d: the same producer", bucket-producers, bucket)
		}
	}
	require.Len(t, distinct, producers, "the buckets spread over every producer")
	for key, values := range byKey {
		require.Len(t, values, batches*size/keys, "key %s", key)
		require.IsIncreasing(t, values, "key %s: in order", key)
	}
}

// TestKafkaProducersPartialFailure fails one bucket's batch in the middle
// while another bucket's batch goes through another producer: the failed
// batch returns its acknowledged prefix, the other all of its messages,
// and the relay's retry of the failed tail completes its keys in order.
func TestKafkaProducersPartialFailure(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2)
	k := newKafka(t, c, func(cfg *publisher.KafkaConfig) { cfg.Producers = 2 })

	const size, keys, bad = 40, 1, 25
	failing := bucketBatch(topic, 0, 0, size, keys)
	failing[bad].Value = make([]byte, publisher.MaxMessageBytesDefault+1)
	other := bucketBatch(topic, 1, 0, size, keys)

	type outcome struct {
		acked int
		err   error
	}
	var wg sync.WaitGroup
	var got [2]outcome
	for i, msgs := range [][]relay.Message{failing, other} {
		wg.Go(func() {
			acked, err := k.Publish(context.Background(), msgs)
			got[i] = outcome{acked, err}
		})
	}
	wg.Wait()
	require.NoError(t, got[1].err)
	require.Equal(t, size, got[1].acked)
	require.Equal(t, bad, got[0].acked, "the prefix before the failed message")
	require.True(t, publisher.IsTooLarge(got[0].err))
	var perr *publisher.Error
	require.ErrorAs(t, got[0].err, &perr)
	require.Equal(t, bad, perr.Index)

	// The relay republishes the unacknowledged tail, fixed.
	failing[bad].Value = fmt.Appendf(nil, "%05d", bad)
	acked, err := k.Publish(testCtx(t), failing[bad:])
	require.NoError(t, err)
	require.Equal(t, size-bad, acked)

	recs := readAll(t, c, topic, 2*size)
	require.Len(t, recs, 2*size, "every message once")
	byKey := map[string][]string{}
	for _, r := range recs {
		byKey[string(r.Key)] = append(byKey[string(r.Key)], string(r.Value))
	}
	for _, msgs := range [][]relay.Message{failing, other} {
		var want []string
		for _, m := range msgs {
			want = append(want, string(m.Value))
		}
		require.Equal(t, want, byKey[string(msgs[0].Key)], "key %s: complete and in order", msgs[0].Key)
	}
}
