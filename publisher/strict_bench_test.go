package publisher_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// BenchmarkStrictVsDefault publishes the same batches with the default
// Kafka publisher and with the transactional one (strict mode), in one run,
// so that their msg/s can be compared: 200-byte values over 8 keys of one
// bucket to a 4-partition topic on an in-process kfake broker that
// acknowledges without storing (it still validates idempotent and
// transactional sequences). One op is one batch; in strict mode one batch
// is one transaction (AddPartitionsToTxn, produce, EndTxn). Client and
// broker share the CPUs, so the ratio, not the absolute rate, is the
// result. rtt=1ms delays every request at the broker by a millisecond, a
// stand-in for a network round trip: there the two coordinator round trips
// a transaction adds to each batch show.
//
//	go test -run '^$' -bench StrictVsDefault -benchtime 2s ./publisher
func BenchmarkStrictVsDefault(b *testing.B) {
	const size = 200
	for _, rtt := range []time.Duration{0, time.Millisecond} {
		for _, batch := range []int{500, 50} {
			for _, mode := range []string{"default", "strict"} {
				b.Run(fmt.Sprintf("rtt=%s/batch=%d/mode=%s", rtt, batch, mode), func(b *testing.B) {
					benchStrictVsDefault(b, rtt, batch, size, mode)
				})
			}
		}
	}
}

func benchStrictVsDefault(b *testing.B, rtt time.Duration, batch, size int, mode string) {
	c := kafkatest.Start(b, kafkatest.BlackholeProduce())
	if rtt > 0 {
		fake := c.RequireFake(b)
		fake.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
			// Not handled: the control stays and the request is
			// then handled as usual. The sleep is the simulated
			// latency, not synchronization.
			fake.SleepControl(func() { time.Sleep(rtt) })
			return nil, nil, false
		})
	}
	topic := c.Topic(b, 4)
	var p relay.Publisher
	if mode == "strict" {
		p = newTransactional(b, c)
	} else {
		p = newKafka(b, c)
	}

	msgs := publishertest.Messages(topic, "bench", batch)
	value := make([]byte, size)
	for i := range msgs {
		msgs[i].Bucket = 1
		msgs[i].Key = fmt.Appendf(nil, "key-%d", i%8)
		msgs[i].Value = value
	}
	ctx := context.Background()
	publish := func() {
		acked, err := p.Publish(ctx, msgs)
		if err != nil || acked != len(msgs) {
			require.NoError(b, err)
			require.Equal(b, len(msgs), acked)
		}
	}
	publish() // connect, fetch metadata, start the producer outside the timing

	b.ReportAllocs()
	b.SetBytes(int64(batch * size))
	b.ResetTimer()
	for b.Loop() {
		publish()
	}
	b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "msg/s")
}
