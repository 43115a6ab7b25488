package relay

import (
	"context"
	"time"
)

// Store is the relay's storage contract. It must be safe for concurrent
// use: the relay's drainers call NextBatch, MarkPublished and the other
// per-bucket methods concurrently for different buckets (never for the
// same bucket), and discovery, a LeaseRenewer's RenewLeases and
// AcquireLeases run alongside them (AcquireRequest.Busy names the buckets
// whose batch is in flight). Package relay/storetest checks an
// implementation against this contract.
//
// A store needs two primitives: an atomic conditional write for leases (a
// guarded UPDATE ... WHERE owner = ... AND term = ... AND expires_at > now)
// and per-bucket oldest-first reads. Rows leave the store only through
// MarkPublished (and an operator's explicit action), never by expiry:
// deleting unacknowledged rows would turn at-least-once into loss.
//
// Times are Unix milliseconds from the relay host's clock; see the package
// documentation for the clock-skew tolerance.
//
// Errors: a *MisconfigurationError stops the relay; ErrLeaseLost (wrapped)
// makes it drop the bucket; any other error is retried with backoff.
//
// Optional capabilities are discovered by type assertion: LeaseRenewer
// (renewal during a slow publish), FailureRecorder (attempt counting) and
// FailureHandler (the store's own failure policy, used when
// Config.FailureHandler is nil).
// Further capabilities, such as backlog metrics, are added the same way,
// so existing stores keep working.
type Store interface {
	// AcquireLeases is the relay's periodic lease maintenance, called at
	// start and then about every LeaseRenewInterval. In order it
	//   - records the relay's heartbeat;
	//   - fails with a *MisconfigurationError if req.BucketCount differs
	//     from the store's, or rows or leases exist in buckets outside
	//     0..BucketCount-1;
	//   - counts the live relays (heartbeat younger than LeaseDuration) and
	//     computes the fair share, FairShare(BucketCount, live);
	//   - renews the unexpired leases the relay holds (owner and term
	//     guarded; an expiry only moves forward, see LeaseRenewer),
	//     releases those above its fair share, and claims free or
	//     expired leases up to its fair share, incrementing the term of each
	//     claimed lease in the same guarded UPDATE. A held lease in
	//     req.Busy is never released by this call, whatever the fair share
	//     or an operator's pause: it is renewed, and the surplus is taken
	//     from the other held leases (what remains is released by a later
	//     call, once that batch is done).
	// It returns every lease the relay holds afterwards, each valid until
	// at least the call's start plus req.LeaseDuration.
	AcquireLeases(ctx context.Context, req AcquireRequest) (Acquired, error)

	// ReleaseLeases gives up every lease relayID holds and removes the
	// relay's heartbeat, so peers recount the live relays and take the
	// buckets over at their next acquisition instead of after expiry. The
	// relay calls it once, when it stops, after its batches have ended.
	// leases lists the leases the relay knows it holds; the store must
	// release the others owned by relayID too (guarded by owner alone),
	// since a claim can commit after the relay gave up on its reply, as
	// when the relay's context ended with the statement in flight. A
	// lease another relay took over is left alone. Such a statement may
	// even run after the release: a store should then neither bring the
	// heartbeat back nor let the claim take a lease (the GORM store
	// advances the released leases' terms, which a claim names).
	ReleaseLeases(ctx context.Context, relayID string, leases []Lease) error

	// PendingBuckets returns which of buckets hold at least one pending
	// row, in ascending order. It should cost one index probe per bucket,
	// not a scan of the backlog. buckets may be empty: the relay asks only
	// about buckets neither ready nor in flight, and still calls when none
	// is left, so a store can check for rows beyond BucketCount.
	PendingBuckets(ctx context.Context, buckets []int) ([]int, error)

	// NextBatch returns up to limit pending messages of bucket, oldest
	// first. It reads afresh on every call: rows committed late by slower
	// transactions can sort before rows already seen, so no cursor is kept.
	NextBatch(ctx context.Context, bucket, limit int) ([]Message, error)

	// MarkPublished deletes msgs, a contiguous acknowledged prefix of what
	// NextBatch returned, by their ids (never by an id range, which would
	// also delete late-committed rows that were never published). The
	// delete is conditioned, in the same statement, on lease.Bucket being
	// held by relayID under lease.Term and unexpired; otherwise nothing is
	// deleted and an error wrapping ErrLeaseLost is returned. Rows already
	// gone are not an error.
	//
	// With a Reconciler publisher the relay also calls it with the ids
	// the sink says it holds: Messages with only ID and Bucket set, in the
	// order the publisher named them, possibly of rows deleted long ago.
	// The store must therefore never reuse an id, and must delete only
	// rows of lease.Bucket.
	MarkPublished(ctx context.Context, relayID string, lease Lease, msgs []Message) error
}

