package relay

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"

	"golang.org/x/time/rate"
)

// parts is what New resolves once and every part of a run shares: the
// configuration, the store, the publisher and their optional
// capabilities.
type parts struct {
	cfg       Config
	store     Store
	publisher Publisher
	caps      capabilities // optional capabilities or their fallbacks
	// leaseAware is told of lease changes; nil if the publisher does not
	// implement LeaseAware.
	leaseAware LeaseAware
	// reconciler names the rows the sink already holds; nil if the
	// publisher does not implement Reconciler.
	reconciler Reconciler
	// pipeliner takes a bucket's next batch while earlier ones are
	// unacknowledged (Config.PipelineDepth); nil without one, a
	// BatchSkipper, a depth above 1, or with a strict-mode publisher.
	pipeliner Pipeliner
	// sinkProber tells whether the sink answers during its outage; nil
	// if the publisher does not implement SinkProber: a backoff after an
	// unavailable publish is slept out.
	sinkProber SinkProber
}

// resolveParts resolves the capabilities of store, publisher and cfg.
func resolveParts(store Store, publisher Publisher, cfg Config) parts {
	p := parts{cfg: cfg, store: store, publisher: publisher, caps: resolveCapabilities(store, cfg)}
	p.leaseAware, _ = publisher.(LeaseAware)
	p.reconciler, _ = publisher.(Reconciler)
	p.sinkProber, _ = publisher.(SinkProber)
	if p.leaseAware != nil || p.reconciler != nil {
		// A LeaseAware or Reconciler publisher (the strict mode's) keeps
		// each batch's delete before the next batch's publish: its
		// progress marker names only the last batch it committed.
		p.caps.skipper = nil
	}
	if pl, ok := publisher.(Pipeliner); ok && p.caps.skipper != nil && cfg.PipelineDepth > 1 {
		p.pipeliner = pl
	}
	return p
}

// capabilities are the optional capabilities of the store, the failure
// handler and the configuration, resolved once by New. Each is the real
// one or a fallback that does what the relay does without it, so the
// drain path calls every one of them unconditionally.
type capabilities struct {
	renewal  renewal         // LeaseRenewer, or the publish bounded by the trust window
	recorder FailureRecorder // the store's, or recordsNothing
	advancer BatchAdvancer   // the store's, or deleteOnly: no read ahead
	skipper  BatchSkipper    // the store's, or nil: each delete before the next read
	handler  FailureHandler  // Config.FailureHandler, the store's, or backoffAlways
	filter   BatchFilter     // the handler's, or keepAll
	pacer    pacer           // Config.RateLimit's limiter, or unpaced
	hints    Hints           // Config.Hints, or noHints
	prober   Prober          // the store's, or nil: a store backoff is slept out
}

// resolveCapabilities finds the optional capabilities of store, of the
// failure handler (cfg.FailureHandler, else the store's own) and of cfg,
// and fills in a fallback for each one missing.
func resolveCapabilities(store Store, cfg Config) capabilities {
	c := capabilities{
		renewal:  noRenewal{},
		recorder: recordsNothing{},
		advancer: deleteOnly{store},
		handler:  cfg.FailureHandler,
		filter:   keepAll{},
		pacer:    unpaced{},
		hints:    cfg.Hints,
	}
	if lr, ok := store.(LeaseRenewer); ok {
		c.renewal = storeRenewal{lr}
	}
	if fr, ok := store.(FailureRecorder); ok {
		c.recorder = fr
	}
	if ba, ok := store.(BatchAdvancer); ok {
		c.advancer = ba
	}
	c.prober, _ = store.(Prober)
	c.skipper, _ = store.(BatchSkipper)
	if c.handler == nil {
		c.handler, _ = store.(FailureHandler)
	}
	if bf, ok := c.handler.(BatchFilter); ok {
		c.filter = bf
	}
	if c.handler == nil {
		c.handler = backoffAlways{}
	}
	if c.hints == nil {
		c.hints = noHints{}
	}
	if cfg.RateLimit > 0 {
		// One publish takes a whole batch of tokens at once: the burst is
		// the largest batch the pace allows.
		burst := min(cfg.BatchSize, max(1, int(cfg.RateLimit)))
		c.pacer = rate.NewLimiter(rate.Limit(cfg.RateLimit), burst)
	}
	return c
}

