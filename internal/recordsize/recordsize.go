// Package recordsize holds the one definition, shared by the write side
// and the Kafka publisher, of how large a message may be and how its size
// is counted. It imports nothing, so the write side can use it without
// pulling in a Kafka client.
package recordsize

// Defaults the write side and the Kafka publisher share.
const (
	// MaxMessageBytesDefault is the largest record the Kafka publisher
	// accepts by default, and so the largest message the write side
	// accepts by default: just under the broker's default
	// message.max.bytes (1048588), so that the producer refuses an
	// oversized record on its own before the broker would fail the whole
	// batch it travels in. Sizes are counted by Record.
	MaxMessageBytesDefault = 1_000_000

	// MessageIDHeaderDefault is the record header the Kafka publisher
	// stamps with the message id unless told otherwise.
	MessageIDHeaderDefault = "x-outbox-message-id"

	// recordOverhead is the largest framing of one record in the v2
	// record format (Kafka 0.11 and later): length, attributes, timestamp
	// and offset deltas, key and value lengths, header count.
	recordOverhead = 5*maxVarintLen32 + maxVarintLen64 + 1
	// headerOverhead is the largest framing of one header: the lengths of
	// its name and value.
	headerOverhead = 2 * maxVarintLen32

	maxVarintLen32 = 5
	maxVarintLen64 = 10
)

// Record returns the size of a record as the Kafka producer (IBM/sarama's
// ProducerMessage.ByteSize for the v2 record format) counts it against its
// MaxMessageBytes: the key and value lengths, the record's framing, the
// headers (headerBytes is the sum of their names' and values' lengths,
// headerCount their number) each with its framing, and the message-id
// header, named MessageIDHeaderDefault and carrying an id of idLen bytes,
// that the publisher adds.
func Record(keyLen, valueLen, headerBytes, headerCount, idLen int) int {
	n := recordOverhead + keyLen + valueLen + headerBytes + headerCount*headerOverhead
	return n + len(MessageIDHeaderDefault) + idLen + headerOverhead
}
