// Package walenv is the envelope format of WAL mode: the bytes a writer
// passes to pg_logical_emit_message for one outbox message and the WAL
// reader decodes. The format is part of the storage format: every writer
// and reader sharing a slot must agree on it, so a version byte leads it
// and a version, once released, never changes.
//
// Version 1, in order:
//
//	byte     version (1)
//	uvarint  length of the message id, then the id
//	uvarint  bucket
//	uvarint  length of the topic, then the topic
//	uvarint  0 for a nil key, else length+1, then the key
//	uvarint  0 for a nil value, else length+1, then the value
//	uvarint  0 for no pinned partition, else partition+1
//	varint   creation time, Unix milliseconds
//	rest     the headers in outbox.EncodeHeaders form (trace context
//	         included), empty for none
package walenv

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// Version1 is the only version written.
const Version1 = 1

// Envelope is one message as carried in the WAL. Headers are in their
// stored form (outbox.EncodeHeaders), decoded by the reader.
type Envelope struct {
	ID          string
	Bucket      int
	Topic       string
	Key         []byte
	Value       []byte
	Partition   *int32
	CreatedAtMs int64
	Headers     []byte
}

// ErrCorrupt is returned by Decode for bytes Encode did not produce.
var ErrCorrupt = errors.New("outbox: corrupt WAL message envelope")

// Encode appends the version 1 form of e to dst.
func Encode(dst []byte, e *Envelope) []byte {
	dst = append(dst, Version1)
	dst = binary.AppendUvarint(dst, uint64(len(e.ID)))
	dst = append(dst, e.ID...)
	dst = binary.AppendUvarint(dst, uint64(e.Bucket))
	dst = binary.AppendUvarint(dst, uint64(len(e.Topic)))
	dst = append(dst, e.Topic...)
	dst = appendOptBytes(dst, e.Key)
	dst = appendOptBytes(dst, e.Value)
	if e.Partition == nil {
		dst = binary.AppendUvarint(dst, 0)
	} else {
		dst = binary.AppendUvarint(dst, uint64(uint32(*e.Partition))+1)
	}
	dst = binary.AppendVarint(dst, e.CreatedAtMs)
	return append(dst, e.Headers...)
}

// Size returns an upper bound of len(Encode(nil, e)).
func Size(e *Envelope) int {
	return 1 + 7*binary.MaxVarintLen64 + len(e.ID) + len(e.Topic) + len(e.Key) + len(e.Value) + len(e.Headers)
}

func appendOptBytes(dst, b []byte) []byte {
	if b == nil {
		return binary.AppendUvarint(dst, 0)
	}
	dst = binary.AppendUvarint(dst, uint64(len(b))+1)
	return append(dst, b...)
}

// Decode is the inverse of Encode. The returned envelope does not share
// memory with b.
func Decode(b []byte) (*Envelope, error) {
	if len(b) == 0 {
		return nil, fmt.Errorf("%w: empty", ErrCorrupt)
	}
	if b[0] != Version1 {
		return nil, fmt.Errorf("%w: unknown version %d", ErrCorrupt, b[0])
	}
	d := decoder{b: b[1:]}
	e := &Envelope{}
	e.ID = string(d.bytes(false))
	bucket := d.uvarint()
	if bucket > math.MaxInt32 {
		d.err = fmt.Errorf("%w: bucket %d", ErrCorrupt, bucket)
	}
	e.Bucket = int(bucket)
	e.Topic = string(d.bytes(false))
	e.Key = d.bytes(true)
	e.Value = d.bytes(true)
	if p := d.uvarint(); p > 0 {
		if p-1 > math.MaxUint32 {
			d.err = fmt.Errorf("%w: partition %d", ErrCorrupt, p-1)
		}
		v := int32(uint32(p - 1))
		e.Partition = &v
	}
	e.CreatedAtMs = d.varint()
	if d.err != nil {
		return nil, d.err
	}
	if len(d.b) > 0 {
		e.Headers = append([]byte(nil), d.b...)
	}
	return e, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("%w: truncated", ErrCorrupt)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("%w: truncated", ErrCorrupt)
		return 0
	}
	d.b = d.b[n:]
	return v
}

// bytes reads a length-prefixed byte string; optional strings encode nil
// as 0 and a length n as n+1.
func (d *decoder) bytes(optional bool) []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if optional {
		if n == 0 {
			return nil
		}
		n--
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w: length %d beyond the %d bytes left", ErrCorrupt, n, len(d.b))
		return nil
	}
	out := make([]byte, n)
	copy(out, d.b[:n])
	d.b = d.b[n:]
	return out
}
