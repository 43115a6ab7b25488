package publisher

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/relay"
)

// FranzConfig configures a Franz publisher. Its zero value is usable
// except for Brokers, which is required.
type FranzConfig struct {
	// Brokers are the bootstrap broker addresses, "host:port". Required.
	Brokers []string

	// Options are franz-go client options, applied after the publisher's
	// defaults and before what its guarantees depend on: TLS
	// (kgo.DialTLSConfig), SASL, client id, timeouts, retries
	// (kgo.RecordRetries, kgo.RetryBackoffFn), linger (kgo.ProducerLinger),
	// compression. The publisher's defaults are kgo.ClientID(ClientIDDefault),
	// kgo.RecordRetries(RetryMaxDefault) and
	// kgo.RecordDeliveryTimeout(StallTimeoutDefault), so that a publish
	// during an outage fails and the relay backs off, as with the Kafka
	// publisher, no compression (sarama's default; kgo's is snappy) and no
	// linger (kgo.ProducerLinger(0): a partition's records go out as soon
	// as a request can, gathering while requests are in flight, where
	// kgo's default waits 10ms); kgo's own defaults otherwise.
	//
	// After them the publisher sets acks=all, its partitioner (the same
	// key → partition mapping as the Kafka publisher: see KeyPartition),
	// the seed brokers and kgo.ProducerBatchMaxBytes from MaxMessageBytes.
	// Options that break its guarantees are refused by NewFranz with a
	// *relay.ConfigError: kgo.DisableIdempotentWrite,
	// kgo.AllowIdempotentProduceCancellation, kgo.TransactionalID and
	// kgo.ManualFlushing.
	Options []kgo.Opt

	// MessageIDHeader is the record header that carries
	// relay.Message.MessageID, as KafkaConfig.MessageIDHeader. Default
	// MessageIDHeaderDefault.
	MessageIDHeader string

	// MaxMessageBytes is the largest record, counted as the Kafka publisher
	// counts it (KafkaConfig.MaxMessageBytes): a larger one fails before it
	// is sent with an error for which IsTooLarge and relay.IsPermanent
	// report true. It also caps one partition's record batch in a produce
	// request (plus the batch's own overhead). Default
	// MaxMessageBytesDefault; it must be below sarama.MaxRequestSize.
	MaxMessageBytes int

	// StallTimeout is how long a Send's messages handed to the producer
	// may go without a single result before the publisher replaces the
	// client with a new one (a new producer id), which fails every
	// message the old one held: the waits return them unavailable and
	// the relay republishes them (a duplicate at worst). franz-go's
	// idempotent producer never fails a record whose outcome it cannot
	// know (the broker answered REQUEST_TIMED_OUT or
	// NOT_ENOUGH_REPLICAS_AFTER_APPEND, so it may have written it): it
	// retries it without end, past its retries and delivery timeout,
	// and the messages of its key wait behind it. The client is also
	// replaced when a partition's messages have failed unavailable, none
	// acknowledged, for StallTimeout: franz-go keeps producing on its
	// connection to a broker that answers NOT_LEADER_FOR_PARTITION naming
	// itself as the leader (a broker removed from the cluster keeps its
	// connections), where a new client connects afresh. The first bound
	// also ends a Stop's flush that makes no progress. Default
	// FranzStallTimeoutDefault.
	StallTimeout time.Duration

	// Observer, if set, is told of every client replacement, with reason
	// ReplaceStalled (both causes above), as the Kafka publisher tells
	// KafkaConfig.Observer. *metrics.Collector implements it:
	// outbox_publisher_producer_replacements_total{reason="stalled"}.
	// Default: none.
	Observer ProducerObserver

	// Logger receives the publisher's logs: Debug for failed publishes and
	// lifecycle, Warn for client replacements. Default slog.Default().
	// Payloads are never logged.
	Logger *slog.Logger
}

// FranzStallTimeoutDefault is FranzConfig.StallTimeout's default: above
// franz-go's delivery timeout (StallTimeoutDefault, 30s), so that franz-go
// fails what it can fail first, and below relay.PublishTimeoutDefault.
const FranzStallTimeoutDefault = 45 * time.Second

