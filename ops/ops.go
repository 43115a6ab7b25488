// Package ops is the operator API of an outbox: what its front ends (the
// JSON handler in opshttp, the web UI in opsui, outboxctl and health
// checks) read and repair, as an interface with typed results and typed
// errors. It imports no database driver and no ORM: a store of any kind
// offers its front ends by implementing Operator.
//
// gormrelay.Admin implements Operator over the GORM store's tables;
// ops/opsmem is an in-memory implementation. The conformance suite in
// relay/storetest (RunOperator) states the behaviour every implementation
// keeps, and runs against both.
package ops

import (
	"context"
	"errors"
	"time"
)

// Operator reads and repairs one outbox. Reads never lock or change
// anything; repairs move dead letters back to the backlog (keeping each
// key's order), delete dead letters, or stop and restart buckets. Only
// dead letters are ever deleted; pending messages are moved, never
// deleted. Every method is safe for concurrent use.
//
// Errors wrap ErrInvalidRequest for a request that cannot be carried out
// as asked and ErrNotFound for a named dead letter that does not exist;
// anything else is a failure of the store.
type Operator interface {
	// BucketCount is the outbox's number of buckets.
	BucketCount() int
	// Status reads the whole operational state: backlog, dead letters,
	// leases and relays, per bucket and in total.
	Status(ctx context.Context) (Status, error)
	// OldestPending returns the age of the oldest pending message at the
	// head of a bucket, and that bucket; ok is false when nothing is
	// pending. It is cheap enough for a health probe.
	OldestPending(ctx context.Context) (age time.Duration, bucket int, ok bool, err error)

	// DeadLetters lists dead letters matching q, newest first (by the time
	// they died, then by id), one page at a time, without values and
	// headers.
	DeadLetters(ctx context.Context, q DeadLetterQuery) (DeadLetterPage, error)
	// DeadLetter reads one dead letter in full, or fails with ErrNotFound.
	DeadLetter(ctx context.Context, id int64) (DeadLetter, error)
	// CountDeadLetters counts the dead letters by state.
	CountDeadLetters(ctx context.Context) (DeadLetterCounts, error)

	// RequeueIDs puts the named dead letters back into the backlog. A
	// keyed dead letter never comes back alone: every dead letter of its
	// key in its bucket comes back with it, in order, followed by the
	// key's pending messages. Ids that are not dead letters are reported
	// in RequeueResult.NotFound.
	RequeueIDs(ctx context.Context, ids ...int64) (RequeueResult, error)
	// RequeueKey requeues every dead letter of key (non-nil), in every
	// bucket it has dead letters in.
	RequeueKey(ctx context.Context, key []byte) (RequeueResult, error)
	// RequeueAll requeues every dead letter, or with a topic those of that
	// topic (keys move as a whole).
	RequeueAll(ctx context.Context, topic string) (RequeueResult, error)
	// DiscardDeadLetters deletes the named dead letters and returns how
	// many existed.
	DiscardDeadLetters(ctx context.Context, ids ...int64) (int64, error)
	// PurgeDeadLetters deletes the dead letters that died before olderThan
	// (non-zero) and returns how many.
	PurgeDeadLetters(ctx context.Context, olderThan time.Time) (int64, error)
	// PauseBucket stops publishing of a bucket: no relay claims it until
	// ResumeBucket. Its messages stay pending, in order.
	PauseBucket(ctx context.Context, bucket int) error
	// ResumeBucket lets relays claim the bucket again.
	ResumeBucket(ctx context.Context, bucket int) error
}

// Operator errors. Each is returned wrapped; test with errors.Is.
var (
	// ErrNotFound is returned when a named dead letter does not exist.
	ErrNotFound = errors.New("outbox: not found")
	// ErrInvalidRequest is returned for a request that cannot be carried
	// out as asked: a bucket outside 0..BucketCount-1, a malformed cursor
	// or parameter, a missing key.
	ErrInvalidRequest = errors.New("outbox: invalid admin request")
)
