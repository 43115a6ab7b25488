package relay

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math"
	"os"
	"time"
)

// Defaults applied by Config.WithDefaults.
const (
	// BucketCountDefault is the number of ordering buckets. It must match
	// the outbox's BucketCount on every writer and relay.
	BucketCountDefault = 8
	// BucketCountMax is the largest accepted BucketCount.
	BucketCountMax = 4096
	// BatchSizeDefault is how many rows one batch reads and publishes.
	// Every batch pays fixed costs (a read, a delete, produce round trips,
	// and in strict mode a Kafka transaction: three replicated writes on a
	// three-node cluster) that a larger batch spreads over more messages;
	// on three Apache Kafka nodes 2000 drained faster than 500 in both
	// modes and narrowed strict mode's gap to the default (BENCHMARKS.md,
	// "Batch size 2000 by default"). A relay that keeps up with its
	// writers is unaffected: a batch holds what is pending, up to
	// BatchSize.
	BatchSizeDefault = 2000
	// BatchSizeReconcilerDefault is BatchSize's default when the relay's
	// publisher is a Reconciler (strict mode's, publisher.Transactional):
	// its batch is a Kafka transaction, whose fixed cost (its coordinator
	// round trips and replicated writes, one after another for a bucket)
	// a larger batch spreads over more messages (BENCHMARKS.md, "Strict
	// mode: a batch of 8000").
	BatchSizeReconcilerDefault = 8000
	// BatchSizeMax is the largest accepted BatchSize.
	BatchSizeMax = 10_000
	// PollIntervalDefault is the fallback discovery interval.
	PollIntervalDefault = time.Second
	// LeaseDurationDefault is how long a lease lasts after its last
	// acquisition or renewal.
	LeaseDurationDefault = 30 * time.Second
	// LeaseRenewIntervalDefault is how often leases are renewed.
	LeaseRenewIntervalDefault = 10 * time.Second
	// BackoffMinDefault is the first wait after a failed publish.
	BackoffMinDefault = 500 * time.Millisecond
	// BackoffMaxDefault caps the wait after repeated failures.
	BackoffMaxDefault = 30 * time.Second
	// ReleaseTimeoutDefault bounds the release of the leases when a relay
	// stops, and the LeaseAware publisher's LeasesReleased call.
	ReleaseTimeoutDefault = 5 * time.Second
	// PublishTimeoutDefault bounds one Publish call. A healthy cluster
	// answers a batch in milliseconds; the default is far above what its
	// retries take, so it only ends a publish that no longer makes
	// progress.
	PublishTimeoutDefault = time.Minute
	// ParallelismDefault is how many buckets one relay drains at once:
	// one drainer per bucket at the default BucketCount (8), so that a
	// bucket that becomes ready never waits for a drainer busy with
	// another bucket's batch. On two cores eight drainers drained a
	// backlog 1.2 times as fast as four, and shortened the latency tail
	// when several buckets' batches were slow at once (BENCHMARKS.md).
	// Across relays sharing a table the drainers at work are never more
	// than the buckets, since each relay drains only the buckets it holds.
	ParallelismDefault = 8
	// ParallelismMax is the largest accepted Parallelism.
	ParallelismMax = 256
	// PipelineDepthDefault is how many batches of one bucket a relay
	// keeps in flight with a Pipeliner publisher (Config.PipelineDepth):
	// enough for a send of up to 32 ms at 1,000 messages per second over
	// 8 buckets, a hinted batch per bucket every 8 ms. In the relay's
	// model of that load (TestPipelineModel) a sink of 30 ms gives a p99
	// of 30 ms at 4, 50 ms at 2 and 60 ms at 1.
	PipelineDepthDefault = 4
	// PipelineDepthMax is the largest accepted PipelineDepth.
	PipelineDepthMax = 16
	// RelayIDMaxLen is the longest accepted RelayID, the width of the
	// lease owner and heartbeat columns.
	RelayIDMaxLen = 128
	// ShutdownTimeoutDefault bounds the graceful stop of Relay.Run, and
	// the stop of a publisher the relay owns.
	ShutdownTimeoutDefault = 10 * time.Second
)

// ProbeIntervalMin is the least time between two probes of a store
// (Prober) that stopped answering: the relay probes every
// max(BackoffMin, ProbeIntervalMin). A probe opens a connection to a
// server that may be restarting, so a BackoffMin of a few milliseconds
// would otherwise try it hundreds of times a second; at this floor the
// end of an outage is seen at most 100ms late.
const ProbeIntervalMin = 100 * time.Millisecond