// WithDefaults returns a copy of c with every unset field set to its
// default.
func (c FranzConfig) WithDefaults() FranzConfig {
	if c.MessageIDHeader == "" {
		c.MessageIDHeader = MessageIDHeaderDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = FranzStallTimeoutDefault
	}
	return c
}

// recordBatchOverhead is the size of a Kafka record batch's header
// (format v2): what one partition's batch adds to its records.
const recordBatchOverhead = 61

// opts is the franz-go client options: defaults, the user's, then the
// enforced ones.
func (c FranzConfig) opts() []kgo.Opt {
	opts := []kgo.Opt{
		kgo.ClientID(ClientIDDefault),
		kgo.RecordRetries(RetryMaxDefault),
		kgo.RecordDeliveryTimeout(StallTimeoutDefault),
		kgo.ProducerBatchCompression(kgo.NoCompression()),
		kgo.ProducerLinger(0),
	}
	opts = append(opts, c.Options...)
	return append(opts,
		kgo.SeedBrokers(c.Brokers...),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordPartitioner(franzPartitioner{}),
		kgo.ProducerBatchMaxBytes(int32(c.MaxMessageBytes+recordBatchOverhead)),
	)
}

func (c FranzConfig) validate() error {
	if err := checkBrokers("FranzConfig", c.Brokers); err != nil {
		return err
	}
	if err := checkMaxMessageBytes("FranzConfig", c.MaxMessageBytes); err != nil {
		return err
	}
	if c.StallTimeout < 0 {
		return configError("FranzConfig.StallTimeout", c.StallTimeout, "must be positive", nil)
	}
	// The options are opaque: build a client (it connects to nothing until
	// used) to read them back, and close it.
	cl, err := kgo.NewClient(c.opts()...)
	if err != nil {
		return configError("FranzConfig.Options", "[]kgo.Opt", "franz-go refuses them", err)
	}
	defer cl.Close()
	for _, o := range []struct {
		opt  any
		name string
	}{
		{kgo.DisableIdempotentWrite, "kgo.DisableIdempotentWrite"},
		{kgo.AllowIdempotentProduceCancellation, "kgo.AllowIdempotentProduceCancellation"},
		{kgo.ManualFlushing, "kgo.ManualFlushing"},
	} {
		if on, _ := cl.OptValue(o.opt).(bool); on {
			return configError("FranzConfig.Options", "[]kgo.Opt", "sets "+o.name+", which breaks the publisher's guarantees (idempotent writes, every message sent)", nil)
		}
	}
	if vs := cl.OptValues(kgo.TransactionalID); len(vs) == 2 && vs[1] == true {
		return configError("FranzConfig.Options", "[]kgo.Opt", "sets kgo.TransactionalID: the Franz publisher is not transactional", nil)
	}
	return nil
}

// Franz publishes batches to Kafka through one franz-go (kgo) client, an
// idempotent producer with up to five produce requests in flight per
// broker, so that the batches of one bucket can overlap in flight (see
// Send). It keeps the Kafka publisher's guarantees: acks=all, the same
// key → partition mapping, the same headers, the same typed errors, and
// per-key order (see Send for what holds across a failure). It implements
// relay.Publisher, relay.ReadyChecker, relay.SinkProber and
// relay.PublisherService, and is safe for concurrent use.
type Franz struct {
	lifecycle lifecycle
	brokers   []string
	opts      []kgo.Opt
	idHeader  string
	maxBytes  int
	logger    *slog.Logger
	observer  ProducerObserver
	unknown   unknownTopics
	stall     time.Duration

	replacements atomic.Int64

	// newMu serialises kgo.NewClient over opts: franz-go writes to an
	// option's slice while it validates the options (the compression
	// codecs, deduplicated in place), so two clients built at once from
	// the same options race (the watchdog's replacement and ProbeSink).
	newMu sync.Mutex

	mu      sync.Mutex
	closed  bool
	cl      *franzClient   // once started
	senders sync.WaitGroup // Send calls and held messages producing to cl
	retired sync.WaitGroup // a connect in progress, the watchdog
	unwatch chan struct{}  // closed to end the watchdog

	// tmu guards tails, live, every franzSend's pending and last, and
	// every franzRec's reported and waiter.
	tmu sync.Mutex
	// tails is the last message of each key (for keyless messages, each
	// pinned partition) handed to the producer and not reported yet.
	tails map[franzKey]*franzRec
	// live is the Sends with messages not reported yet.
	live map[*franzSend]struct{}
	// failing is, for each partition whose messages failed unavailable
	// since its last acknowledgement, when the first of them failed.
	failing map[franzPart]time.Time
}

