package outbox

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/gorm-outbox/outbox/wire"
)

// Header is one record header. Order is kept and duplicate names are
// allowed, as in Kafka. It is wire.Header, as is relay.Header.
type Header = wire.Header

// Message is what a writer hands to the outbox. It is stored as one row in
// the same transaction as the business write and published by a relay
// after that transaction committed.
type Message struct {
	// Topic is the Kafka topic: 1 to 249 characters of [a-zA-Z0-9._-],
	// neither "." nor "..".
	Topic string
	// Key decides the bucket and, in Kafka, the partition. nil means
	// keyless: no ordering promise, spread over buckets. An empty, non-nil
	// key is a real key like any other.
	Key []byte
	// Value is passed to the publisher byte for byte. nil is a tombstone.
	Value []byte
	// Headers are carried as Kafka record headers. Names must not be empty.
	Headers []Header
	// Partition pins the record to one Kafka partition when non-nil. The
	// bucket is then derived from the partition, so every message pinned to
	// one partition shares one submission order.
	Partition *int32
	// ID is the stable message id stamped on every delivery attempt so
	// consumers can deduplicate. Leave it empty to get a fresh UUID v7.
	ID string
}

// Bucket returns the ordering bucket of a message with this key and
// partition among bucketCount buckets. It is wire.Bucket: the function is
// part of the storage format, shared by every writer and relay, and never
// changes between versions.
//
//   - a pinned partition p: p mod bucketCount;
//   - a key (including the empty key): FNV-1a 32-bit of the key bytes, mod
//     bucketCount;
//   - keyless (nil key): FNV-1a 32-bit of the message id, mod bucketCount, so
//     keyless messages spread over every bucket.
func Bucket(key []byte, partition *int32, messageID string, bucketCount int) int {
	return wire.Bucket(key, partition, messageID, bucketCount)
}

// ValidateTopic reports whether name is a legal Kafka topic name, with a
// *MessageError saying why not. It is KafkaLimits.CheckTopic.
func ValidateTopic(name string) error {
	if err := wire.CheckKafkaTopic(name); err != nil {
		return &MessageError{Field: "Topic", Topic: name, Reason: err.Error()}
	}
	return nil
}

// Size is the number of bytes of the message that count against
// MaxMessageBytes, counted as the Kafka producer counts the record the
// publisher makes of it: key, value, header names and values, the framing
// of the record and of each header, and the message-id header the
// publisher adds (x-outbox-message-id with the message's id; a message
// without an ID yet counts the 36 characters of the UUID it will get).
func (m *Message) Size() int {
	hb := 0
	for _, h := range m.Headers {
		hb += len(h.Key) + len(h.Value)
	}
	idLen := len(m.ID)
	if idLen == 0 {
		idLen = uuidLen
	}
	return wire.KafkaRecordSize(len(m.Key), len(m.Value), hb, len(m.Headers), idLen)
}

// uuidLen is the length of the id newMessageID returns.
const uuidLen = 36

// validate checks the message against the rules of the sink (limits)
// and of the outbox, so a bad message fails in the writer's transaction
// and not hours later in the relay.
func (m *Message) validate(limits Limits, maxBytes int) error {
	if err := checkTopic(limits, m.Topic); err != nil {
		return err
	}
	if m.Partition != nil && *m.Partition < 0 {
		return &MessageError{Field: "Partition", Topic: m.Topic, Reason: fmt.Sprintf("negative partition %d", *m.Partition)}
	}
	for i, h := range m.Headers {
		if h.Key == "" {
			return &MessageError{Field: "Headers", Topic: m.Topic, Reason: fmt.Sprintf("header %d has an empty name", i)}
		}
	}
	if m.ID != "" && len(m.ID) > 64 {
		return &MessageError{Field: "ID", Topic: m.Topic, Reason: "message id longer than 64 characters"}
	}
	if size := limits.Size(m); maxBytes > 0 && size > maxBytes {
		return &TooLargeError{Topic: m.Topic, Size: size, Limit: maxBytes, Setting: "MaxMessageBytes"}
	}
	return nil
}

// newMessageID returns a UUID v7: time-ordered, so ids sort roughly by
// creation, and unique without coordination.
func newMessageID() (string, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return "", fmt.Errorf("outbox: generate message id: %w", err)
	}
	return id.String(), nil
}

const headersFormatV1 = 1

// EncodeHeaders returns the storage form of headers: nil for none, else a
// version byte followed by, for each header, the uvarint length of the name,
// the name, the uvarint of (value length + 1) or 0 for a nil value, and the
// value. The format keeps order, duplicates and the nil/empty distinction.
func EncodeHeaders(hs []Header) []byte {
	if len(hs) == 0 {
		return nil
	}
	n := 1 + binary.MaxVarintLen64
	for _, h := range hs {
		n += 2*binary.MaxVarintLen64 + len(h.Key) + len(h.Value)
	}
	b := make([]byte, 0, n)
	b = append(b, headersFormatV1)
	b = binary.AppendUvarint(b, uint64(len(hs)))
	for _, h := range hs {
		b = binary.AppendUvarint(b, uint64(len(h.Key)))
		b = append(b, h.Key...)
		if h.Value == nil {
			b = binary.AppendUvarint(b, 0)
		} else {
			b = binary.AppendUvarint(b, uint64(len(h.Value))+1)
			b = append(b, h.Value...)
		}
	}
	return b
}

// errBadHeaders is returned by DecodeHeaders for bytes EncodeHeaders did
// not produce.
var errBadHeaders = errors.New("outbox: corrupt stored headers")

// DecodeHeaders is the inverse of EncodeHeaders.
func DecodeHeaders(b []byte) ([]Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if b[0] != headersFormatV1 {
		return nil, fmt.Errorf("%w: unknown format %d", errBadHeaders, b[0])
	}
	b = b[1:]
	count, n := binary.Uvarint(b)
	if n <= 0 || count > uint64(len(b)) {
		return nil, errBadHeaders
	}
	b = b[n:]
	hs := make([]Header, 0, count)
	for i := uint64(0); i < count; i++ {
		kl, n := binary.Uvarint(b)
		if n <= 0 || kl > uint64(len(b)-n) {
			return nil, errBadHeaders
		}
		key := string(b[n : n+int(kl)])
		b = b[n+int(kl):]
		vl, n := binary.Uvarint(b)
		if n <= 0 || (vl > 0 && vl-1 > uint64(len(b)-n)) {
			return nil, errBadHeaders
		}
		b = b[n:]
		var val []byte
		if vl > 0 {
			val = make([]byte, vl-1)
			copy(val, b[:vl-1])
			b = b[vl-1:]
		}
		hs = append(hs, Header{Key: key, Value: val})
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%w: %d trailing bytes", errBadHeaders, len(b))
	}
	return hs, nil
}
