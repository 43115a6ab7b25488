package publisher

import (
	"encoding/binary"

	"github.com/IBM/sarama"
)

// Murmur2 is the 32-bit murmur2 hash of the Apache Kafka Java client
// (org.apache.kafka.common.utils.Utils.murmur2), which its default
// partitioner applies to the serialized record key.
func Murmur2(data []byte) int32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	h := seed ^ uint32(len(data))
	for len(data) >= 4 {
		k := binary.LittleEndian.Uint32(data)
		data = data[4:]
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	switch len(data) {
	case 3:
		h ^= uint32(data[2]) << 16
		fallthrough
	case 2:
		h ^= uint32(data[1]) << 8
		fallthrough
	case 1:
		h ^= uint32(data[0])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h)
}

// KeyPartition returns the partition the Java client's default partitioner
// assigns a non-nil key among numPartitions partitions:
// toPositive(murmur2(key)) % numPartitions, where toPositive clears the sign
// bit. An empty key is hashed like any other key. numPartitions must be
// positive.
func KeyPartition(key []byte, numPartitions int32) int32 {
	return (Murmur2(key) & 0x7fffffff) % numPartitions
}

// partitioner is the sarama.Partitioner the Kafka publisher enforces:
//   - a message whose relay.Message.Partition was set goes to that partition;
//   - a keyed message (an empty key counts) goes to KeyPartition(key);
//   - a keyless message goes to a random partition among those with a leader.
type partitioner struct {
	random sarama.Partitioner
}

var _ sarama.DynamicConsistencyPartitioner = (*partitioner)(nil)

// newPartitioner is a sarama.PartitionerConstructor. sarama builds one
// partitioner per topic and calls it from one goroutine only.
func newPartitioner(topic string) sarama.Partitioner {
	return &partitioner{random: sarama.NewRandomPartitioner(topic)}
}

func (p *partitioner) Partition(msg *sarama.ProducerMessage, numPartitions int32) (int32, error) {
	if env, ok := msg.Metadata.(*envelope); ok && env.pinned {
		// sarama fails the message with ErrInvalidPartition when this is
		// out of range.
		return env.partition, nil
	}
	if msg.Key == nil {
		return p.random.Partition(msg, numPartitions)
	}
	// The publisher's own keys are read directly: encoding one runs the
	// order gate, which belongs to the moment sarama adds the record to a
	// produce request, not to partitioning.
	if g, ok := msg.Key.(*gatedEncoder); ok {
		return KeyPartition(g.b, numPartitions), nil
	}
	key, err := msg.Key.Encode()
	if err != nil {
		return -1, err
	}
	return KeyPartition(key, numPartitions), nil
}

// RequiresConsistency reports true: keyed and pinned messages must be placed
// among all partitions, even those without a leader right now.
func (p *partitioner) RequiresConsistency() bool { return true }

// MessageRequiresConsistency lets keyless messages avoid partitions that have
// no leader.
func (p *partitioner) MessageRequiresConsistency(msg *sarama.ProducerMessage) bool {
	if env, ok := msg.Metadata.(*envelope); ok && env.pinned {
		return true
	}
	return msg.Key != nil
}