// franzPart is a partition of a topic.
type franzPart struct {
	topic     string
	partition int32
}

// franzClient is a kgo client of the publisher; replaced is set when the
// publisher replaced it (see FranzConfig.StallTimeout), so that the
// failures its close reports are unavailable rather than closed.
type franzClient struct {
	cl       *kgo.Client
	replaced atomic.Bool
}

var (
	_ relay.Publisher        = (*Franz)(nil)
	_ relay.ReadyChecker     = (*Franz)(nil)
	_ relay.SinkProber       = (*Franz)(nil)
	_ relay.PublisherService = (*Franz)(nil)
	_ relay.Pipeliner        = (*Franz)(nil)
)

var errFranzNotStarted = notStarted("Franz publisher")

// NewFranz checks cfg and returns the publisher. It opens no connection:
// Start connects. It fails, with a *relay.ConfigError, only if the
// configuration is invalid.
func NewFranz(cfg FranzConfig) (*Franz, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Franz{
		lifecycle: newLifecycle(),
		brokers:   slices.Clone(cfg.Brokers),
		opts:      cfg.opts(),
		idHeader:  cfg.MessageIDHeader,
		maxBytes:  cfg.MaxMessageBytes,
		logger:    cfg.Logger.With(slog.String("component", "outbox_publisher")),
		observer:  cfg.Observer,
		stall:     cfg.StallTimeout,
		tails:     make(map[franzKey]*franzRec),
		live:      make(map[*franzSend]struct{}),
		failing:   make(map[franzPart]time.Time),
	}, nil
}

// Start connects to the cluster and initialises the producer id, bounded
// by ctx: franz-go retries the brokers until one answers, so with none
// answering Start returns ctx's error when ctx ends. The lifecycle is
// Kafka.Start's: a failed Start may be retried, the end of ctx closes a
// started publisher, Start after Stop fails with ErrStopped, Publish and
// Send before Start fail with ErrNotStarted.
func (f *Franz) Start(ctx context.Context) error {
	return f.lifecycle.start(ctx, f.connect, f.shut)
}

// Stop closes the publisher, bounded by ctx, as Kafka.Stop does: Publish
// and Send fail with ErrClosed from the moment it is called; the messages
// already handed over, held ones included, are produced and flushed.
func (f *Franz) Stop(ctx context.Context) error { return f.lifecycle.stop(ctx, f.seal) }

// Close stops the publisher as Stop does, without a deadline.
func (f *Franz) Close() error { return f.Stop(context.Background()) }

// Stopped returns a channel closed when a started publisher has stopped.
func (f *Franz) Stopped() <-chan struct{} { return f.lifecycle.life.Stopped() }

// Err returns the error its close returned, once a started publisher has
// stopped; nil otherwise.
func (f *Franz) Err() error { return f.lifecycle.life.Err() }

// connect builds the client and has it initialise a producer id, and
// starts the watchdog that replaces a stalled client.
func (f *Franz) connect(ctx context.Context) error {
	err := connect(ctx, guard{&f.mu, &f.closed, &f.retired},
		func() (*kgo.Client, error) {
			cl, err := f.newClient()
			if err != nil {
				return nil, fmt.Errorf("publisher: start Kafka client: %w", err)
			}
			if _, _, err := cl.ProducerID(ctx); err != nil {
				cl.Close()
				return nil, fmt.Errorf("publisher: start Kafka client: initialise the producer id: %w", err)
			}
			return cl, nil
		},
		func(cl *kgo.Client) {
			f.cl = &franzClient{cl: cl}
			f.unwatch = make(chan struct{})
			f.retired.Add(1)
			go f.watch(f.unwatch)
		},
		func(cl *kgo.Client) { cl.Close() })
	if err == nil {
		f.logger.Debug("franz publisher started", slog.Any("brokers", f.brokers))
	}
	return err
}

