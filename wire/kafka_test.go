package wire_test

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/wire"
)

// KafkaRecordSize counts exactly what the producer counts, so a message the write
// side accepts is one the default publisher accepts.
func TestKafkaRecordSizeMatchesTheProducer(t *testing.T) {
	t.Parallel()
	id := "0190b2a4-7c1e-7d2f-9a3b-4c5d6e7f8091"
	for _, c := range []struct {
		key, value []byte
		headers    []sarama.RecordHeader
	}{
		{nil, nil, nil},
		{[]byte{}, []byte("v"), nil},
		{[]byte("key"), make([]byte, 1000), []sarama.RecordHeader{{Key: []byte("a"), Value: []byte("1")}, {Key: []byte("traceparent"), Value: make([]byte, 55)}}},
		{make([]byte, 300), nil, []sarama.RecordHeader{{Key: []byte("h"), Value: nil}}},
	} {
		pm := &sarama.ProducerMessage{Topic: "t"}
		if c.key != nil {
			pm.Key = sarama.ByteEncoder(c.key)
		}
		if c.value != nil {
			pm.Value = sarama.ByteEncoder(c.value)
		}
		headerBytes := 0
		for _, h := range c.headers {
			headerBytes += len(h.Key) + len(h.Value)
		}
		pm.Headers = append(append([]sarama.RecordHeader{}, c.headers...),
			sarama.RecordHeader{Key: []byte(wire.KafkaMessageIDHeaderDefault), Value: []byte(id)})
		require.Equal(t, pm.ByteSize(2), wire.KafkaRecordSize(len(c.key), len(c.value), headerBytes, len(c.headers), len(id)))
	}
}