// AcquireRequest is the input of Store.AcquireLeases.
type AcquireRequest struct {
	RelayID       string
	BucketCount   int
	LeaseDuration time.Duration
	// Busy lists, in ascending order, the held buckets whose batch is in
	// flight while the call runs. The store must not release them: a
	// bucket is released only between its batches, so that no other relay
	// starts on it while this one still publishes. Acquisition does not
	// wait for slow publishes to end.
	Busy []int
	// Parallelism is the relay's Config.Parallelism: how many of its
	// drainers may call the store at once, besides its lease keeper. A
	// store may size its connections by it (the GORM store raises an
	// untuned connection pool's idle limit); it changes no lease.
	Parallelism int
}

// Acquired is the result of Store.AcquireLeases.
type Acquired struct {
	// Leases are the leases the relay holds after the call, by bucket.
	Leases []Lease
	// LiveRelays is the number of relays with a fresh heartbeat, this one
	// included.
	LiveRelays int
	// FairShare is the number of buckets the relay aimed for.
	FairShare int
	// Waiting lists, when the relay holds fewer than FairShare leases, the
	// unexpired leases of other relays that hold more than their fair
	// share: the buckets this relay waits for. A live owner gives them up
	// at its next acquisition; an owner that exited without releasing them
	// (a crash, a kill) loses them when they expire. Optional: a store may
	// leave it empty; the relay only logs it.
	Waiting []HeldLease
	// Paused and AboveShare list, in ascending order, the buckets the
	// relay held that the call gave up because an operator paused them,
	// and because the relay held more than FairShare. Optional: the relay
	// only logs them, as the reason of each release (a held bucket in
	// neither was lost: its lease expired before the renewal).
	Paused, AboveShare []int
}

// HeldLease is a lease held by another relay, as AcquireLeases saw it.
type HeldLease struct {
	Bucket    int
	Owner     string
	ExpiresAt time.Time
}

// LeaseRenewer is an optional Store capability: extending held leases
// without acquiring or releasing any. The relay calls it concurrently with
// a publish that outlasts LeaseRenewInterval, so a slow but healthy publish
// keeps its lease. Without it the relay bounds each publish by its local
// lease deadline and cancels the publish when the deadline passes.
type LeaseRenewer interface {
	// RenewLeases extends each lease still held by relayID under its term
	// and unexpired to now plus d, refreshes the relay's heartbeat, and
	// returns the leases it holds. A lease missing from the result is
	// lost.
	//
	// An expiry never moves back: a lease whose expiry is already later
	// than now plus d keeps it, and is returned as held. The relay's
	// renewal and its AcquireLeases run concurrently, and their writes may
	// reach the store in either order; a write that started earlier but
	// lands later must neither shorten a lease the relay already trusts
	// for longer nor make a held lease look lost.
	RenewLeases(ctx context.Context, relayID string, leases []Lease, d time.Duration) ([]Lease, error)
}

// StartChecker is an optional Store capability: checking, before the relay
// starts, what would otherwise stop it later (the outbox tables exist and
// are current, the store's BucketCount is the relay's, no row or lease
// lies outside the buckets). Relay.Start calls it synchronously and
// returns its error, so a misconfigured relay fails at start instead of in
// the background.
type StartChecker interface {
	CheckStart(ctx context.Context, bucketCount int) error
}

// FailureRecorder is an optional Store capability: recording a failed
// publish attempt on the message (an attempt counter and the last error),
// guarded by the lease like MarkPublished. The relay calls it before the
// FailureHandler, so Failure.Message.Attempts counts the failure.
type FailureRecorder interface {
	RecordFailure(ctx context.Context, relayID string, lease Lease, msg Message, cause error) error
}

