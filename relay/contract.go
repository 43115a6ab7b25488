package relay

import (
	"context"
	"errors"
	"hash/fnv"
	"time"

	"github.com/gorm-outbox/outbox/wire"
)

// Header is one Kafka record header. Order is kept and duplicate names are
// allowed, as in Kafka itself. It is wire.Header, as is outbox.Header.
type Header = wire.Header

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
	// Position is the store's opaque position of the message, for a store
	// whose IDs alone do not order a bucket's messages across a restart:
	// WAL mode (package pgwal) sets it to the log position of the
	// message's transaction's commit. A Reconciler records the position
	// of a batch's last message (Committed.Position). 0 means none: table
	// mode leaves it 0.
	Position uint64
}

// Publisher delivers a batch of messages to a sink.
//
// Publish returns how many leading messages of msgs the sink acknowledged
// and the first error. Only a contiguous prefix counts: if message 3 of 5
// failed, acked is at most 2 even when 4 and 5 were acknowledged, and the
// relay republishes 3, 4 and 5 later. A relay with Config.Parallelism
// above 1 (the default) calls Publish concurrently for different buckets,
// never concurrently for the same bucket; a publisher that is not safe
// for concurrent use needs Parallelism 1. An error that is a
// *MisconfigurationError (the publisher cannot work as configured, for
// example it was never started) stops the relay once the acknowledged
// prefix is deleted; it is not counted against the message.
type Publisher interface {
	Publish(ctx context.Context, msgs []Message) (acked int, err error)
}

// Pipeliner is an optional Publisher capability: taking a bucket's next
// batch while earlier batches of the bucket are unacknowledged. The relay
// discovers it by type assertion on the Publisher given to New and uses it
// when Config.PipelineDepth is above 1, the store skips rows
// (BatchSkipper), and the publisher is neither a Reconciler nor
// LeaseAware (the strict mode keeps one batch of a bucket in flight: its
// progress marker names only the last batch it committed). A wrapper
// around a publisher should forward it.
type Pipeliner interface {
	Publisher
	// Send hands msgs (one bucket's batch, as Publish takes it) to the
	// sink behind every batch sent before it, and returns without waiting
	// for acknowledgements. wait, called exactly once, blocks until each
	// message is acknowledged or failed and returns what Publish would
	// have returned for msgs: the acknowledged prefix and, when shorter
	// than msgs, the error. ctx bounds the send as it bounds Publish, until
	// wait returns.
	//
	// Order per key holds across sends: a message is written only after
	// every message with the same key handed to an earlier Send is
	// acknowledged; if one of those failed, the message fails too,
	// unwritten. The relay calls Send for a bucket only from the drainer
	// holding it, so the sends of one bucket never race each other, and
	// it sends a message only once the wait of every earlier message of
	// its key returned it acknowledged: so a sink that, when a message
	// fails, fails only the messages queued behind it still keeps order
	// per key.
	Send(ctx context.Context, msgs []Message) (wait func() (int, error))
}

// ReadyChecker is an optional Publisher capability: telling, before the
// relay starts, whether the publisher can publish at all. Relay.Start (and
// Run and DrainOnce) calls CheckReady synchronously and fails with its
// error when it is a *MisconfigurationError (for example a publisher that
// was never started: publisher.Kafka and publisher.Transactional return
// one wrapping publisher.ErrNotStarted); any other error is logged and the
// relay starts anyway, as a failed publish would only be retried.
// CheckReady must be cheap (no network round trip is required) and bounded
// by ctx.
type ReadyChecker interface {
	CheckReady(ctx context.Context) error
}

// PublisherService is the lifecycle of a publisher that a relay owns
// (Config.OwnPublisher): Start connects it, bounded by ctx, and ties it to
// ctx; Stop flushes and closes it, bounded by ctx, and tolerates a Stop
// before Start. publisher.Kafka and publisher.Transactional implement it.
type PublisherService interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context) error
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

// FencedError marks a publish error that says the sink refused the relay's
// writes for the bucket because another producer took the bucket's
// identity over (Kafka: PRODUCER_FENCED for the bucket's transactional id).
// It is the sink's view of a lost lease: errors.Is(err, ErrLeaseLost)
// reports true for it. The relay treats it as "lease lost for this bucket":
// it deletes nothing of the batch, forgets the lease locally, tells a
// LeaseAware publisher that the bucket was released, and acquires again;
// the failure policy is not run. Publishers wrap such errors with Fenced.
type FencedError struct {
	Err error
}