// renewal is how held leases outlast a slow publish.
type renewal interface {
	// start begins renewing k's leases in the background, and returns the
	// function that stops it.
	start(ctx context.Context, k *keeper) (stop func())
	// bound returns the context a publish under pctx runs in; what names
	// the bucket in the cause.
	bound(pctx context.Context, k *keeper, what string) (context.Context, context.CancelFunc)
}

// storeRenewal renews the leases through the store's LeaseRenewer, on the
// keeper's own goroutine; a publish ends only when its lease does.
type storeRenewal struct{ LeaseRenewer }

func (s storeRenewal) start(ctx context.Context, k *keeper) (stop func()) {
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { k.renewLoop(rctx, s.LeaseRenewer) })
	return func() { cancel(); wg.Wait() }
}

func (storeRenewal) bound(pctx context.Context, _ *keeper, _ string) (context.Context, context.CancelFunc) {
	return pctx, func() {}
}

// noRenewal is the fallback without a LeaseRenewer: leases are extended
// only by acquisition, so a publish ends with the trust window, and says
// so to a publisher that looks at its deadline.
type noRenewal struct{}

func (noRenewal) start(context.Context, *keeper) (stop func()) { return func() {} }

func (noRenewal) bound(pctx context.Context, k *keeper, what string) (context.Context, context.CancelFunc) {
	return context.WithDeadlineCause(pctx, k.trustDeadline(),
		fmt.Errorf("%w: %s: local lease deadline passed during publish", ErrLeaseLost, what))
}

// errNotRecorded is recordsNothing's answer: the failure was not counted
// on the message.
var errNotRecorded = errors.New("relay: the store records no publish failures")

// recordsNothing is the FailureRecorder of a store without one.
type recordsNothing struct{}

func (recordsNothing) RecordFailure(context.Context, string, Lease, Message, error) error {
	return errNotRecorded
}

// deleteOnly is the BatchAdvancer of a store without one: it deletes and
// reads nothing ahead, so the bucket's next batch is read by NextBatch.
type deleteOnly struct{ store Store }

func (d deleteOnly) MarkPublishedNext(ctx context.Context, relayID string, lease Lease, msgs []Message, _ int) ([]Message, error) {
	return nil, d.store.MarkPublished(ctx, relayID, lease, msgs)
}

// backoffAlways is the failure policy without a FailureHandler: every
// failed message is retried after the bucket's backoff.
type backoffAlways struct{}

func (backoffAlways) HandleFailure(context.Context, Failure) (FailureAction, error) {
	return FailureBackoff, nil
}

// keepAll is the BatchFilter of a failure handler without one.
type keepAll struct{}

func (keepAll) FilterBatch(_ context.Context, _ string, _ Lease, msgs []Message) ([]Message, error) {
	return msgs, nil
}

// pacer paces publishes (Config.RateLimit); *rate.Limiter is one.
type pacer interface {
	// WaitN blocks until n messages may be published, or ctx ends.
	WaitN(ctx context.Context, n int) error
	// Burst is the largest batch the pace allows at once.
	Burst() int
}

// unpaced is the pacer without Config.RateLimit.
type unpaced struct{}

func (unpaced) WaitN(context.Context, int) error { return nil }
func (unpaced) Burst() int                       { return math.MaxInt }

// noHints is the Hints of a relay without Config.Hints: it never wakes
// the relay, which finds rows by discovery alone.
type noHints struct{}

func (noHints) Ready() <-chan struct{}       { return nil }
func (noHints) Take(dst []int) ([]int, bool) { return dst, false }