// Hints tells the relay which buckets received committed messages.
// *outbox.Notifier satisfies it.
type Hints interface {
	// Ready receives a value when hints are pending. Many notifications
	// may coalesce into one.
	Ready() <-chan struct{}
	// Take appends the pending bucket ids to dst, clears them, and reports
	// whether an unknown-bucket hint (a commit whose buckets are not known)
	// was pending, which makes the relay run a discovery query.
	Take(dst []int) ([]int, bool)
}

// FairShare is the number of buckets each of live relays should own:
// ceil(bucketCount / live). The shares of all live relays cover every
// bucket.
func FairShare(bucketCount, live int) int {
	if live < 1 {
		live = 1
	}
	return (bucketCount + live - 1) / live
}

// BucketCounter is an optional Store capability: telling the outbox's
// BucketCount, which is set once, on the writers' configuration (the GORM
// store takes it from outbox.Config). relay.New then takes the relay's
// BucketCount from the store: Config.BucketCount may be left zero, and a
// non-zero value that differs is refused with a *ConfigError.
type BucketCounter interface {
	BucketCount() int
}

// BatchAdvancer is an optional Store capability: deleting a batch's
// acknowledged messages and reading the next batch of the same bucket in
// one call, in one round trip where the database allows it. The relay
// uses it after a full batch was published completely, instead of
// MarkPublished followed by NextBatch.
type BatchAdvancer interface {
	// MarkPublishedNext deletes msgs exactly as MarkPublished does (by id,
	// guarded in the same statement by relayID holding lease unexpired
	// under its term; an error wrapping ErrLeaseLost when the guard
	// refuses, with nothing deleted and no batch), then returns up to limit
	// pending messages of lease.Bucket oldest first, as NextBatch would
	// return them after the delete: read from the head of the bucket, none
	// of msgs among them.
	//
	// A nil batch with a nil error says the delete succeeded but nothing
	// was read ahead (the read failed after the delete): the relay reads
	// the bucket with NextBatch. An empty, non-nil batch says the bucket is
	// empty.
	MarkPublishedNext(ctx context.Context, relayID string, lease Lease, msgs []Message, limit int) ([]Message, error)
}

// Prober is an optional Store capability: telling, in one cheap round
// trip, whether the store's database answers. After an acquisition or a
// discovery failed, the relay probes the store every max(BackoffMin,
// ProbeIntervalMin) while it waits to retry; once a probe answers after
// the store was seen down (the failed call, or a probe that failed
// since), the relay retries at once instead of sleeping out its backoff
// (up to BackoffMax): the acquisition, the discovery, and the batches of
// the buckets backing off. A store call that fails while the probe
// answers keeps its plain backoff. Without a Prober the relay sleeps the
// backoff out.
type Prober interface {
	// Probe returns nil when the store's database answers. It must not
	// log a failure: the relay calls it while the database is down.
	Probe(ctx context.Context) error
}

// BatchSkipper is an optional Store capability: reading a bucket's next
// batch while the previous one's delete has not run yet. With it the
// relay takes a bucket's delete off the path to its next publish: once a
// batch is acknowledged, its delete runs alongside the read of the next
// batch and that batch's publish (see the package documentation, "The
// batch cycle").
type BatchSkipper interface {
	// NextBatchExcept returns up to limit pending messages of bucket,
	// oldest first, as NextBatch does, leaving out the messages of except
	// (matched by ID): what NextBatch would return once except is deleted.
	// A nil batch with a nil error says nothing was read (the store cannot
	// leave that many out in one read): the relay deletes first and reads
	// with NextBatch.
	NextBatchExcept(ctx context.Context, bucket, limit int, except []Message) ([]Message, error)
}

// RevocationChecker is implemented by a store whose operator tools revoke
// leases (the GORM store's admin API advances a bucket's lease term). The
// relay calls it with the leases a renewal or an acquisition no longer
// found held (an acquisition's renewal is guarded by the term too), to tell
// an operator's revocation from an expiry or a takeover in its log and
// its Observer (RevocationObserver). It returns those of lost whose row
// still names relayID, unexpired, under a later term. An error is logged
// and the leases are reported as expired. The store's lease-guarded
// operations report the same finding by wrapping ErrLeaseRevoked.
type RevocationChecker interface {
	RevokedLeases(ctx context.Context, relayID string, lost []Lease) ([]Lease, error)
}
