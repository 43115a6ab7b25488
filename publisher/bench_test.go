package publisher_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// BenchmarkKafkaPublish publishes batches of 500 messages over 8 keys to a
// 4-partition topic on an in-process kfake broker that acknowledges without
// storing (so a long run measures the publisher, not the fake broker's
// memory; it still checks idempotent sequences). One op is one batch; msg/s
// is messages acknowledged per second. Client and broker share the CPUs.
func BenchmarkKafkaPublish(b *testing.B) {
	const batch = 500
	for _, size := range []int{200, 1024} {
		b.Run(fmt.Sprintf("value=%dB/batch=%d", size, batch), func(b *testing.B) {
			c := kafkatest.Start(b, kafkatest.BlackholeProduce())
			topic := c.Topic(b, 4)
			k := newKafka(b, c)

			msgs := publishertest.Messages(topic, "bench", batch)
			value := make([]byte, size)
			for i := range msgs {
				msgs[i].Key = fmt.Appendf(nil, "key-%d", i%8)
				msgs[i].Value = value
			}
			ctx := context.Background()
			publish := func(msgs []relay.Message) {
				acked, err := k.Publish(ctx, msgs)
				if err != nil || acked != len(msgs) {
					require.NoError(b, err)
					require.Equal(b, len(msgs), acked)
				}
			}
			publish(msgs) // connect and fetch metadata outside the timing

			b.ReportAllocs()
			b.SetBytes(int64(batch * size))
			b.ResetTimer()
			for b.Loop() {
				publish(msgs)
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "msg/s")
		})
	}
}
