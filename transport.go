package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorm-outbox/outbox/internal/backoff"
	"github.com/gorm-outbox/outbox/internal/bucketset"
	"github.com/gorm-outbox/outbox/internal/startstop"
)

// UnknownBucket is the bucket id that stands for "messages were committed,
// but in buckets nobody named". A relay that receives it runs a discovery
// query over the buckets it owns instead of reading named buckets directly.
const UnknownBucket = -1

// Transport carries commit hints between processes, so that a commit in one
// process wakes the relay that owns the bucket in another at once instead
// of at its next poll. It carries bucket ids only, never messages.
//
// Hints are advisory. A transport may lose, duplicate, delay or reorder
// them; that costs latency, never messages, because every relay keeps
// polling. A transport therefore needs no acknowledgements, no persistence
// and no ordering.
//
// One Transport value serves one HintBridge. Publish and Listen run
// concurrently on it. pgnotify.Transport is the bundled implementation over
// PostgreSQL LISTEN/NOTIFY.
type Transport interface {
	// Publish broadcasts bucket ids that received committed messages to
	// every listener of the transport, in every process. Each id is a
	// bucket (0 to BucketCountMax-1) or UnknownBucket. The HintBridge calls
	// it from one goroutine, never on a committing goroutine, with the
	// bucket ids coalesced since the previous call; the slice is reused
	// afterwards, so Publish must not keep it. It must return when ctx is
	// done. An error means the hints were not sent: the bridge drops them
	// and backs off before sending again.
	Publish(ctx context.Context, buckets []int) error

	// Listen subscribes to the broadcasts and calls fn once for every
	// received id, UnknownBucket and buckets owned by other relays
	// included (the relay ignores buckets it does not own), until ctx is
	// done. Every process needs a subscription of its own that receives
	// every broadcast: a competing-consumer queue would hand a hint to a
	// relay that does not own its bucket.
	//
	// Listen should reconnect by itself. If it returns before ctx is done,
	// with an error or without, the HintBridge calls it again after a
	// backoff, so it must release its subscription before returning. It
	// must not return before every fn call it made has returned. fn is
	// cheap and does not block; Listen calls it from one goroutine at a
	// time.
	//
	// Listen should skip the broadcasts its own Publish sent (the local
	// relay had those hints directly), and should call fn(UnknownBucket)
	// each time a subscription becomes active, so that relays look for
	// commits whose hints were missed while there was none.
	Listen(ctx context.Context, fn func(bucket int)) error
}

// Defaults applied by HintBridgeConfig.WithDefaults.
const (
	// HintBackoffMinDefault is the first pause after a failed send or an
	// ended subscription.
	HintBackoffMinDefault = 100 * time.Millisecond
	// HintBackoffMaxDefault caps the pause, which doubles with every
	// consecutive failure.
	HintBackoffMaxDefault = 10 * time.Second
	// HintPublishTimeoutDefault bounds one Transport.Publish call.
	HintPublishTimeoutDefault = 5 * time.Second
)

