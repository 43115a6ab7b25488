package relay

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"
)

// Defaults of BacklogSampling, applied when a field is zero.
const (
	// BacklogSampleIntervalDefault is the wait after one backlog sample
	// completes before the next one starts.
	BacklogSampleIntervalDefault = 30 * time.Second
	// BacklogSampleTimeoutDefault bounds one backlog sample.
	BacklogSampleTimeoutDefault = 5 * time.Second
)

// Observer receives the relay's instrumentation events: the seam between
// the relay and a metrics system (package metrics implements it for
// Prometheus), so that the relay itself imports none.
//
// The relay calls the methods synchronously from its own goroutines (the
// control loop, the drainers, the lease renewal), so they may be called
// concurrently and must be fast and safe for concurrent use: update
// a counter, never block on I/O. Events are reported once per batch or per
// lease change, never once per message.
//
// Implementations should embed NopObserver: methods added to Observer in
// later versions then default to doing nothing instead of breaking the
// build.
type Observer interface {
	// OwnedBuckets reports how many buckets the relay owns and trusts,
	// after every change of its local lease set: acquisition, release,
	// loss, expiry of the trust window, stop (0). It is the relay's local
	// view, not a database query.
	OwnedBuckets(n int)

	// LeasesAcquired reports n buckets the relay gained at an acquisition,
	// counting a bucket it re-acquired under a new term.
	LeasesAcquired(n int)

	// LeasesExpired reports n buckets the relay lost without releasing
	// them: the local lease deadline passed without a successful renewal,
	// or a renewal, delete or failure record found the lease taken over.
	// Each lost bucket is reported once. Buckets given up voluntarily (fair
	// share, pause, Stop) are not expirations, nor are leases an operator
	// revoked (see RevocationObserver).
	LeasesExpired(n int)

	// Published reports one call of the Publisher, successful, failed or
	// cancelled. See PublishEvent.
	Published(e PublishEvent)

	// CycleFinished reports the duration of one pass of the relay's
	// control loop that did work (lease maintenance when due), and of
	// each discovery, which runs beside the loop. Batches run on the
	// drainers and are reported by Published. Idle waits and backoff
	// waits are not included. DrainOnce reports no cycles.
	CycleFinished(d time.Duration)

	// MessagesDeadLettered reports n messages that the failure policy took
	// out of the backlog into the dead letters. The relay reports one
	// failed message (parked false) when the FailureHandler returns
	// FailureRetry, having moved the failed message away, and the messages
	// a BatchFilter removed from a batch as parked (parked true): held back
	// because an earlier message of their key is a dead letter, without
	// failing themselves.
	MessagesDeadLettered(n int, parked bool)
}

// PublishEvent describes one call of the Publisher.
type PublishEvent struct {
	// Bucket is the bucket the batch came from.
	Bucket int
	// Messages is the size of the batch handed to the publisher.
	Messages int
	// Acked is the contiguous prefix the publisher acknowledged. It counts
	// acknowledgements by the sink, before the rows are deleted: a message
	// published again after a failed delete or a lost lease is counted
	// again.
	Acked int
	// Duration is the time the Publish call took.
	Duration time.Duration
	// Err is why fewer than Messages were acknowledged: the publisher's
	// error, or an error saying it acknowledged fewer without one. It is
	// nil for a complete success and for a cancelled publish.
	Err error
	// Cancelled reports a publish that the relay cancelled itself, because
	// it is stopping or lost the bucket's lease. It is not a failure.
	Cancelled bool
}

// Failed reports whether the publish failed (Err is set).
func (e PublishEvent) Failed() bool { return e.Err != nil }

// NopObserver is an Observer that does nothing. It is the default
// Config.Observer; embed it in an Observer to get no-op defaults.
type NopObserver struct{}

var _ Observer = NopObserver{}

// OwnedBuckets does nothing.
func (NopObserver) OwnedBuckets(int) {}

// LeasesAcquired does nothing.
func (NopObserver) LeasesAcquired(int) {}

// LeasesExpired does nothing.
func (NopObserver) LeasesExpired(int) {}

// Published does nothing.
func (NopObserver) Published(PublishEvent) {}