// Config configures a Relay. The zero value is usable: every zero field
// takes the default documented on it.
type Config struct {
	// RelayID identifies this relay in lease rows, heartbeats and logs. It
	// must be unique among the relays sharing an outbox: two relays with one
	// id would both believe they own the same buckets. Default: generated as
	// hostname-pid-random, which is unique per process start. At most 128
	// bytes.
	RelayID string

	// BucketCount is the number of ordering buckets, 1 to 4096. Leave it
	// zero: a store that knows the outbox's BucketCount (BucketCounter; the
	// GORM store does) provides it, and a non-zero value that differs is
	// refused by New with a *ConfigError. With a store that does not know
	// it, the default is 8, and it must equal the BucketCount of every
	// writer and relay sharing the outbox; the store reports a mismatch as
	// a *MisconfigurationError and the relay stops.
	BucketCount int

	// BatchSize is how many rows one batch of a bucket reads, publishes
	// and deletes, 1 to 10000. Default 2000 (BatchSizeDefault); 8000
	// (BatchSizeReconcilerDefault) when New is given a Reconciler
	// publisher (strict mode's).
	//
	// A batch has no byte bound: each drainer holds one batch's messages
	// at a time, so a relay holds about BatchSize × Parallelism messages,
	// each up to the outbox's MaxMessageBytes (1 MB by default). At the
	// defaults that is 16,000 messages: 3.2 MB of 200-byte values, 16 GB
	// in the worst case of messages all near 1 MB (in strict mode 64,000:
	// 12.8 MB, 64 GB); lower BatchSize where
	// messages are large. In strict mode a batch is one Kafka transaction:
	// read_committed consumers see none of its records until all of them
	// are written and the transaction commits.
	BatchSize int

	// Parallelism is how many buckets the relay drains at once, 1 to 256,
	// each by its own drainer under that bucket's lease: one drainer at a
	// time has a bucket's batches in flight (one at a time, or up to
	// PipelineDepth with a Pipeliner), so order per key is kept whatever
	// the value. Default 8 (ParallelismDefault); never more
	// than the buckets the relay owns. With more than 1 the Publisher, the
	// Store and the FailureHandler are called concurrently for different
	// buckets (the Kafka publishers and the GORM store are safe for it);
	// 1 drains one bucket after another. The GORM store takes a database
	// connection for one statement at a time, so a pool smaller than
	// Parallelism makes drainers wait for connections, not fail (a wait
	// longer than the store's timeout fails that batch, which is retried).
	Parallelism int

	// PipelineDepth is how many batches of one bucket may be in flight
	// unacknowledged at once, 1 to 16, when the Publisher is a Pipeliner
	// and the store a BatchSkipper (the GORM store is one), and the
	// publisher is neither a Reconciler nor LeaseAware. While a bucket's
	// batches are unacknowledged and the bucket is hinted, its next batch
	// is read without their rows and sent behind them; a batch's rows are
	// deleted only after every earlier batch of the bucket was
	// acknowledged and deleted. A batch acknowledged behind an
	// unacknowledged one no longer counts, so one slow batch does not
	// hold the bucket's next sends back; at most 4 × PipelineDepth
	// batches of a bucket are in flight or waiting for their delete.
	// Default 4 (PipelineDepthDefault); 1 hands a bucket's next
	// batch to the publisher only after the previous one was acknowledged.
	// It has no effect with any other publisher.
	PipelineDepth int

	// PollInterval is the fallback discovery interval: how often a relay
	// owning buckets looks for pending rows it was not told about (writers
	// in other processes, lost hints, restarts). Hints from Hints wake the
	// relay at once, so this bounds latency only for unhinted writes.
	// Default 1s. A relay owning no buckets does not poll; it waits for its
	// next lease refresh at LeaseRenewInterval.
	PollInterval time.Duration

	// LeaseDuration is how long a bucket lease lasts after its last
	// acquisition or renewal: the time until a peer takes over the buckets
	// of a relay that died without releasing them. Default 30s. Longer
	// leases survive longer database or process stalls but delay takeover.
	LeaseDuration time.Duration

	// LeaseRenewInterval is how often leases are renewed and fair share
	// re-evaluated, including during a slow publish. Default 10s. It must be
	// shorter than LeaseDuration; the difference is the slack for database
	// latency, scheduling pauses and clock skew between relay hosts (see the
	// package documentation).
	LeaseRenewInterval time.Duration

	// BackoffMin and BackoffMax bound the exponential backoff, with jitter,
	// applied to a bucket after a failed publish or a store error, and to
	// lease acquisition after a store error. The bucket's messages keep
	// their order: the same batch is retried after the wait. A successful
	// batch resets the backoff. With a store that can be probed (Prober,
	// the GORM store), a backoff after the store stopped answering ends
	// early, at most max(BackoffMin, ProbeIntervalMin) after it answers
	// again. Defaults 500ms and 30s.
	BackoffMin time.Duration
	BackoffMax time.Duration

	// PublishTimeout bounds one Publish call: past it the relay cancels the
	// publish, deletes what was acknowledged, counts the failure
	// (Observer.Published, an error wrapping ErrPublishTimeout) and backs
	// the bucket off like after an outage, without counting it against the
	// messages. Default 1m (PublishTimeoutDefault), far above what a
	// healthy cluster needs. A lost lease or Stop cancels a publish
	// earlier.
	PublishTimeout time.Duration

	// ReleaseTimeout bounds the release of the leases when the relay stops
	// (Store.ReleaseLeases), and each LeasesReleased call of a LeaseAware
	// publisher. Both run under context.WithoutCancel: an expired Stop
	// context must not keep the buckets from peers until their leases
	// expire. A release that times out is logged; peers then take the
	// buckets over when the leases expire. Default 5s
	// (ReleaseTimeoutDefault).
	ReleaseTimeout time.Duration

	// Hints, if set, wakes the relay as soon as messages commit and names
	// the buckets that received them, so the relay fetches those buckets
	// directly instead of waiting for PollInterval. *outbox.Notifier
	// satisfies it. Hints never bypass ownership: a hint for a bucket the
	// relay does not own is ignored (the owner finds the rows by polling).
	// Default: none, polling only.
	Hints Hints

	// FailureHandler, if set, is called after every failed publish with the
	// first unacknowledged message; it decides whether the bucket backs
	// off (the default) or retries at once because the handler moved the
	// message out of the way (for example into a dead-letter table). If it
	// also implements BatchFilter, it sees every batch before the publisher.
	// Default: the Store itself when it implements FailureHandler (the GORM
	// store brings the outbox's dead-letter policy, see
	// gormrelay.FailurePolicy); otherwise none, and every failure backs off
	// and retries forever.
	FailureHandler FailureHandler

	// RateLimit, if positive, paces publishing to at most this many
	// messages per second across all the relay's buckets (a token bucket,
	// golang.org/x/time/rate), for draining a large backlog without
	// flooding the sink. Batches are then at most max(1, RateLimit)
	// messages (and at most BatchSize), and the relay waits for tokens
	// before each publish, holding no lock or transaction. The limit is per
	// relay: N relays publish up to N times RateLimit. Default 0: no limit.
	RateLimit float64

	// Logger receives the relay's logs. Default: slog.Default().
	Logger *slog.Logger

	// Observer receives the relay's instrumentation events (leases,
	// publishes, cycles, dead letters) for metrics; *metrics.Collector
	// implements it for Prometheus. If it also implements BacklogObserver
	// and the Store implements BacklogSampler, the started relay samples
	// the backlog for it. Default: NopObserver.
	Observer Observer

	// ShutdownTimeout bounds the graceful stop Relay.Run makes when its
	// context ends (stop claiming, finish the in-flight batch, delete what
	// was acknowledged, release the leases): past it the in-flight publish
	// is cancelled, its rows stay pending for the next owner, and Run
	// returns an error saying so. It also bounds the stop of a publisher
	// the relay owns (OwnPublisher), after the relay stopped. Relay.Stop
	// is bounded by its own context instead. Default 10s
	// (ShutdownTimeoutDefault).
	ShutdownTimeout time.Duration

	// OwnPublisher hands the publisher's lifecycle to the relay: the
	// publisher must implement PublisherService (publisher.Kafka,
	// publisher.Franz and publisher.Transactional do). Relay.Start (and Run) starts it after
	// the store's start check and before the relay runs, failing if it
	// cannot connect; the relay stops it once it has stopped, bounded by
	// ShutdownTimeout, before Stopped is closed. DrainOnce refuses to run
	// (it would have to start a publisher it cannot stop). Default false:
	// the caller starts the publisher before the relay and stops it after
	// (gormrelay.NewKafka sets it).
	OwnPublisher bool
}

