package wire

import (
	"errors"
	"fmt"
)

// The Kafka sink's defaults, shared by the write side (outbox.KafkaLimits)
// and the Kafka publisher.
const (
	// KafkaMaxMessageBytesDefault is the largest record the Kafka
	// publisher accepts by default, and so the largest message the write
	// side accepts by default: just under the broker's default
	// message.max.bytes (1048588), so that the producer refuses an
	// oversized record on its own before the broker would fail the whole
	// batch it travels in. Sizes are counted by KafkaRecordSize.
	KafkaMaxMessageBytesDefault = 1_000_000

	// KafkaMessageIDHeaderDefault is the record header the Kafka
	// publisher stamps with the message id unless told otherwise.
	KafkaMessageIDHeaderDefault = "x-outbox-message-id"

	// KafkaMaxTopicLength is the longest topic name Kafka accepts.
	KafkaMaxTopicLength = 249

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

// KafkaRecordSize returns the size of a record as the Kafka producer
// (IBM/sarama's ProducerMessage.ByteSize for the v2 record format) counts
// it against its MaxMessageBytes: the key and value lengths, the record's
// framing, the headers (headerBytes is the sum of their names' and
// values' lengths, headerCount their number) each with its framing, and
// the message-id header, named KafkaMessageIDHeaderDefault and carrying
// an id of idLen bytes, that the publisher adds.
func KafkaRecordSize(keyLen, valueLen, headerBytes, headerCount, idLen int) int {
	n := recordOverhead + keyLen + valueLen + headerBytes + headerCount*headerOverhead
	return n + len(KafkaMessageIDHeaderDefault) + idLen + headerOverhead
}

// CheckKafkaTopic returns nil if Kafka accepts name as a topic name (1 to
// 249 characters of a-z, A-Z, 0-9, '.', '_' and '-', neither "." nor
// ".."), else an error saying why not. A broker answers any other name
// with INVALID_TOPIC_EXCEPTION, or, for a producer looking up its
// metadata, as if the topic did not exist.
func CheckKafkaTopic(name string) error {
	switch {
	case name == "":
		return errors.New("empty topic name")
	case len(name) > KafkaMaxTopicLength:
		return fmt.Errorf("%d characters, the limit is %d", len(name), KafkaMaxTopicLength)
	case name == "." || name == "..":
		return errors.New(`"." and ".." are not allowed`)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("character %q at %d: only [a-zA-Z0-9._-] are allowed", c, i)
		}
	}
	return nil
}