// newClient builds a client from the publisher's options and extra,
// which override them. It connects to nothing until the client is used.
func (f *Franz) newClient(extra ...kgo.Opt) (*kgo.Client, error) {
	f.newMu.Lock()
	defer f.newMu.Unlock()
	return kgo.NewClient(append(slices.Clip(f.opts), extra...)...)
}

// Replacements returns how many times the publisher replaced its client
// after StallTimeout without a result (see FranzConfig.StallTimeout).
func (f *Franz) Replacements() int64 { return f.replacements.Load() }

// watch replaces the client whenever stalled reports a Send without a
// result, or a partition without an acknowledgement, for StallTimeout,
// until done is closed. It is counted in f.retired.
func (f *Franz) watch(done <-chan struct{}) {
	defer f.retired.Done()
	tick := time.NewTicker(max(f.stall/8, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		if f.stalled(time.Now(), true) {
			f.replace(done)
		}
	}
}

// stalled reports whether, as of now, a Send has had messages handed
// over and no result for StallTimeout, or, if failing is set, a partition
// has had its messages fail unavailable, none acknowledged, for
// StallTimeout. The second is for a client that keeps producing on a
// connection to a broker that no longer leads the partition (a broker
// removed from the cluster keeps its connections; franz-go retries on
// the one it has while the answer names the same node as the leader): a
// new client connects afresh.
func (f *Franz) stalled(now time.Time, failing bool) bool {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	for s := range f.live {
		if now.Sub(s.last) >= f.stall {
			return true
		}
	}
	if failing {
		for _, since := range f.failing {
			if now.Sub(since) >= f.stall {
				return true
			}
		}
	}
	return false
}

// replace installs a new client and closes the stalled one, which fails
// every message it held (unavailable: see franzError); the messages held
// behind them fail unwritten, so no key goes out of order, and the relay
// republishes them through the new client. Unless the publisher closed
// meanwhile (done): then the close ends the old client.
func (f *Franz) replace(done <-chan struct{}) {
	cl, err := f.newClient()
	if err != nil { // the options were accepted once: not expected
		f.logger.Warn("franz publisher: cannot replace a stalled client", slog.Any("error", err))
		return
	}
	f.mu.Lock()
	select {
	case <-done:
		f.mu.Unlock()
		cl.Close()
		return
	default:
	}
	old := f.cl
	f.cl = &franzClient{cl: cl}
	old.replaced.Store(true)
	f.mu.Unlock()
	n := f.replacements.Add(1)
	if f.observer != nil {
		f.observer.ProducerReplaced(ReplaceStalled)
	}
	f.logger.Warn("franz publisher: replacing the kafka client: messages without a result, or a partition without an acknowledgement, for the stall timeout",
		slog.Duration("stall_timeout", f.stall), slog.Int64("replacements", n))
	old.cl.Close()
	f.restartClocks()
}

// restartClocks restarts every live Send's stall clock: after a
// replacement, the results of the old client's messages are on their way.
func (f *Franz) restartClocks() {
	now := time.Now()
	f.tmu.Lock()
	defer f.tmu.Unlock()
	for s := range f.live {
		s.last = now
	}
	clear(f.failing)
}

// shut closes the client; see Close.
func (f *Franz) shut() error { return f.seal()() }

// seal refuses new batches and returns the rest of the close: waiting for
// the sends and held messages to be handed to the client, flushing it,
// closing it. Order matters: a held message is produced once its
// predecessor is reported, which needs the client running.
func (f *Franz) seal() (finish func() error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return func() error {
			f.retired.Wait()
			return nil
		}
	}
	f.closed = true
	if f.unwatch != nil {
		close(f.unwatch)
	}
	f.retired.Add(1)
	return func() error {
		defer f.retired.Done()
		// The watchdog is gone: a replacement installs no client now.
		f.mu.Lock()
		fc := f.cl
		f.mu.Unlock()
		if fc == nil {
			f.senders.Wait()
			return nil
		}
		err := f.flush(fc.cl)
		f.senders.Wait()
		if err != nil {
			return err
		}
		f.logger.Debug("franz publisher closed")
		return nil
	}
}