// WithDefaults returns a copy of c with every zero field set to its
// default. A RelayID is generated if empty.
func (c Config) WithDefaults() Config {
	if c.RelayID == "" {
		c.RelayID = NewRelayID()
	}
	c.BucketCount = cmp.Or(c.BucketCount, BucketCountDefault)
	c.BatchSize = cmp.Or(c.BatchSize, BatchSizeDefault)
	c.Parallelism = cmp.Or(c.Parallelism, ParallelismDefault)
	c.PipelineDepth = cmp.Or(c.PipelineDepth, PipelineDepthDefault)
	c.PollInterval = cmp.Or(c.PollInterval, PollIntervalDefault)
	c.LeaseDuration = cmp.Or(c.LeaseDuration, LeaseDurationDefault)
	c.LeaseRenewInterval = cmp.Or(c.LeaseRenewInterval, LeaseRenewIntervalDefault)
	c.BackoffMin = cmp.Or(c.BackoffMin, BackoffMinDefault)
	c.BackoffMax = cmp.Or(c.BackoffMax, BackoffMaxDefault)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, PublishTimeoutDefault)
	c.ReleaseTimeout = cmp.Or(c.ReleaseTimeout, ReleaseTimeoutDefault)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	c.Observer = cmp.Or[Observer](c.Observer, NopObserver{})
	c.ShutdownTimeout = cmp.Or(c.ShutdownTimeout, ShutdownTimeoutDefault)
	return c
}

