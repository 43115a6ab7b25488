package inbox

import (
	"time"

	"github.com/IBM/sarama"
)

// Header is one record header.
type Header struct {
	Key, Value []byte
}

// Record is a consumed record, from any Kafka client: what the inbox
// needs to record it (topic, partition, offset, headers) and what the
// handler reads.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []Header
	Timestamp time.Time
}

// Header returns the value of the last header named name, and whether
// there is one.
func (r Record) Header(name string) ([]byte, bool) {
	for i := len(r.Headers) - 1; i >= 0; i-- {
		if string(r.Headers[i].Key) == name {
			return r.Headers[i].Value, true
		}
	}
	return nil, false
}

// FromSarama converts a record sarama consumed. The byte slices are
// shared, not copied.
func FromSarama(m *sarama.ConsumerMessage) Record {
	r := Record{
		Topic:     m.Topic,
		Partition: m.Partition,
		Offset:    m.Offset,
		Key:       m.Key,
		Value:     m.Value,
		Timestamp: m.Timestamp,
	}
	if len(m.Headers) > 0 {
		r.Headers = make([]Header, 0, len(m.Headers))
		for _, h := range m.Headers {
			if h != nil {
				r.Headers = append(r.Headers, Header{Key: h.Key, Value: h.Value})
			}
		}
	}
	return r
}