// flush waits for the sends and held messages to be handed to cl and for
// cl to report every message, then closes cl. If StallTimeout passes
// without a result (see stalled) it closes cl at once, which fails the
// messages left, and returns an error.
func (f *Franz) flush(cl *kgo.Client) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		f.senders.Wait()
		done <- cl.Flush(ctx)
	}()
	tick := time.NewTicker(max(f.stall/8, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			cl.Close()
			if err != nil {
				return fmt.Errorf("publisher: flush: %w", err)
			}
			return nil
		case now := <-tick.C:
			if !f.stalled(now, false) {
				continue
			}
			// Closing cl fails its messages, which releases the held
			// ones (they fail unwritten) and ends Flush.
			cancel()
			cl.Close()
			<-done
			return fmt.Errorf("publisher: flush: messages without a result for the stall timeout (%s) failed", f.stall)
		}
	}
}

// CheckReady implements relay.ReadyChecker as Kafka.CheckReady does.
func (f *Franz) CheckReady(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case f.closed:
		return closedAtStart("Franz publisher")
	case f.cl == nil:
		return errFranzNotStarted
	}
	return nil
}

// ProbeSink implements relay.SinkProber: it opens a new client to each of
// FranzConfig.Brokers in turn (with FranzConfig.Options: TLS, SASL) and
// returns nil at the first broker that answers an ApiVersions request. It
// shares nothing with the producing client, works before Start and after
// Stop, and logs no failure. Unlike the Kafka publisher it replaces
// nothing when the brokers come back: franz-go has no circuit breakers
// and reconnects on its own.
func (f *Franz) ProbeSink(ctx context.Context) error {
	return probeEach(ctx, f.brokers, func(addr string) error {
		cl, err := f.newClient(kgo.SeedBrokers(addr), kgo.RequestRetries(0))
		if err != nil {
			return err
		}
		defer cl.Close()
		_, err = cl.Request(ctx, kmsg.NewPtrApiVersionsRequest())
		return err
	})
}

// franzKey names a chain of messages kept in order: a key of a topic, or
// for keyless messages a pinned partition of a topic.
type franzKey struct {
	topic     string
	key       string
	partition int32 // -1 for a keyed message
}

// franzRec is one message handed to the producer: the kgo record and what
// the order gate needs. It is the record's Context, so that the
// partitioner and the promise find it.
type franzRec struct {
	rec    kgo.Record
	send   *franzSend
	client *franzClient // the client it was handed to, nil if none
	index  int
	pinned bool
	key    franzKey
	keyed  bool // key is set: the message is in a chain

	// prev is the previous message of the chain not known to be
	// acknowledged when this one was handed over, nil if none.
	prev *franzRec

	failed   atomic.Bool // reported failed, or the gate held it back
	badPart  atomic.Bool // pinned to a partition the topic does not have
	reported bool        // guarded by Franz.tmu
	waiter   *franzHold  // guarded by Franz.tmu: the held messages produced once this one is reported
}

// franzRec is a context.Context for kgo.Record.Context that never ends.
func (*franzRec) Deadline() (time.Time, bool) { return time.Time{}, false }
func (*franzRec) Done() <-chan struct{}       { return nil }
func (*franzRec) Err() error                  { return nil }
func (*franzRec) Value(any) any               { return nil }

// franzSend is one Send call's messages and their results.
type franzSend struct {
	results chan result // room for one result per message handed over

	// Guarded by Franz.tmu: the messages handed over and not reported
	// (held ones included), and when the last was reported, a held one
	// released, or the Send made, whichever is latest (see stalled).
	pending int
	last    time.Time

	// Guarded by Franz.tmu: wait returned; the send's failed messages
	// that were chain tails when they were reported, kept in tails until
	// wait returns so that a later Send's message of their key fails
	// unwritten.
	waited      bool
	failedTails []*franzRec
}

// franzHold is messages of one chain in a Send whose predecessor, from
// an earlier Send, was not reported when they were handed over: they are
// produced, in order, once it is, or fail unwritten if it failed.
type franzHold struct {
	recs []*franzRec
}

// errHeldBehind fails a message whose chain's previous message (same key)
// failed: writing it would put the key out of order.
var errHeldBehind = relay.Unavailable(errors.New("held back: an earlier message of its key was not written"))