// validate checks a configuration that WithDefaults has filled in.
func (c Config) validate() error {
	bad := func(field string, value any, reason string) error {
		return &ConfigError{Field: field, Value: value, Reason: reason}
	}
	switch {
	case len(c.RelayID) > RelayIDMaxLen:
		return bad("RelayID", c.RelayID, fmt.Sprintf("at most %d bytes", RelayIDMaxLen))
	case c.BucketCount < 1 || c.BucketCount > BucketCountMax:
		return bad("BucketCount", c.BucketCount, fmt.Sprintf("must be between 1 and %d", BucketCountMax))
	case c.BatchSize < 1 || c.BatchSize > BatchSizeMax:
		return bad("BatchSize", c.BatchSize, fmt.Sprintf("must be between 1 and %d", BatchSizeMax))
	case c.Parallelism < 1 || c.Parallelism > ParallelismMax:
		return bad("Parallelism", c.Parallelism, fmt.Sprintf("must be between 1 and %d", ParallelismMax))
	case c.PipelineDepth < 1 || c.PipelineDepth > PipelineDepthMax:
		return bad("PipelineDepth", c.PipelineDepth, fmt.Sprintf("must be between 1 and %d", PipelineDepthMax))
	case c.PollInterval < 0:
		return bad("PollInterval", c.PollInterval, "must be positive")
	case c.LeaseDuration < 2*time.Millisecond:
		return bad("LeaseDuration", c.LeaseDuration, "must be at least 2ms (leases are stored in milliseconds)")
	case c.LeaseRenewInterval < time.Millisecond:
		return bad("LeaseRenewInterval", c.LeaseRenewInterval, "must be at least 1ms")
	case c.LeaseRenewInterval >= c.LeaseDuration:
		return bad("LeaseRenewInterval", c.LeaseRenewInterval,
			fmt.Sprintf("must be shorter than LeaseDuration (%s): a lease renewed no more often than it lasts expires between renewals", c.LeaseDuration))
	case c.BackoffMin < 0:
		return bad("BackoffMin", c.BackoffMin, "must be positive")
	case c.BackoffMax < c.BackoffMin:
		return bad("BackoffMax", c.BackoffMax, fmt.Sprintf("must be at least BackoffMin (%s)", c.BackoffMin))
	case c.PublishTimeout < 0:
		return bad("PublishTimeout", c.PublishTimeout, "must be positive")
	case c.ReleaseTimeout < 0:
		return bad("ReleaseTimeout", c.ReleaseTimeout, "must be positive")
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", c.ShutdownTimeout, "must be positive")
	case c.RateLimit < 0 || math.IsNaN(c.RateLimit) || math.IsInf(c.RateLimit, 0):
		return bad("RateLimit", c.RateLimit, "must be a finite number of messages per second, or 0 for no limit")
	}
	return nil
}

// trustWindow is how long after the start of a successful acquisition or
// renewal the relay trusts its leases: LeaseDuration minus half the renewal
// slack. It ends before the stored expiry (which the store computes from a
// later clock reading), so the relay stops publishing before any peer can
// take the buckets over, even with its renewals failing.
func (c Config) trustWindow() time.Duration {
	return c.LeaseDuration - (c.LeaseDuration-c.LeaseRenewInterval)/2
}

// NewRelayID returns a relay id unique per process start:
// hostname-pid-random.
func NewRelayID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "relay"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	suffix := fmt.Sprintf("-%d-%s", os.Getpid(), hex.EncodeToString(b[:]))
	if max := RelayIDMaxLen - len(suffix); len(host) > max {
		host = host[:max]
	}
	return host + suffix
}