// CycleFinished does nothing.
func (NopObserver) CycleFinished(time.Duration) {}

// MessagesDeadLettered does nothing.
func (NopObserver) MessagesDeadLettered(int, bool) {}

// Backlog is a sample of what is waiting in an outbox, as a
// BacklogSampler reads it.
type Backlog struct {
	// BucketCount is the number of buckets of the outbox, so that empty
	// buckets can be reported as empty; 0 if the store does not know it.
	BucketCount int
	// Pending is the number of pending messages in the whole outbox,
	// including the buckets other relays own.
	Pending int64
	// Oldest is the creation time of the oldest pending message. It is
	// zero when nothing is pending, or when the store cannot tell
	// (Pending > 0): the age is then unknown, not zero.
	Oldest time.Time
	// Buckets lists the buckets holding pending messages, in bucket order.
	Buckets []BucketBacklog
	// DeadLetters counts the messages in the dead-letter table, valid when
	// DeadLettersKnown.
	DeadLetters      int64
	DeadLettersKnown bool
	// Paused lists the buckets an operator paused, which no relay claims
	// until they are resumed, in bucket order; valid when PausedKnown.
	Paused      []int
	PausedKnown bool
	// SampledAt is when the sample was read. The relay fills it in if the
	// sampler leaves it zero.
	SampledAt time.Time
}

// BucketBacklog is the backlog of one bucket.
type BucketBacklog struct {
	Bucket  int
	Pending int64
	// Oldest is the creation time of the bucket's oldest pending message;
	// zero if unknown.
	Oldest time.Time
}

// OldestAge returns how long the oldest pending message had waited at
// SampledAt, and false when the age is unknown (no timestamp). An empty
// backlog has a known age of 0. A creation time after SampledAt (clock
// skew between writers and the sampler) counts as 0.
func (b Backlog) OldestAge() (time.Duration, bool) {
	return ageAt(b.Pending, b.Oldest, b.SampledAt)
}

func ageAt(pending int64, oldest, at time.Time) (time.Duration, bool) {
	if pending == 0 {
		return 0, true
	}
	if oldest.IsZero() {
		return 0, false
	}
	return max(at.Sub(oldest), 0), true
}

// BacklogSampler is an optional Store capability: reading the outbox's
// whole backlog (pending count and oldest pending message, in total and
// per bucket, and the dead-letter count) for metrics. Unlike the other
// Store methods it runs concurrently with the relay's loop, on its own
// goroutine, at most one call at a time per relay; an implementation must
// be safe for that (use its own connection or session) and must honour
// ctx, which carries the sample timeout. It may read the whole table: the
// relay calls it only every BacklogSampling.Interval.
type BacklogSampler interface {
	SampleBacklog(ctx context.Context) (Backlog, error)
}

// BacklogSampling configures backlog sampling. The zero value samples
// every 30 seconds on every relay.
type BacklogSampling struct {
	// Interval is the wait after one sample completes before the next one
	// starts, so samples never overlap or burst to catch up. Default
	// BacklogSampleIntervalDefault (30s); negative disables sampling.
	Interval time.Duration
	// Timeout bounds one sample; a sample that times out is reported as
	// unavailable. Default BacklogSampleTimeoutDefault (5s).
	Timeout time.Duration
	// BucketZeroOwnerOnly samples only on the relay that holds (and
	// trusts) the lease of bucket 0, so that N relays sharing an outbox do
	// not run N identical whole-table queries. The other relays report the
	// backlog as unavailable. Enable it on every relay of the outbox, and
	// aggregate backlog metrics across relays with max, not sum. Default
	// false: every relay samples.
	BucketZeroOwnerOnly bool
}

// RevocationObserver is an Observer that also wants to know of leases an
// operator revoked: a renewal, delete or failure record found the
// bucket's lease term advanced by the admin API (a requeue, purge or
// discard of the bucket's dead letters) while the lease row still names
// this relay (ErrLeaseRevoked; the store tells them apart through
// RevocationChecker). The relay stops publishing the bucket under the old
// term, as for any lost lease, and takes it again under the new one at
// its next acquisition. Such buckets are not reported to LeasesExpired,
// with or without this interface.
type RevocationObserver interface {
	Observer
	// LeasesRevoked reports n buckets whose lease an operator revoked.
	LeasesRevoked(n int)
}