// HintBridgeConfig configures a HintBridge. The zero value is usable.
type HintBridgeConfig struct {
	// BackoffMin is the pause after a failed send, and before restarting a
	// subscription that ended. It doubles with each consecutive failure up
	// to BackoffMax, with jitter, and resets after a success. Default
	// 100ms.
	BackoffMin time.Duration
	// BackoffMax caps the pause. It must not be smaller than BackoffMin.
	// Default 10s. A subscription that lasted at least BackoffMax before it
	// ended counts as healthy: its restart starts again at BackoffMin.
	BackoffMax time.Duration
	// PublishTimeout bounds each Transport.Publish call. Default 5s.
	PublishTimeout time.Duration
	// SendOnly disables listening, for processes that commit messages but
	// run no relay: they need not hold a subscription. Default false.
	SendOnly bool
	// Logger receives the bridge's logs. Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its
// default.
func (c HintBridgeConfig) WithDefaults() HintBridgeConfig {
	if c.BackoffMin == 0 {
		c.BackoffMin = HintBackoffMinDefault
	}
	if c.BackoffMax == 0 {
		c.BackoffMax = max(HintBackoffMaxDefault, c.BackoffMin)
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = HintPublishTimeoutDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate checks a configuration that WithDefaults has filled in.
func (c HintBridgeConfig) Validate() error {
	switch {
	case c.BackoffMin < 0:
		return &ConfigError{Package: "outbox", Field: "BackoffMin", Value: c.BackoffMin, Reason: "must not be negative"}
	case c.BackoffMax < c.BackoffMin:
		return &ConfigError{Package: "outbox", Field: "BackoffMax", Value: c.BackoffMax, Reason: fmt.Sprintf("must be at least BackoffMin (%s)", c.BackoffMin)}
	case c.PublishTimeout < 0:
		return &ConfigError{Package: "outbox", Field: "PublishTimeout", Value: c.PublishTimeout, Reason: "must not be negative"}
	}
	return nil
}

// HintBridge connects a Notifier to a Transport. It sends the buckets of
// the process's own commits to the other processes, and feeds the hints
// they send into the notifier, which wakes the local relay.
//
// Sending: the notifier's subscription only sets bits in a bounded set of
// pending buckets (one bit per bucket, BucketCountMax bits) and signals one
// background goroutine, so a commit never waits for the network. That
// goroutine sends everything pending at once; commits that happen while a
// send is in flight are coalesced into the next one. There is no debounce
// delay. A failed send drops its hints (polling covers them) and pauses
// the sender with exponential backoff; hints that arrive during the pause
// are sent after it.
//
// Listening: a second goroutine runs Transport.Listen and hands each
// received id to Notifier.NotifyReceived, which wakes the relay but never
// passes the hint on, so nothing received is sent again. A subscription
// that fails or ends is restarted with backoff. Ownership filtering is the
// relay's: the bridge forwards every id.
//
// Run one bridge per notifier and transport. Its lifecycle is the one of
// every background service here: NewHintBridge starts nothing, Start
// backgrounds it, Stop is synchronous and bounded by its context,
// Stopped and Err report the end. Shutdown does not flush pending hints:
// they are advisory.
type HintBridge struct {
	cfg       HintBridgeConfig
	notifier  *Notifier
	transport Transport
	log       *slog.Logger
	life      startstop.Service
	startMu   sync.Mutex
	started   bool

	hints   *bucketset.Hints
	pending chan struct{} // 1-buffered: something is in hints

	sent, sendFailures, received, listenRestarts atomic.Uint64
}

// HintBridgeStats counts what a HintBridge did since it started.
type HintBridgeStats struct {
	// Sent counts successful Transport.Publish calls; each carries every
	// bucket pending when it began.
	Sent uint64
	// SendFailures counts failed Publish calls, whose hints were dropped.
	SendFailures uint64
	// Received counts ids received from the transport and handed to the
	// notifier.
	Received uint64
	// ListenRestarts counts subscriptions that ended before Stop and were
	// started again.
	ListenRestarts uint64
}

var errListenEnded = errors.New("outbox: hint transport: Listen returned before its context ended")

// NewHintBridge checks its arguments and returns a bridge between
// notifier and transport that is not running yet: Start runs it. Invalid
// configuration is reported as a *ConfigError.
//
//	bridge, err := outbox.NewHintBridge(plugin.Notifier(), transport, outbox.HintBridgeConfig{})
//	if err != nil { ... }
//	if err := bridge.Start(ctx); err != nil { ... }
//	defer bridge.Stop(shutdownCtx)
func NewHintBridge(notifier *Notifier, transport Transport, cfg HintBridgeConfig) (*HintBridge, error) {
	if notifier == nil {
		return nil, &ConfigError{Package: "outbox", Field: "notifier", Value: nil, Reason: "a *Notifier is required"}
	}
	if transport == nil {
		return nil, &ConfigError{Package: "outbox", Field: "transport", Value: nil, Reason: "a Transport is required"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &HintBridge{
		cfg:       cfg,
		notifier:  notifier,
		transport: transport,
		log:       cfg.Logger,
		hints:     bucketset.NewHints(BucketCountMax),
		pending:   make(chan struct{}, 1),
	}, nil
}

// StartHintBridge is NewHintBridge followed by Start.
func StartHintBridge(ctx context.Context, notifier *Notifier, transport Transport, cfg HintBridgeConfig) (*HintBridge, error) {
	b, err := NewHintBridge(notifier, transport, cfg)
	if err != nil {
		return nil, err
	}
	if err := b.Start(ctx); err != nil {
		return nil, err
	}
	return b, nil
}

// Start subscribes to the notifier's commits and starts the bridge's
// sender and listener in the background. It returns at once; Stop ends
// the bridge, and so does cancelling ctx. Start on a running bridge does
// nothing; on a stopped one it returns an error: a bridge runs once.
func (b *HintBridge) Start(ctx context.Context) error {
	b.startMu.Lock()
	defer b.startMu.Unlock()
	if b.started { // running: nothing to do; stopped: startstop.ErrStopped
		if err := b.life.Start(ctx, nil); err != nil {
			return fmt.Errorf("outbox: start hint bridge: %w", err)
		}
		return nil
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("outbox: start hint bridge: %w", err)
	}
	// Subscribed before Start returns, so no commit after it is missed.
	unsubscribe := b.notifier.Subscribe(b.add)
	if err := b.life.Start(ctx, func(ctx context.Context) error { return b.run(ctx, unsubscribe) }); err != nil {
		unsubscribe()
		return fmt.Errorf("outbox: start hint bridge: %w", err)
	}
	b.started = true
	b.log.Debug("outbox: hint bridge started", "send_only", b.cfg.SendOnly)
	return nil
}

// run is the bridge's lifetime: its sender and listener running until ctx
// ends, then unsubscribed from the notifier.
func (b *HintBridge) run(ctx context.Context, unsubscribe func()) error {
	var wg sync.WaitGroup
	wg.Go(func() { b.sendLoop(ctx) })
	if !b.cfg.SendOnly {
		wg.Go(func() { b.listenLoop(ctx) })
	}
	<-ctx.Done()
	unsubscribe()
	wg.Wait()
	b.log.Debug("outbox: hint bridge stopped")
	return nil
}

// Stop stops the bridge and waits until its goroutines have returned: it
// unsubscribes from the notifier, cancels the send and the subscription in
// flight and waits for them. Pending hints are dropped. If ctx ends first,
// Stop returns its error; the bridge still stops once the transport honours
// the cancellation (watch Stopped). Stop on a nil or never started bridge,
// and a second Stop, return nil.
func (b *HintBridge) Stop(ctx context.Context) error {
	if b == nil {
		return nil
	}
	if err := b.life.Stop(ctx); err != nil {
		return fmt.Errorf("outbox: hint bridge stop: %w", err)
	}
	return nil
}

// Stopped returns a channel closed when the bridge has stopped, by Stop or
// by the cancellation of its start context. It is never closed for a
// bridge that was never started.
func (b *HintBridge) Stopped() <-chan struct{} { return b.life.Stopped() }

// Err returns why the bridge stopped. The bridge retries every transport
// failure itself, so it is nil unless a future failure cannot be retried.
func (b *HintBridge) Err() error { return b.life.Err() }

// Stats returns the bridge's counters.
func (b *HintBridge) Stats() HintBridgeStats {
	return HintBridgeStats{
		Sent:           b.sent.Load(),
		SendFailures:   b.sendFailures.Load(),
		Received:       b.received.Load(),
		ListenRestarts: b.listenRestarts.Load(),
	}
}

// add is the notifier subscription. It runs on the committing goroutine:
// it only sets bits and signals the sender, never blocks.
func (b *HintBridge) add(buckets []int) {
	b.hints.Add(buckets)
	select {
	case b.pending <- struct{}{}:
	default:
	}
}

// take appends the pending ids to dst (UnknownBucket first if pending) and
// clears them.
func (b *HintBridge) take(dst []int) []int {
	n := len(dst)
	dst, unknown := b.hints.Take(dst)
	if unknown {
		dst = slices.Insert(dst, n, UnknownBucket)
	}
	return dst
}

func (b *HintBridge) sendLoop(ctx context.Context) {
	var (
		buf      []int
		failures int
	)
	for {
		select {
		case <-ctx.Done():
			return
		case <-b.pending:
		}
		buf = b.take(buf[:0])
		if len(buf) == 0 {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, b.cfg.PublishTimeout)
		err := b.transport.Publish(pctx, buf)
		cancel()
		if err == nil {
			failures = 0
			b.sent.Add(1)
			continue
		}
		if ctx.Err() != nil {
			return
		}
		failures++
		b.sendFailures.Add(1)
		d := hintBackoff(b.cfg, failures)
		b.log.Warn("outbox: hint bridge: publish failed, hints dropped",
			"err", err, "buckets", len(buf), "attempt", failures, "retry_in", d)
		if !sleepCtx(ctx, d) {
			return
		}
	}
}

func (b *HintBridge) listenLoop(ctx context.Context) {
	deliver := func(bucket int) {
		b.received.Add(1)
		b.notifier.NotifyReceived([]int{bucket})
	}
	failures := 0
	for {
		began := time.Now()
		err := b.transport.Listen(ctx, deliver)
		if ctx.Err() != nil {
			return
		}
		if time.Since(began) >= b.cfg.BackoffMax {
			failures = 0 // it was healthy for a while: not a crash loop
		}
		failures++
		b.listenRestarts.Add(1)
		if err == nil {
			err = errListenEnded
		}
		d := hintBackoff(b.cfg, failures)
		b.log.Warn("outbox: hint bridge: subscription ended, restarting",
			"err", err, "attempt", failures, "retry_in", d)
		if !sleepCtx(ctx, d) {
			return
		}
	}
}

// hintBackoff is BackoffMin doubled per failure after the first, capped at
// BackoffMax, with the upper half jittered (backoff.Exponential).
func hintBackoff(cfg HintBridgeConfig, failures int) time.Duration {
	return backoff.Exponential(cfg.BackoffMin, cfg.BackoffMax, failures)
}

// sleepCtx waits for d or ctx, and reports whether the full pause elapsed.
func sleepCtx(ctx context.Context, d time.Duration) bool { return backoff.Sleep(ctx, d) }