// Failure describes a failed publish. It is handed to the FailureHandler.
type Failure struct {
	// RelayID and Lease identify who failed and under which lease; a
	// handler that changes the bucket's rows must guard its write with them
	// like MarkPublished does.
	RelayID string
	Lease   Lease
	// Message is the first message the publisher did not acknowledge.
	// When the publisher's error names a later message of the batch as the
	// cause (FailedIndex; a transactional publisher acknowledges nothing of
	// a failed batch), the relay first publishes the messages before that
	// one on their own, without calling the handler, so the handler meets
	// the culprit here. Message.Attempts includes this failure when the
	// store records attempts (FailureRecorder).
	Message Message
	// Acked is how many leading messages of the batch were acknowledged;
	// they have been deleted. It is 0 for a transactional publisher.
	Acked int
	// Err is the publisher's error. relay.IsPermanent tells a message the
	// sink rejects from a transient failure.
	Err error
}

// FailureAction is a FailureHandler's decision.
type FailureAction int

const (
	// FailureBackoff keeps the message where it is and retries the bucket
	// after the exponential backoff. The default.
	FailureBackoff FailureAction = iota
	// FailureRetry reads the bucket again at once. Return it only after
	// taking the failed message out of the bucket (dead-lettering it);
	// otherwise the relay would retry a failing message without pause.
	FailureRetry
)

// FailureHandler is the failure policy's seam: it is called on the
// drainer that published, after a publish failed, never for a publish
// cancelled by Stop or by a lost lease. With Config.Parallelism above 1 it
// is called concurrently for different buckets, never for the same one. An error it returns is logged and treated as
// FailureBackoff.
type FailureHandler interface {
	HandleFailure(ctx context.Context, f Failure) (FailureAction, error)
}

// FailureHandlerFunc adapts a function to the FailureHandler interface.
type FailureHandlerFunc func(ctx context.Context, f Failure) (FailureAction, error)

// HandleFailure calls f.
func (f FailureHandlerFunc) HandleFailure(ctx context.Context, fl Failure) (FailureAction, error) {
	return f(ctx, fl)
}

// BatchFilter is an optional FailureHandler capability: it sees every
// batch after it was read and before it is published, and may take
// messages out of the bucket (gormrelay.FailurePolicy parks the messages of a
// key whose earlier message was dead-lettered). It returns the messages to
// publish, a subsequence of msgs in their order; every message it leaves
// out must be gone from the bucket when it returns, written under the
// lease guard like MarkPublished, or the relay would read it again. An
// error wrapping ErrLeaseLost drops the bucket; any other error fails the
// batch with backoff. When it leaves nothing, the bucket is read again at
// once. The messages it leaves out are reported to
// Observer.MessagesDeadLettered as parked.
type BatchFilter interface {
	FilterBatch(ctx context.Context, relayID string, lease Lease, msgs []Message) ([]Message, error)
}

// CheckBucketCount is the one BucketCount agreement check: it returns nil
// when got, the BucketCount a relay uses, is want, the outbox's, and
// otherwise a *MisconfigurationError saying both; outbox names the outbox
// in the reason (for example its messages table). New runs it against a
// BucketCounter store, and a store runs it on every AcquireRequest and in
// CheckStart (the GORM store does), so a relay and an outbox that
// disagree are told apart the same way everywhere.
func CheckBucketCount(got, want int, outbox string) error {
	if got == want {
		return nil
	}
	return &MisconfigurationError{Setting: "BucketCount",
		Reason: fmt.Sprintf("the relay uses %d buckets but %s is configured with %d: every writer and relay must use the same BucketCount, set once on the outbox configuration", got, outbox, want)}
}

// takeBucketCount fills cfg.BucketCount from a store that knows the
// outbox's (BucketCounter) and refuses a Config value that disagrees,
// with a *ConfigError wrapping CheckBucketCount's error.
func takeBucketCount(store Store, cfg *Config) error {
	bc, ok := store.(BucketCounter)
	if !ok {
		return nil
	}
	n := bc.BucketCount()
	cfg.BucketCount = cmp.Or(cfg.BucketCount, n)
	if err := CheckBucketCount(cfg.BucketCount, n, "the store's outbox"); err != nil {
		return &ConfigError{Field: "BucketCount", Value: cfg.BucketCount,
			Reason: "leave relay.Config.BucketCount zero to take it from the store", Err: err}
	}
	return nil
}
