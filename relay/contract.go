package relay

import (
	"context"
	"errors"
	"time"
)

// Header is one Kafka record header. Order is kept and duplicate names are
// allowed, as in Kafka itself.
type Header struct {
	Key   string
	Value []byte
}

// Message is a pending outbox row as the relay sees it. The relay never
// interprets Value: it is passed to the Publisher byte for byte.
type Message struct {
	// ID is the store's position of the row. Within one bucket a larger ID
	// was submitted later. It is what MarkPublished deletes by.
	ID int64
	// MessageID is the stable message id (a UUID), identical on every
	// delivery attempt; publishers stamp it on the record so consumers can
	// deduplicate.
	MessageID string
	// Bucket is the ordering bucket the writer computed.
	Bucket int
	Topic  string
	// Key is nil for a keyless message. An empty, non-nil key is a real key.
	Key []byte
	// Value is nil for a tombstone.
	Value   []byte
	Headers []Header
	// Partition pins the record to one partition when non-nil.
	Partition *int32
	CreatedAt time.Time
	// Attempts counts failed publish attempts recorded for this row.
	Attempts int
}

// Publisher delivers a batch of messages to a sink.
//
// Publish returns how many leading messages of msgs the sink acknowledged
// and the first error. Only a contiguous prefix counts: if message 3 of 5
// failed, acked is at most 2 even when 4 and 5 were acknowledged, and the
// relay republishes 3, 4 and 5 later. A publisher must be safe to call from
// one goroutine at a time; the relay never calls it concurrently for the
// same bucket.
type Publisher interface {
	Publish(ctx context.Context, msgs []Message) (acked int, err error)
}

// PublisherFunc adapts a function to the Publisher interface.
type PublisherFunc func(ctx context.Context, msgs []Message) (int, error)

// Publish calls f.
func (f PublisherFunc) Publish(ctx context.Context, msgs []Message) (int, error) {
	return f(ctx, msgs)
}

// Lease is a relay's claim on one bucket. Term changes on every acquisition
// of the bucket, by any relay, so a relay that lost and regained a bucket,
// or a stale relay whose lease was taken over, can be told apart.
type Lease struct {
	Bucket int
	Term   int64
}

// PermanentError marks a publish error that retrying will not fix: the
// message is too large, the topic is invalid, the client is not authorized.
// Publishers wrap such errors with Permanent; the relay's failure policy
// uses IsPermanent to tell them from transient ones.
type PermanentError struct {
	Err error
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that IsPermanent reports true for it. It returns
// nil for a nil err.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err, or any error it wraps, is a
// *PermanentError.
func IsPermanent(err error) bool {
	var pe *PermanentError
	return errors.As(err, &pe)
}