// Publish sends msgs to Kafka, all at once, and waits until the producer
// reported every one of them, as Kafka.Publish does: it returns how many
// leading messages the brokers acknowledged (acks=all) and, if fewer than
// len(msgs), a *Error for the first one that was not. It is Send followed
// by its wait.
func (f *Franz) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	return f.Send(ctx, msgs)()
}

// Send hands msgs (one bucket's batch) to the producer behind every batch
// sent before it and returns without waiting for acknowledgements; wait,
// called exactly once, blocks until every message handed over is reported
// (or ctx ends) and returns what Publish returns. It implements the
// relay's Pipeliner.
//
// Within one Send the messages go out in order at once, as Publish's do.
// Across Sends a key stays in order by construction: a message whose key
// (for a keyless message, its pinned partition) has a message of an
// earlier Send not yet reported waits, unwritten, until that one is
// acknowledged, then goes out; if that one failed, it fails unwritten
// (relay.Unavailable), and so does every message of the key handed over
// before the failed Send's wait returned (the relay republishes them after
// the failed one). wait must be called: until it returns, a failed message
// of its Send holds its key's later messages back.
//
// Within one Send, a message whose predecessor of the same key was
// reported failed before the message was handed to the producer fails
// unwritten too. franz-go fails every record buffered for a partition
// when one of its batches fails for good, then writes later records under
// a new producer epoch; what remains open is a message handed to the
// producer after franz-go failed its predecessor and before the failure
// reached the publisher (franz-go reports failures on a goroutine of its
// own): it may be written after the failed one, out of order. The
// producer hands a Send's messages over in one loop, so the window is the
// rest of that loop after a failed produce request's answer; a new
// producer epoch must be initialised (a round trip) before such a message
// can be written.
func (f *Franz) Send(ctx context.Context, msgs []relay.Message) (wait func() (int, error)) {
	f.mu.Lock()
	switch {
	case f.closed:
		f.mu.Unlock()
		return func() (int, error) { return 0, errClosed }
	case f.cl == nil:
		f.mu.Unlock()
		return func() (int, error) { return 0, errFranzNotStarted }
	}
	cl := f.cl
	f.senders.Add(1)
	f.mu.Unlock()

	s, sent, stop := f.send(ctx, cl, msgs)
	rep := reporter{logger: f.logger, unknown: &f.unknown, idHeader: []byte(f.idHeader), maxBytes: f.maxBytes}
	return func() (int, error) {
		if sent == 0 {
			return 0, stop
		}
		acked, err := rep.collect(ctx, msgs, s.results, sent, stop)
		f.waited(s)
		return acked, err
	}
}

// waited forgets the failed messages of s as chain tails: its wait
// returned, so the relay knows of the failure, and the batches it sends
// from now on republish them. A message of s reported later leaves
// tails when it is.
func (f *Franz) waited(s *franzSend) {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	s.waited = true
	for _, r := range s.failedTails {
		if f.tails[r.key] == r {
			delete(f.tails, r.key)
		}
	}
	s.failedTails = nil
}

