package ops

import (
	"context"
	"slices"
	"time"
)

// DeadLetterCounts counts dead letters by state.
type DeadLetterCounts struct {
	Failed int64 `json:"failed"`
	Parked int64 `json:"parked"`
}

// Total is Failed + Parked.
func (c DeadLetterCounts) Total() int64 { return c.Failed + c.Parked }

// Add counts n dead letters of state.
func (c *DeadLetterCounts) Add(state DeadLetterState, n int64) {
	if state == DeadLetterParked {
		c.Parked += n
	} else {
		c.Failed += n
	}
}

// LeaseInfo is one bucket's lease row.
type LeaseInfo struct {
	Bucket int `json:"bucket"`
	// Owner is the relay holding or last holding the lease; empty when
	// free.
	Owner string `json:"owner,omitempty"`
	// Term counts the lease's acquisitions (and admin repairs of the
	// bucket's dead letters, which revoke the current term).
	Term int64 `json:"term"`
	// ExpiresAt is when the lease lapses unless renewed; zero when free.
	ExpiresAt time.Time `json:"expires_at,omitzero"`
	// Held reports an owner whose lease had not expired at the read.
	Held bool `json:"held"`
	// Paused buckets are not claimed by any relay (Operator.PauseBucket).
	Paused bool `json:"paused"`
}

// RelayInfo is one relay's heartbeat.
type RelayInfo struct {
	ID        string    `json:"id"`
	LastSeen  time.Time `json:"last_seen"`
	StartedAt time.Time `json:"started_at"`
	// Live reports a heartbeat younger than the implementation's live window
	// (gormrelay.Admin.WithLiveWindow).
	Live bool `json:"live"`
	// Buckets counts the unexpired leases the relay holds.
	Buckets int `json:"buckets"`
}

// BucketStatus is the state of one bucket.
type BucketStatus struct {
	Bucket  int   `json:"bucket"`
	Pending int64 `json:"pending"`
	// Oldest is the creation time of the bucket's oldest pending message;
	// zero when none is pending. OldestAgeMs is its age at the read.
	Oldest      time.Time        `json:"oldest,omitzero"`
	OldestAgeMs int64            `json:"oldest_age_ms"`
	DeadLetters DeadLetterCounts `json:"dead_letters"`
	Lease       LeaseInfo        `json:"lease"`
	// Retrying is the bucket's first pending message whose publish
	// failed, which the relay retries while it holds the bucket, and its
	// key's later messages, back; nil when none failed. Table mode only.
	Retrying *RetryingMessage `json:"retrying,omitempty"`
}

// RetryingMessage is a pending message whose publish failed and is
// retried (BucketStatus.Retrying): what an operator needs to see why a
// bucket does not advance before the message becomes a dead letter.
type RetryingMessage struct {
	ID        int64  `json:"id"`
	MessageID string `json:"message_id"`
	Topic     string `json:"topic"`
	// Key is nil for a keyless message.
	Key       []byte    `json:"key"`
	CreatedAt time.Time `json:"created_at"`
	// Attempts counts its failed publishes so far.
	Attempts int `json:"attempts"`
	// LastError is the last failure, as a dead letter's LastError.
	LastError string `json:"last_error"`
}

// Status is an outbox's operational state at one moment: backlog, dead
// letters, leases and relays, per bucket and in total.
type Status struct {
	SampledAt   time.Time `json:"sampled_at"`
	BucketCount int       `json:"bucket_count"`
	Pending     int64     `json:"pending"`
	// Oldest is the creation time of the oldest pending message; zero
	// when nothing is pending. OldestAgeMs is its age at SampledAt.
	Oldest      time.Time        `json:"oldest,omitzero"`
	OldestAgeMs int64            `json:"oldest_age_ms"`
	DeadLetters DeadLetterCounts `json:"dead_letters"`
	// Buckets lists every bucket, 0 to BucketCount-1.
	Buckets []BucketStatus `json:"buckets"`
	// LeaseBuckets is the BucketCount the lease table defines: its
	// highest bucket plus one, 0 while it has no row. The relays refuse
	// to run with another count; a value other than BucketCount means
	// the status was read with the wrong count.
	LeaseBuckets int `json:"lease_buckets"`
	// LeasesBeyond lists the lease rows of buckets at or beyond
	// BucketCount, which Buckets leaves out; empty when the counts agree.
	LeasesBeyond []LeaseInfo `json:"leases_beyond,omitempty"`
	// Relays lists the relays with a heartbeat, by id.
	Relays []RelayInfo `json:"relays"`
	// LiveRelays counts the live relays.
	LiveRelays int `json:"live_relays"`
	// WAL is the replication slot of an outbox in WAL mode (a
	// WALOperator's Status); nil in table mode.
	WAL *WALStatus `json:"wal,omitempty"`
}

// OldestAge is how long the oldest pending message had waited at
// SampledAt; zero when nothing is pending.
func (s Status) OldestAge() time.Duration { return time.Duration(s.OldestAgeMs) * time.Millisecond }

// RequeueResult reports what a requeue moved back into the messages
// table.
type RequeueResult struct {
	// Requeued counts dead letters moved back.
	Requeued int64 `json:"requeued"`
	// Moved counts pending messages of a requeued key that were moved
	// behind the requeued ones to keep the key's order.
	Moved int64 `json:"moved"`
	// Buckets lists the buckets that received messages.
	Buckets []int `json:"buckets,omitempty"`
	// NotFound lists requested ids that were not dead letters.
	NotFound []int64 `json:"not_found,omitempty"`
}

// AddGroup counts requeued dead letters and moved pending messages of
// bucket.
func (r *RequeueResult) AddGroup(bucket int, requeued, moved int64) {
	r.Requeued += requeued
	r.Moved += moved
	if requeued+moved > 0 && !slices.Contains(r.Buckets, bucket) {
		r.Buckets = append(r.Buckets, bucket)
		slices.Sort(r.Buckets)
	}
}

// Snapshot is one reading of a Watch stream.
type Snapshot struct {
	Status Status
	// Err is set when the reading failed; the stream goes on.
	Err error
}

// WatchIntervalDefault is the Watch interval used for a non-positive one.
const WatchIntervalDefault = time.Second

// Watch streams op's Status, read at once and then every
// interval, until ctx ends; the channel is closed after the last send. It
// is read-only: it never claims, locks or changes anything, so it cannot
// compete with the relays, which makes it safe for dashboards, health
// checks and tests. A failed reading is sent with Err set and the stream
// continues. Readings are not buffered: a slow receiver delays the next
// one rather than receiving a backlog of stale readings. A message
// enqueued and published between two readings is never seen.
func Watch(ctx context.Context, op Operator, interval time.Duration) <-chan Snapshot {
	if interval <= 0 {
		interval = WatchIntervalDefault
	}
	ch := make(chan Snapshot)
	go func() {
		defer close(ch)
		t := time.NewTimer(0)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			st, err := op.Status(ctx)
			if ctx.Err() != nil {
				return
			}
			select {
			case ch <- Snapshot{Status: st, Err: err}:
			case <-ctx.Done():
				return
			}
			t.Reset(interval)
		}
	}()
	return ch
}