func (e *FencedError) Error() string { return "fenced: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *FencedError) Unwrap() error { return e.Err }

// Is lets errors.Is(err, ErrLeaseLost) match.
func (e *FencedError) Is(target error) bool { return target == ErrLeaseLost }

// Fenced wraps err so that IsFenced reports true for it. It returns nil for
// a nil err.
func Fenced(err error) error {
	if err == nil {
		return nil
	}
	return &FencedError{Err: err}
}

// IsFenced reports whether err, or any error it wraps, is a *FencedError.
func IsFenced(err error) bool {
	var fe *FencedError
	return errors.As(err, &fe)
}

// FailedIndex returns the position in the batch of the message that a
// publish error names as the cause of the failure: the first error in
// err's chain with a method FailedIndex() int (publisher.Error has one).
// It is usually the acknowledged count, but a publisher that acknowledges
// nothing of a failed batch (a transactional one) names the message that
// failed, possibly a later one. The relay then publishes the messages
// before that one on their own, at once, so that the FailureHandler meets
// the culprit at the head of the bucket with every earlier message
// delivered.
func FailedIndex(err error) (int, bool) {
	var fi interface{ FailedIndex() int }
	if errors.As(err, &fi) {
		return fi.FailedIndex(), true
	}
	return 0, false
}

// LeaseAware is an optional Publisher capability: being told which buckets
// the relay owns, so that the publisher can hold per-bucket resources (the
// transactional publisher keeps one Kafka producer per bucket). The relay
// discovers it by type assertion on the Publisher given to New; a wrapper
// around a publisher should forward it.
//
// Both methods are called from the relay's loop goroutine, while other
// buckets' Publish calls may be in flight but never one of a bucket they
// name, and in lease order: a bucket is
// released (under its old term) before it is acquired again under a new
// one. Every bucket announced as acquired is announced as released when the
// relay gives it up, loses it, stops trusting it, or stops.
type LeaseAware interface {
	// LeasesAcquired announces leases the relay gained, before the relay
	// reads from those buckets. It may block while it prepares (the
	// strict-mode publisher fences the previous owner here), at most until
	// ctx ends, which it does when the leases can no longer be trusted. An
	// error is logged, and a *MisconfigurationError stops the relay.
	LeasesAcquired(ctx context.Context, leases []Lease) error
	// LeasesReleased announces leases the relay no longer holds. It should
	// return quickly.
	LeasesReleased(ctx context.Context, leases []Lease)
}

// UnavailableError marks a publish error that is not about the message:
// the sink could not be reached or was not ready to take writes
// (connection refused, every broker down, timeouts, a partition without a
// leader, stale metadata, a producer that had to be replaced). Retrying
// later succeeds without any change to the message, so the relay backs off
// and retries without counting the failure against the message: it calls
// neither the FailureRecorder nor the FailureHandler, and an outage of any
// length dead-letters nothing. Publishers wrap such errors with
// Unavailable; an error that is also permanent (IsPermanent) is treated as
// permanent.
type UnavailableError struct {
	Err error
}

func (e *UnavailableError) Error() string { return "sink unavailable: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *UnavailableError) Unwrap() error { return e.Err }

// Unavailable wraps err so that IsUnavailable reports true for it. It
// returns nil for a nil err.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &UnavailableError{Err: err}
}

// IsUnavailable reports whether err, or any error it wraps, is an
// *UnavailableError and err is not permanent (IsPermanent).
func IsUnavailable(err error) bool {
	var ue *UnavailableError
	return errors.As(err, &ue) && !IsPermanent(err)
}

// BatchRejectedError marks a publish error the sink raised for a group of
// messages at once, which any one of them may have caused (Kafka:
// MESSAGE_TOO_LARGE for a produce request carrying several records). The
// message the error names is then not known to be the culprit. The relay
// splits the batch, publishing its first half on its own, until the
// failing batch is a single message; only that message meets the failure
// policy. Publishers wrap such errors with BatchRejected.
type BatchRejectedError struct {
	Err error
}

func (e *BatchRejectedError) Error() string { return "batch rejected: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *BatchRejectedError) Unwrap() error { return e.Err }

// BatchRejected wraps err so that IsBatchRejected reports true for it. It
// returns nil for a nil err.
func BatchRejected(err error) error {
	if err == nil {
		return nil
	}
	return &BatchRejectedError{Err: err}
}

// IsBatchRejected reports whether err, or any error it wraps, is a
// *BatchRejectedError.
func IsBatchRejected(err error) bool {
	var be *BatchRejectedError
	return errors.As(err, &be)
}

// Reconciler is an optional Publisher capability: telling the relay which
// rows of a bucket the sink already holds although the store may still
// hold them, because a relay published them and then failed to delete
// them (it died, or lost the database, between the sink's commit and the
// delete). The strict-mode publisher implements it: every Kafka
// transaction also records, atomically, the row ids it carried, and
// Reconcile returns the ids recorded by the bucket's last committed
// transaction (publisher.Transactional.ProgressGroup). The relay discovers
// it by type assertion on the Publisher given to New; a wrapper around a
// publisher should forward it.
//
// The relay calls Reconcile for a bucket before the first batch it reads
// of it under a lease (after LeasesAcquired, for a LeaseAware publisher),
// and again before the next batch whenever a batch of the bucket ended in
// doubt: a publish that failed or was cancelled, or a delete that failed.
// It then reads the bucket's oldest rows and deletes, by MarkPublished
// under the lease, the rows of the returned ids, but only when every one
// of them is there and the digest of their MessageIDs, in the order the
// ids are given, is Committed.Digest (MessagesDigest): a record that does
// not match the store (another outbox shares the sink's identity, or row
// ids were reused after the database was recreated or restored) deletes
// nothing and is logged at Warn, so it can cause a duplicate, never a
// loss. None of the rows there is the usual case: the batch was deleted.
// A publisher must return only a batch of the bucket that the sink holds
// for good, and must, before it returns, have made sure that no earlier
// owner of the bucket can still make a batch visible (the strict-mode
// publisher fences it first).
//
// An error is logged and the bucket is retried after its backoff, without
// reading or publishing anything; a *MisconfigurationError stops the relay,
// and a fenced or lost lease drops the bucket. Reconcile is called
// concurrently for different buckets, never concurrently with a Publish of
// the same bucket.
type Reconciler interface {
	Reconcile(ctx context.Context, lease Lease) (Committed, error)
}

// Committed is a Reconciler's record of the last batch of a bucket the
// sink committed, in one of two forms, and the MessagesDigest of the
// batch's messages, in the batch's order. The zero value records
// nothing.
//
// A list names the batch's rows: IDs, in the batch's order. The relay
// deletes them if every one is among the bucket's oldest rows and they
// hold the messages of Digest.
//
// A span, when IDs is empty and Count positive, records a batch of
// Count rows in ascending id order from First to Last inclusive, for a
// sink that cannot hold the whole list (the strict-mode publisher's
// progress marker is bounded by the broker). The relay deletes the
// bucket's rows with ids from First to Last only if they are exactly
// Count rows, the first First and the last Last, holding the messages
// of Digest: a row the batch did not carry inside the span (committed
// late by a slower transaction) deletes nothing, so the batch may be
// published again, never lost. A batch whose last message has a
// Position is always a list.
//
// Position and LastDigest are recorded for a batch whose last message has
// a Position (WAL mode): that Position, and the MessagesDigest of the last
// message alone. They let a store that replays its log from a restart
// point (package pgwal) tell which replayed messages are at or before the
// batch, and that the batch is its own when the replay begins inside the
// batch. Both are 0 otherwise, and for a record written before they were
// recorded. The relay engine does not use them.
type Committed struct {
	IDs        []int64
	Digest     uint64
	Position   uint64
	LastDigest uint64

	First, Last int64
	Count       int
}

// IsZero reports whether c records nothing.
func (c Committed) IsZero() bool { return len(c.IDs) == 0 && c.Count <= 0 }

// MessagesDigest is the 64-bit FNV-1a hash of msgs' MessageIDs, in order,
// each followed by a zero byte: what a Reconciler records of a batch so
// that the relay deletes the rows it names only when they hold those
// messages.
func MessagesDigest(msgs []Message) uint64 {
	h := fnv.New64a()
	for i := range msgs {
		h.Write([]byte(msgs[i].MessageID))
		h.Write([]byte{0})
	}
	return h.Sum64()
}

// TruncatedError marks a publish that the sink took only a prefix of, on
// purpose, because the whole batch exceeded a limit of the sink (the
// strict-mode publisher records the batch's row ids in the transaction,
// and the broker bounds that record's size). Publish returns the prefix as
// acknowledged together with an error wrapped with Truncated; the relay
// deletes the prefix and publishes the rest at once, without counting a
// failure against any message. Publishers wrap such errors with Truncated.
type TruncatedError struct {
	Err error
}

func (e *TruncatedError) Error() string { return "batch truncated: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *TruncatedError) Unwrap() error { return e.Err }

// Truncated wraps err so that IsTruncated reports true for it. It returns
// nil for a nil err.
func Truncated(err error) error {
	if err == nil {
		return nil
	}
	return &TruncatedError{Err: err}
}

// IsTruncated reports whether err, or any error it wraps, is a
// *TruncatedError.
func IsTruncated(err error) bool {
	var te *TruncatedError
	return errors.As(err, &te)
}