// BacklogObserver is an Observer that also wants backlog samples. When
// Config.Observer implements it and the Store implements BacklogSampler,
// a started relay samples the backlog on its own goroutine (see
// BacklogSampling) and reports every outcome. DrainOnce does not sample.
type BacklogObserver interface {
	Observer
	// BacklogSampling returns the sampling configuration. The relay calls
	// it once, at Start.
	BacklogSampling() BacklogSampling
	// BacklogSampled reports a successful sample.
	BacklogSampled(b Backlog)
	// BacklogUnavailable reports that no current sample exists: the
	// sample failed or timed out (err says why), or err is nil because
	// this relay does not sample now (it does not hold bucket 0 under
	// BucketZeroOwnerOnly, or it stopped). A metrics system must report
	// the backlog as unknown then, never as zero.
	BacklogUnavailable(err error)
}

// WithDefaults returns a copy of s with every zero field set to its
// default (a negative Timeout too). The relay applies it at Start.
func (s BacklogSampling) WithDefaults() BacklogSampling {
	s.Interval = cmp.Or(s.Interval, BacklogSampleIntervalDefault)
	s.Timeout = cmp.Or(max(s.Timeout, 0), BacklogSampleTimeoutDefault)
	return s
}

// startSampler starts the backlog sampler of a started relay if the
// observer and the store support it, and returns the function that stops
// it and waits for it; the stop reports the backlog as unavailable, since
// a stopped relay no longer vouches for any sample.
func (r *Relay) startSampler(ctx context.Context, k *keeper) (stop func()) {
	obs, ok := r.cfg.Observer.(BacklogObserver)
	if !ok {
		return func() {}
	}
	sampler, ok := r.store.(BacklogSampler)
	if !ok {
		obs.BacklogUnavailable(nil)
		return func() {}
	}
	cfg := obs.BacklogSampling().WithDefaults()
	if cfg.Interval < 0 {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { r.sampleBacklog(ctx, k, obs, sampler, cfg) })
	return func() {
		cancel()
		wg.Wait()
		obs.BacklogUnavailable(nil)
	}
}

// sampleBacklog runs one sample at a time until ctx ends: the first at
// once, each next one Interval after the previous completed.
func (r *Relay) sampleBacklog(ctx context.Context, k *keeper, obs BacklogObserver, s BacklogSampler, cfg BacklogSampling) {
	log := r.cfg.Logger
	log.Debug("relay: backlog sampler started", "interval", cfg.Interval, "bucket_zero_owner_only", cfg.BucketZeroOwnerOnly)
	defer log.Debug("relay: backlog sampler stopped")
	owner := func() bool {
		_, ok := k.lease(0)
		return ok || !cfg.BucketZeroOwnerOnly
	}
	// A relay that does not own bucket 0 checks again at every lease
	// refresh, so a new owner takes over sampling soon after acquiring it.
	notOwnerWait := min(cfg.Interval, r.cfg.LeaseRenewInterval)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		if !owner() {
			obs.BacklogUnavailable(nil)
			timer.Reset(notOwnerWait)
			continue
		}
		start := time.Now()
		sctx, cancel := context.WithTimeoutCause(ctx, cfg.Timeout,
			fmt.Errorf("relay: sample backlog: timed out after %s", cfg.Timeout))
		b, err := s.SampleBacklog(sctx)
		if err != nil && sctx.Err() != nil && ctx.Err() == nil {
			err = fmt.Errorf("%w: %w", context.Cause(sctx), err)
		}
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Warn("relay: sample backlog failed; backlog metrics are unavailable until the next sample", "err", err, "retry_in", cfg.Interval)
			obs.BacklogUnavailable(err)
		case !owner():
			// Lost bucket 0 while sampling: the new owner reports now.
			obs.BacklogUnavailable(nil)
		default:
			if b.SampledAt.IsZero() {
				b.SampledAt = start
			}
			obs.BacklogSampled(b)
		}
		timer.Reset(jitter(cfg.Interval))
	}
}