// send hands msgs to the producer: first, under tmu, it checks them, up to
// the first that cannot be sent, and links each into its chain; then it
// produces the ones not held and registers the held ones with the message
// they wait for. It returns how many it handed over and why it stopped
// before msgs[sent] (nil if it did not). f.senders was added to.
func (f *Franz) send(ctx context.Context, cl *franzClient, msgs []relay.Message) (s *franzSend, sent int, stop error) {
	defer f.senders.Done()
	if len(msgs) == 0 {
		return nil, 0, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	n := len(msgs)
	nHeaders := 0
	for i := range msgs {
		nHeaders += len(msgs[i].Headers) + 1
	}
	s = &franzSend{results: make(chan result, n)}
	recs := make([]franzRec, n)
	headers := make([]kgo.RecordHeader, 0, nHeaders)
	var holds map[franzKey]*franzHold
	held := make([]bool, n)

	f.tmu.Lock()
	for i := range msgs {
		m := &msgs[i]
		if err := f.check(i, m); err != nil {
			stop = err
			break
		}
		r := &recs[i]
		r.send, r.index = s, i
		r.rec = kgo.Record{Topic: m.Topic, Key: m.Key, Value: m.Value, Partition: -1, Context: r}
		if m.Partition != nil {
			r.pinned, r.rec.Partition = true, *m.Partition
		}
		start := len(headers)
		for _, h := range m.Headers {
			headers = append(headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		if m.MessageID != "" {
			headers = append(headers, kgo.RecordHeader{Key: f.idHeader, Value: []byte(m.MessageID)})
		}
		r.rec.Headers = headers[start:len(headers):len(headers)]
		sent = i + 1

		switch {
		case m.Key != nil:
			r.key, r.keyed = franzKey{topic: m.Topic, key: string(m.Key), partition: -1}, true
		case r.pinned:
			r.key, r.keyed = franzKey{topic: m.Topic, partition: r.rec.Partition}, true
		default:
			continue
		}
		prev := f.tails[r.key]
		f.tails[r.key] = r
		if prev == nil {
			continue
		}
		r.prev = prev
		switch {
		case prev.send == s:
			if h := holds[r.key]; h != nil && held[prev.index] {
				h.recs = append(h.recs, r)
				held[i] = true
			}
		case !prev.reported:
			if holds == nil {
				holds = make(map[franzKey]*franzHold)
			}
			h := &franzHold{recs: []*franzRec{r}}
			holds[r.key] = h
			prev.waiter = h
			held[i] = true
			f.senders.Add(1) // the hold's produce; see release
		}
		// Otherwise prev failed (an acknowledged message leaves tails)
		// and its Send's wait has not returned: produce fails r.
	}
	if sent > 0 {
		s.pending, s.last = sent, time.Now()
		f.live[s] = struct{}{}
	}
	f.tmu.Unlock()

	for i := range sent {
		if !held[i] {
			f.produce(cl, &recs[i])
		}
	}
	return s, sent, stop
}

// check rejects, with the Kafka publisher's errors, what no broker would
// accept or what is larger than MaxMessageBytes, before it is sent.
func (f *Franz) check(i int, m *relay.Message) error {
	if err := checkMessage(m); err != nil {
		return newError(i, m, err)
	}
	size := recordSize(m, len(f.idHeader))
	if size <= f.maxBytes {
		return nil
	}
	ce := sarama.ConfigurationError(fmt.Sprintf("Attempt to produce message larger than configured Producer.MaxMessageBytes: %d > %d", size, f.maxBytes))
	e := newError(i, m, classify(ce))
	e.Size, e.Limit = size, f.maxBytes
	return e
}

// recordSize is recordBytes(m, idHeader) for an idHeader of idHeaderLen
// bytes, computed without building the record: sarama's
// ProducerMessage.ByteSize for record format v2.
func recordSize(m *relay.Message, idHeaderLen int) int {
	const (
		recordOverhead = 5*binary.MaxVarintLen32 + binary.MaxVarintLen64 + 1
		headerOverhead = 2 * binary.MaxVarintLen32
	)
	size := recordOverhead + len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		size += len(h.Key) + len(h.Value) + headerOverhead
	}
	if m.MessageID != "" {
		size += idHeaderLen + len(m.MessageID) + headerOverhead
	}
	return size
}

// produce hands r to the client, unless its chain's previous message
// failed: then r fails unwritten.
func (f *Franz) produce(cl *franzClient, r *franzRec) {
	if p := r.prev; p != nil && p.failed.Load() {
		r.failed.Store(true)
		f.report(r, errHeldBehind)
		return
	}
	r.client = cl
	cl.cl.Produce(context.Background(), &r.rec, f.promise)
}

// promise receives kgo's report of a record.
func (f *Franz) promise(rec *kgo.Record, err error) {
	r, ok := rec.Context.(*franzRec)
	if !ok {
		f.logger.Warn("kafka client returned a record the publisher did not send", slog.String("topic", rec.Topic))
		return
	}
	if err != nil {
		r.failed.Store(true)
	}
	f.report(r, err)
}

// report delivers r's result and releases the messages held behind it.
func (f *Franz) report(r *franzRec, err error) {
	part := r.rec.Partition
	if err != nil {
		err = franzError(r, err)
		if errors.Is(err, errHeldBehind) || errors.Is(err, sarama.ErrUnknownTopicOrPartition) || r.badPart.Load() {
			part = -1
		}
	}
	if r.pinned {
		part = r.rec.Partition
	}
	var h *franzHold
	now := time.Now()
	f.tmu.Lock()
	s := r.send
	s.pending--
	s.last = now
	if s.pending == 0 {
		delete(f.live, s)
	}
	// A partition's failures count from the first one after an
	// acknowledgement; not those of messages held back unwritten, nor
	// those a replacement's close reports.
	if part >= 0 && (err == nil || !errors.Is(err, errHeldBehind) && !r.client.replaced.Load()) {
		tp := franzPart{r.rec.Topic, part}
		switch _, ok := f.failing[tp]; {
		case err == nil:
			delete(f.failing, tp)
		case !ok && isUnavailable(err):
			f.failing[tp] = now
		}
	}
	if r.keyed {
		r.reported = true
		h, r.waiter = r.waiter, nil
		if f.tails[r.key] == r {
			if err == nil || r.send.waited {
				delete(f.tails, r.key)
			} else {
				r.send.failedTails = append(r.send.failedTails, r)
			}
		}
	}
	f.tmu.Unlock()
	r.send.results <- result{index: r.index, err: err, partition: part}
	if h != nil {
		go f.release(h)
	}
}

// release produces the messages of h, in order, now that the message they
// waited for is reported: each fails unwritten if its predecessor failed.
// A hold was counted in f.senders when it was made.
func (f *Franz) release(h *franzHold) {
	defer f.senders.Done()
	f.mu.Lock()
	cl := f.cl
	f.mu.Unlock()
	now := time.Now()
	f.tmu.Lock()
	for _, r := range h.recs {
		r.send.last = now
	}
	f.tmu.Unlock()
	for _, r := range h.recs {
		f.produce(cl, r)
	}
}

// franzError makes a franz-go error match the Kafka publisher's
// classification (errors.go): a broker error also matches sarama's error
// of the same code, and franz-go's own errors are marked unavailable when
// they are not about the message.
func franzError(r *franzRec, err error) error {
	if r.badPart.Load() {
		return fmt.Errorf("%w: %d: %w", sarama.ErrInvalidPartition, r.rec.Partition, err)
	}
	var ke *kerr.Error
	if errors.As(err, &ke) {
		return fmt.Errorf("%w: %w", sarama.KError(ke.Code), err)
	}
	switch {
	case errors.Is(err, kgo.ErrClientClosed) && r.client != nil && r.client.replaced.Load():
		return relay.Unavailable(fmt.Errorf("publisher: kafka client replaced after no result for the stall timeout: %w", err))
	case errors.Is(err, kgo.ErrClientClosed):
		return fmt.Errorf("%w: %w", ErrClosed, err)
	case errors.Is(err, kgo.ErrRecordTimeout), errors.Is(err, kgo.ErrRecordRetries), errors.Is(err, kgo.ErrMaxBuffered):
		return relay.Unavailable(err)
	}
	return err
}

// franzPartitioner is the kgo partitioner with the Kafka publisher's
// mapping (see partitioner): a pinned message goes to its partition, a
// keyed one to KeyPartition(key), a keyless one to a random partition
// among those with a leader.
type franzPartitioner struct{}

func (franzPartitioner) ForTopic(string) kgo.TopicPartitioner { return franzTopicPartitioner{} }

type franzTopicPartitioner struct{}

// RequiresConsistency reports true for keyed and pinned records: they
// are placed among all partitions, even those without a leader now.
func (franzTopicPartitioner) RequiresConsistency(r *kgo.Record) bool {
	return r.Key != nil || r.Partition >= 0
}

func (franzTopicPartitioner) Partition(r *kgo.Record, n int) int {
	if r.Partition >= 0 { // pinned: Send sets -1 otherwise
		if int(r.Partition) >= n {
			if fr, ok := r.Context.(*franzRec); ok {
				fr.badPart.Store(true)
			}
		}
		return int(r.Partition)
	}
	if r.Key != nil {
		return int(KeyPartition(r.Key, int32(n)))
	}
	return rand.IntN(n)
}
