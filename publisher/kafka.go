package publisher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

const (
	// MessageIDHeaderDefault is the record header the Kafka publisher stamps
	// with relay.Message.MessageID unless KafkaConfig.MessageIDHeader says
	// otherwise.
	MessageIDHeaderDefault = wire.KafkaMessageIDHeaderDefault

	// MaxMessageBytesDefault is KafkaConfig.MaxMessageBytes's default: just
	// under the broker's default message.max.bytes (1048588), so that sarama
	// rejects an oversized record on its own before the broker would fail
	// the whole batch it travels in. The write side refuses at enqueue what
	// this default would refuse (package wire holds both).
	MaxMessageBytesDefault = wire.KafkaMaxMessageBytesDefault

	// ClientIDDefault is the Kafka client id the publisher sets before
	// KafkaConfig.Configure runs, which may change it.
	ClientIDDefault = "gorm-outbox"

	// RetryMaxDefault is what the publisher raises sarama's
	// Producer.Retry.Max to when KafkaConfig.Configure leaves it below 1:
	// the idempotent producer needs at least one retry. It is sarama's own
	// default.
	RetryMaxDefault = 3

	// StallTimeoutDefault is KafkaConfig.StallTimeout's default.
	StallTimeoutDefault = 30 * time.Second

	// ProducersDefault is KafkaConfig.Producers's default (see BENCHMARKS.md,
	// "Apache Kafka").
	ProducersDefault = 4

	// ProducersMax is the largest accepted KafkaConfig.Producers.
	ProducersMax = 64

	// LingerBatchDefault is KafkaConfig.LingerBatch's default (see
	// BENCHMARKS.md, "Apache Kafka").
	LingerBatchDefault = 32

	// LingerDefault is KafkaConfig.Linger's default.
	LingerDefault = time.Millisecond
)

// MinKafkaVersion is the lowest protocol version the Kafka publisher runs
// with: record headers and the idempotent producer need Kafka 0.11. A lower
// sarama Config.Version is raised to it.
var MinKafkaVersion = sarama.V0_11_0_0

// KafkaConfig configures a Kafka publisher. Its zero value is usable except
// for Brokers, which is required.
type KafkaConfig struct {
	// Brokers are the bootstrap broker addresses, "host:port". Required.
	Brokers []string

	// Configure, if non-nil, adjusts the sarama configuration before the
	// producer is built: client id (default ClientIDDefault), TLS, SASL,
	// Version (default sarama.DefaultVersion), compression, timeouts,
	// retry backoff, flush settings. It receives sarama.NewConfig()'s
	// defaults; an error it returns fails NewKafka.
	//
	// After it runs, the publisher enforces what its guarantees depend on,
	// overriding whatever Configure set:
	//   - Producer.RequiredAcks = sarama.WaitForAll (acks=all);
	//   - Producer.Idempotent = true and Net.MaxOpenRequests = 1, so that
	//     retries neither duplicate nor reorder records;
	//   - Producer.Retry.Max raised to RetryMaxDefault if below 1;
	//   - Version raised to MinKafkaVersion if below it;
	//   - Producer.Return.Successes and Producer.Return.Errors = true;
	//   - Producer.Partitioner: pinned partition, else the Java client's
	//     murmur2 key hash (see KeyPartition), else random for nil keys;
	//   - Producer.MaxMessageBytes = MaxMessageBytes.
	//
	// Setting Producer.Transaction.ID is an error: the publisher is not
	// transactional.
	Configure func(*sarama.Config) error

	// MessageIDHeader is the record header that carries
	// relay.Message.MessageID, appended after the message's own headers.
	// Default MessageIDHeaderDefault. A message with an empty MessageID
	// gets no such header.
	MessageIDHeader string

	// MaxMessageBytes is the largest record, in bytes as sarama estimates
	// them (key, value, headers and per-record overhead), the producer
	// sends; it also caps the size of one partition's batch in a request.
	// A larger record fails before it is sent with an error for which
	// IsTooLarge and relay.IsPermanent report true. Keep it at or below
	// the topic's max.message.bytes (the broker's message.max.bytes by
	// default). Default MaxMessageBytesDefault; it must be below
	// sarama.MaxRequestSize.
	MaxMessageBytes int

	// StallTimeout is how long every publish may fail, with not a single
	// message acknowledged, before the publisher concludes that its
	// producer can no longer make progress and replaces it with a new one
	// (a new producer id, new connections). The same holds for the
	// publishes of one bucket while others go through: sarama can keep
	// producing to a partition on a connection whose broker answers
	// NOT_LEADER_FOR_PARTITION while the metadata names it the leader
	// (kfake's broker removed and added back behind the same address does
	// this), and only new connections end that. The brokers refusing the
	// producer's idempotence state (out-of-order sequence, unknown producer
	// id, invalid epoch) replaces it at once. Replacements are at least 1s
	// apart, doubling up to StallTimeout while they bring no
	// acknowledgement back; each is logged at Warn, counted by
	// Replacements and reported to Observer. A replacement during an
	// outage fails to connect and keeps the old producer. Default
	// StallTimeoutDefault (30s).
	StallTimeout time.Duration

	// Producers is how many slots of idempotent sarama producers the
	// publisher runs, 1 to ProducersMax: one producer per slot, two with
	// the routing by size (LingerBatch), each with its own producer id
	// and broker connections. An idempotent producer has one produce
	// request in flight per broker, so with one producer the batches of
	// all the relay's drainers queue behind each other; with several,
	// batches of different buckets travel at once. A Publish call goes
	// entirely to slot msgs[0].Bucket mod Producers, so a bucket is always
	// on one slot (its producers' replacements included) and its batches,
	// and every key's records, stay in order. Default ProducersDefault.
	Producers int

	// LingerBatch routes batches by size. With it, each of the Producers
	// slots runs two producers: one that sends as soon as its connection to
	// a broker is free (what Configure leaves sarama's Producer.Flush at;
	// sarama's default, no wait), and one that lingers, gathering records
	// for Linger before a produce request. A Publish call of at least
	// LingerBatch messages goes through its slot's lingering producer, a
	// smaller one through the other: a large batch leaves in a few large
	// produce requests instead of a train of small ones, each paying the
	// followers' replication wait, while a batch of a few messages does not
	// wait out the linger. A bucket's batches stay in order across the two
	// producers because the relay publishes a bucket's next batch only
	// after the previous Publish call returned, and a call returns only
	// once every message it handed over was reported, unless its context
	// ended first: then the bucket's batches go through the producer still
	// holding its messages until all of them are reported. Each producer
	// is replaced on its own (see StallTimeout). Default
	// LingerBatchDefault; negative turns the routing off: one producer per
	// slot, every batch sent as soon as the connection is free.
	LingerBatch int

	// Linger is the lingering producers' sarama Producer.Flush.Frequency:
	// how long they gather records before a produce request (see
	// LingerBatch; unused when the routing is off). Their other
	// Producer.Flush settings are what Configure left. Default
	// LingerDefault; it must not be negative.
	Linger time.Duration

	// Observer, if set, is told of every producer replacement.
	// *metrics.Collector implements it. Default: none.
	Observer ProducerObserver

	// Logger receives the publisher's logs: Debug for failed publishes and
	// lifecycle, Warn for anomalies and producer replacements. Default
	// slog.Default(). Payloads are never logged.
	Logger *slog.Logger
}

// ProducerObserver receives the Kafka publisher's producer replacements,
// for metrics. ProducerReplaced is called once per replacement with its
// reason (ReplaceProducerState or ReplaceStalled); it must be fast and
// safe for concurrent use.
type ProducerObserver interface {
	ProducerReplaced(reason string)
}

// WithDefaults returns a copy of c with every unset field set to its
// default.
func (c KafkaConfig) WithDefaults() KafkaConfig {
	if c.MessageIDHeader == "" {
		c.MessageIDHeader = MessageIDHeaderDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = StallTimeoutDefault
	}
	if c.Producers == 0 {
		c.Producers = ProducersDefault
	}
	if c.LingerBatch == 0 {
		c.LingerBatch = LingerBatchDefault
	}
	if c.Linger == 0 {
		c.Linger = LingerDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c KafkaConfig) validate() error {
	if err := checkBrokers("KafkaConfig", c.Brokers); err != nil {
		return err
	}
	if c.StallTimeout < 0 {
		return configError("KafkaConfig.StallTimeout", c.StallTimeout, "must be positive", nil)
	}
	if c.Producers < 1 || c.Producers > ProducersMax {
		return configError("KafkaConfig.Producers", c.Producers, "must be between 1 and "+strconv.Itoa(ProducersMax), nil)
	}
	if c.Linger < 0 {
		return configError("KafkaConfig.Linger", c.Linger, "must not be negative", nil)
	}
	return checkMaxMessageBytes("KafkaConfig", c.MaxMessageBytes)
}

// saramaConfig builds the sarama configuration: defaults, the user's
// Configure, then the enforced guarantees (guaranteedConfig). c has its
// defaults applied.
func (c KafkaConfig) saramaConfig() (*sarama.Config, error) {
	return guaranteedConfig("KafkaConfig", c.Configure, c.MaxMessageBytes, "", "the Kafka publisher is not transactional")
}

// Kafka publishes batches to Kafka through KafkaConfig.Producers slots of
// long-lived sarama AsyncProducers, each bucket always through the same
// slot, a batch through the slot's lingering producer or the other by its
// size (see KafkaConfig.LingerBatch), and replaces a producer when it can
// no longer make progress (see KafkaConfig.StallTimeout). It implements
// relay.Publisher and is safe for concurrent use; see the package
// documentation for its guarantees.
type Kafka struct {
	lifecycle lifecycle
	brokers   []string
	sc        *sarama.Config
	idHeader  []byte
	logger    *slog.Logger
	stall     time.Duration
	observer  ProducerObserver
	producers int            // KafkaConfig.Producers
	lanes     int            // producers per slot: 2 with the routing by size, else 1
	lingerSC  *sarama.Config // the lingering producers' configuration; nil without the routing
	lingerMin int            // KafkaConfig.LingerBatch, with the routing

	mu      sync.Mutex
	closed  bool
	slots   []slot         // KafkaConfig.Producers of them once started; nil before
	retired sync.WaitGroup // replacements and retired producers closing

	replacements atomic.Int64
	probeFailed  atomic.Int64  // when ProbeSink last failed, Unix ns; see replaceFailing
	unknown      unknownTopics // topics that failed as unknown, for classify
	// retries counts the retries sarama started (it asks for a backoff
	// before each one), for the order gate: see call.retriesAtStart.
	retries atomic.Int64
}

// slot holds the producers the buckets mapped to it publish through, one
// per lane, guarded by Kafka.mu: lane laneFree sends as soon as a broker
// connection is free, lane laneLinger (with the routing by size) lingers.
type slot struct {
	lanes [2]lane
	// strays are the slot's buckets whose last Publish call returned, its
	// context ended, before every message it handed over was reported:
	// the bucket's batches go through that lane until they all are, so
	// that a batch never overtakes its predecessor's messages by going
	// through the other producer. Only with the routing by size.
	strays map[int]stray
}

// lane is one producer of a slot: the current one and what the publisher
// knows about its progress.
type lane struct {
	cur    *producer
	health health
}

// Lanes of a slot.
const (
	laneFree   = 0
	laneLinger = 1
)

// stray is the Publish calls of a bucket that returned with messages
// still in their producer, and the lane they went through. A later call
// pinned to that lane can stray too while an earlier one still has
// messages out (a narrowed batch need not hold them), so the bucket stays
// pinned until every one of them reported.
type stray struct {
	calls []*call
	lane  int
}

// out reports whether a message of the stray calls is still in their
// producer, forgetting the calls that reported.
func (st *stray) out() bool {
	st.calls = slices.DeleteFunc(st.calls, func(c *call) bool { return c.pending.Load() <= 0 })
	return len(st.calls) > 0
}

// producer is one sarama producer and the goroutine routing its results.
type producer struct {
	slot       int // index in Kafka.slots
	lane       int // index in slot.lanes
	sp         sarama.AsyncProducer
	senders    sync.WaitGroup // Publish calls handing messages to sp
	dispatched chan struct{}  // closed when dispatch returns
}

// health is what the publisher knows about the current producer's
// progress, guarded by Kafka.mu.
type health struct {
	failingSince time.Time     // first failed publish since the last acknowledgement; zero if none
	replacing    bool          // a replacement is being built
	lastReplace  time.Time     // start of the last replacement attempt
	gap          time.Duration // minimum time between two replacement attempts
	// buckets holds, for each bucket whose publishes through the producer
	// failed since its last acknowledgement, when they started failing
	// and when one last failed: a bucket can fail every publish while
	// others flow (sarama keeps retrying a partition on a connection to a
	// broker that answers NOT_LEADER_FOR_PARTITION while the metadata names
	// it the leader), which the producer-wide failingSince never sees.
	buckets map[int]bucketFailing
}

// bucketFailing is how long a bucket's publishes have failed; see
// health.buckets.
type bucketFailing struct {
	since, last time.Time
}

// failing records a failed publish of bucket at now and returns since when
// the bucket's publishes have failed. A failure more than twice the stall
// timeout after the bucket's previous one starts anew: the bucket was not
// being retried through this producer meanwhile (its lease was elsewhere).
func (h *health) failing(bucket int, now time.Time, stall time.Duration) time.Time {
	if h.buckets == nil {
		h.buckets = make(map[int]bucketFailing)
	}
	f, ok := h.buckets[bucket]
	if !ok || now.Sub(f.last) > 2*stall {
		f.since = now
	}
	f.last = now
	h.buckets[bucket] = f
	return f.since
}

// Reasons a producer is replaced, as passed to
// ProducerObserver.ProducerReplaced.
const (
	// ReplaceProducerState: the brokers refused the producer's idempotence
	// state (OUT_OF_ORDER_SEQUENCE_NUMBER, UNKNOWN_PRODUCER_ID,
	// INVALID_PRODUCER_EPOCH, PRODUCER_FENCED, INVALID_PRODUCER_ID_MAPPING):
	// its sequence numbers or epoch are out of step with theirs, which
	// retrying with the same producer does not repair.
	ReplaceProducerState = "producer_state"
	// ReplaceStalled: every publish failed for StallTimeout without a
	// single acknowledgement.
	ReplaceStalled = "stalled"
	// ReplaceBrokersBack: the producer's publishes failed, and then a
	// broker answered a probe (ProbeSink): the producer's circuit breakers
	// opened and its connections broke during the outage, and would hold
	// its next publishes back for up to 10s more.
	ReplaceBrokersBack = "brokers_back"
)

// replaceGapMin is the shortest time between two producer replacements;
// it doubles while replacements do not bring acknowledgements back, up to
// StallTimeout.
const replaceGapMin = time.Second

var _ relay.Publisher = (*Kafka)(nil)

var errKafkaNotStarted = notStarted("Kafka publisher")

var _ relay.ReadyChecker = (*Kafka)(nil)

// CheckReady implements relay.ReadyChecker, so that relay.Start and
// relay.Run fail at once on a publisher that was never started: before
// Start it returns the error Publish would, wrapping ErrNotStarted, a
// *relay.MisconfigurationError; after Stop or Close, a
// *relay.MisconfigurationError wrapping ErrClosed (a publisher runs once);
// nil once started. It reads local state only.
func (k *Kafka) CheckReady(context.Context) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch {
	case k.closed:
		return closedAtStart("Kafka publisher")
	case k.slots == nil:
		return errKafkaNotStarted
	}
	return nil
}

// NewKafka checks cfg and returns the publisher. It opens no connection
// and starts no goroutine: Start connects. It fails, with a *ConfigError,
// only if the configuration is invalid.
func NewKafka(cfg KafkaConfig) (*Kafka, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sc, err := cfg.saramaConfig()
	if err != nil {
		return nil, err
	}
	k := &Kafka{
		lifecycle: newLifecycle(),
		brokers:   slices.Clone(cfg.Brokers),
		sc:        sc,
		idHeader:  []byte(cfg.MessageIDHeader),
		logger:    cfg.Logger.With(slog.String("component", "outbox_publisher")),
		stall:     cfg.StallTimeout,
		observer:  cfg.Observer,
		producers: cfg.Producers,
		lanes:     1,
	}
	k.countRetries()
	if cfg.LingerBatch > 0 {
		lsc := *sc // after countRetries: the lingering producers' retries count too
		lsc.Producer.Flush.Frequency = cfg.Linger
		k.lanes, k.lingerSC, k.lingerMin = 2, &lsc, cfg.LingerBatch
	}
	return k, nil
}

// connect starts the producers, bounded by ctx, and puts them in service.
// Close waits for them.
func (k *Kafka) connect(ctx context.Context) error {
	err := connect(ctx, guard{&k.mu, &k.closed, &k.retired}, k.newProducers,
		func(ps []*producer) {
			k.slots = make([]slot, k.producers)
			for _, p := range ps {
				k.slots[p.slot].lanes[p.lane] = lane{cur: p, health: health{gap: replaceGapMin}}
			}
			if k.lanes > 1 {
				for i := range k.slots {
					k.slots[i].strays = make(map[int]stray)
				}
			}
		}, closeAll)
	if err == nil {
		k.logger.Debug("kafka publisher started", slog.Any("brokers", k.brokers), slog.Int("producers", k.producers),
			slog.Int("linger_batch", k.lingerMin))
	}
	return err
}

// newProducers starts every slot's producers at once; if one fails, it
// closes the others.
func (k *Kafka) newProducers() ([]*producer, error) {
	n := k.producers * k.lanes
	ps := make([]*producer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ps[i], errs[i] = k.newProducer(i%k.producers, i/k.producers)
		}()
	}
	wg.Wait()
	if err := joinDistinct(errs); err != nil {
		closeAll(slices.DeleteFunc(ps, func(p *producer) bool { return p == nil }))
		return nil, err
	}
	return ps, nil
}

// joinDistinct is errors.Join of errs without the errors whose text an
// earlier one already has: producers that fail to start for one cause
// (no broker answers) report it once, not once per producer.
func joinDistinct(errs []error) error {
	var kept []error
	seen := make(map[string]bool)
	for _, err := range errs {
		if err == nil || seen[err.Error()] {
			continue
		}
		seen[err.Error()] = true
		kept = append(kept, err)
	}
	return errors.Join(kept...)
}

// closeAll closes ps at once and waits for them.
func closeAll(ps []*producer) {
	var wg sync.WaitGroup
	for _, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.close()
		}()
	}
	wg.Wait()
}

// countRetries makes sarama count each retry it starts in k.retries.
// sarama asks Producer.Retry.BackoffFunc (or takes Producer.Retry.Backoff)
// before it sends a batch or a message again; the wrapper keeps the
// user's choice and only counts.
func (k *Kafka) countRetries() {
	backoff, fixed := k.sc.Producer.Retry.BackoffFunc, k.sc.Producer.Retry.Backoff
	k.sc.Producer.Retry.BackoffFunc = func(retries, maxRetries int) time.Duration {
		k.retries.Add(1)
		if backoff != nil {
			return backoff(retries, maxRetries)
		}
		return fixed
	}
}

// newProducer starts a sarama producer (which initialises a new producer
// id) and its dispatcher, for lane l of slot i.
func (k *Kafka) newProducer(i, l int) (*producer, error) {
	sc := k.sc
	if l == laneLinger {
		sc = k.lingerSC
	}
	sp, err := sarama.NewAsyncProducer(k.brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("publisher: start Kafka producer: %w", err)
	}
	p := &producer{slot: i, lane: l, sp: sp, dispatched: make(chan struct{})}
	go p.dispatch(k.logger)
	return p, nil
}

// Replacements returns how many times the publisher replaced one of its
// producers because it could no longer make progress.
func (k *Kafka) Replacements() int64 { return k.replacements.Load() }

// call is one Publish call's share of the producer's output.
type call struct {
	// results has room for one result per message handed to the producer,
	// so that dispatch never blocks on it, even after Publish gave up
	// waiting because its context ended.
	results chan result
	// pending counts the call's messages handed to the producer and not
	// yet reported (the count handed over is added after the hand-over,
	// so it may dip below zero meanwhile); see slot.strays.
	pending atomic.Int64

	// For the order gate: a retry is under way once sarama added a
	// message of the call to a produce request a second time (retrying),
	// or started any retry since the call began (retries moved away from
	// retriesAtStart). The gate then waits for acknowledgements; see
	// admit.
	retrying       atomic.Bool
	retries        *atomic.Int64
	retriesAtStart int64
}

// underRetry reports whether a retry may be under way for the call.
func (c *call) underRetry() bool {
	return c.retrying.Load() || c.retries.Load() != c.retriesAtStart
}

type result struct {
	index int
	err   error
	// partition is where the producer sent the message, -1 if it did not
	// choose one (it refused the record first).
	partition int32
}

// envelope travels through sarama in ProducerMessage.Metadata.
type envelope struct {
	call      *call
	index     int
	pinned    bool
	partition int32

	// The order gate (Kafka only): prev is the previous message of the
	// same call with the same topic and key (for keyless messages, the
	// same pinned partition), nil if none. A message is written only if
	// its predecessor reached a produce request before it and has not
	// failed, and, once a retry may be under way for the call
	// (call.underRetry), only after the predecessor was acknowledged; see
	// admit.
	prev    *envelope
	encodes atomic.Int32 // times the message was added to a produce request
	acked   atomic.Bool  // the producer reported the message written
	failed  atomic.Bool  // the producer reported the message failed, or the gate held it back
}

// errHeldBack fails a message whose predecessor of the same key in the
// same Publish call failed before it could be written, or was still being
// retried: writing it would risk putting the key out of order.
var errHeldBack = relay.Unavailable(errors.New("held back: an earlier message of its key in the batch was not written"))

// admit is the order gate, run by sarama each time it adds the message to
// a produce request (once per attempt).
//
// sarama fails some messages without stopping the later ones of their
// partition: a leader lookup that fails for one message while the next
// finds the leader, or a request whose retries ran out while the messages
// behind it wait to be sent again under a bumped producer epoch. The
// producer reports those failures asynchronously, so the gate cannot rely
// on seeing them in time. It therefore admits a message only if its
// predecessor was added before it and has not failed, and, once a retry
// may be under way (a message of the call is on its second attempt, or the
// producer started a retry since the call began), only after the
// predecessor's acknowledgement was seen.
// Whatever it refuses fails as unavailable and is not written; the relay
// publishes it again after the predecessor. A refusal marks the message
// failed at once, so its own successors are held back too.
func (e *envelope) admit() error {
	if e.encodes.Add(1) > 1 {
		e.call.retrying.Store(true)
	}
	p := e.prev
	if p == nil {
		return nil
	}
	held := p.encodes.Load() == 0 || p.failed.Load() ||
		(e.call.underRetry() && !p.acked.Load())
	if held {
		e.failed.Store(true)
		return errHeldBack
	}
	return nil
}

// gatedEncoder is a record key or value whose encoding runs the order
// gate: sarama encodes the key, then the value, once it adds the record to
// a produce request.
type gatedEncoder struct {
	b   []byte
	env *envelope // nil: no gate (the other part of the record runs it)
}

func (g *gatedEncoder) Encode() ([]byte, error) {
	if g.env != nil {
		if err := g.env.admit(); err != nil {
			return nil, err
		}
	}
	return g.b, nil
}

func (g *gatedEncoder) Length() int { return len(g.b) }

// dispatch routes every producer result to the Publish call that sent the
// message. It returns once sarama closed both output channels, which
// happens after AsyncClose flushed everything in flight.
func (p *producer) dispatch(logger *slog.Logger) {
	defer close(p.dispatched)
	successes, errs := p.sp.Successes(), p.sp.Errors()
	for successes != nil || errs != nil {
		// Successes are the common case: take one that is waiting without
		// the cost of waiting on both channels.
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			deliver(logger, msg, nil)
			continue
		default:
		}
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			deliver(logger, msg, nil)
		case perr, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			deliver(logger, perr.Msg, perr.Err)
		}
	}
}

func deliver(logger *slog.Logger, msg *sarama.ProducerMessage, err error) {
	env, ok := msg.Metadata.(*envelope)
	if !ok {
		logger.Warn("kafka producer returned a message the publisher did not send", slog.String("topic", msg.Topic))
		return
	}
	if err != nil {
		env.failed.Store(true)
	} else {
		env.acked.Store(true)
	}
	env.call.pending.Add(-1)
	select {
	case env.call.results <- result{index: env.index, err: err, partition: partitionOf(msg, env, err)}:
	default:
		// sarama reports each message exactly once; a second report would
		// overflow the buffer. Never block the dispatcher on it.
		logger.Warn("kafka producer reported a message twice",
			slog.String("topic", msg.Topic), slog.Int("index", env.index))
	}
}

// partitionOf is the partition the producer sent msg to, or -1 when it
// refused the record before choosing one: a configuration error (too
// large for Producer.MaxMessageBytes), or a topic whose metadata it could
// not find.
func partitionOf(msg *sarama.ProducerMessage, env *envelope, err error) int32 {
	if env.pinned {
		return env.partition
	}
	var ce sarama.ConfigurationError
	if err != nil && (errors.As(err, &ce) || errors.Is(err, sarama.ErrUnknownTopicOrPartition) ||
		errors.Is(err, sarama.ErrInvalidTopic) || errors.Is(err, errHeldBack)) {
		return -1
	}
	return msg.Partition
}

// Publish sends msgs to Kafka, all at once, and waits until the producer
// reported every one of them. It returns how many leading messages the
// brokers acknowledged (acks=all) and, if that is fewer than len(msgs), a
// *Error for the first message that was not acknowledged.
//
// If ctx ends first, Publish returns the acknowledged prefix so far and
// ctx.Err(). Messages already handed to the producer are not recalled: they
// may still be written, and their results are discarded.
//
// Publish does not copy keys, values or header values; the producer reads
// them until it reported the message. Do not modify them while Publish
// runs, nor after a Publish that returned early because ctx ended.
//
// Publish is safe to call from several goroutines at once. After Close, it
// returns ErrClosed; before Start, an error wrapping ErrNotStarted for
// which relay.IsMisconfiguration reports true.
func (k *Kafka) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return 0, errClosed
	}
	if k.slots == nil {
		k.mu.Unlock()
		return 0, errKafkaNotStarted
	}
	s := &k.slots[k.slotOf(msgs)]
	p := s.lanes[k.laneOf(s, msgs)].cur
	p.senders.Add(1)
	k.mu.Unlock()

	c, sent, stop := k.send(ctx, p, msgs)
	if sent == 0 {
		if stop != nil && ctx.Err() == nil {
			k.observe(p, msgs[0].Bucket, 0, stop)
		}
		return 0, stop
	}
	c.pending.Add(int64(sent))
	acked, err := k.reporter().collect(ctx, msgs, c.results, sent, stop)
	if c.pending.Load() > 0 && k.lanes > 1 {
		k.strayed(p, msgs[0].Bucket, c)
	}
	k.observe(p, msgs[0].Bucket, acked, err)
	return acked, err
}

// laneOf is the lane of slot s a batch publishes through: the lane still
// holding messages of its bucket's last call if there is one (see
// slot.strays), else the lingering lane for a batch of at least
// KafkaConfig.LingerBatch messages and the other for a smaller one.
// k.mu is held.
func (k *Kafka) laneOf(s *slot, msgs []relay.Message) int {
	if k.lanes == 1 || len(msgs) == 0 {
		return laneFree
	}
	bucket := msgs[0].Bucket
	if st, ok := s.strays[bucket]; ok {
		if st.out() {
			s.strays[bucket] = st
			return st.lane
		}
		delete(s.strays, bucket)
	}
	if len(msgs) >= k.lingerMin {
		return laneLinger
	}
	return laneFree
}

// strayed records that call c, of bucket's batch through p, returned with
// messages still in p: the bucket's next batches go through p's lane
// until they, and those of the bucket's earlier stray calls, are all
// reported.
func (k *Kafka) strayed(p *producer, bucket int, c *call) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed {
		return
	}
	strays := k.slots[p.slot].strays
	st := strays[bucket]
	if st.lane != p.lane || !st.out() {
		st = stray{lane: p.lane}
	}
	st.calls = append(st.calls, c)
	strays[bucket] = st
}

// slotOf is the slot a batch publishes through: its first message's
// bucket's. k.slots is set.
func (k *Kafka) slotOf(msgs []relay.Message) int {
	if len(msgs) == 0 {
		return 0
	}
	n := len(k.slots)
	return (msgs[0].Bucket%n + n) % n
}

// send hands msgs to the producer in order, stopping before a message that
// cannot be sent or when ctx ends. It returns how many it handed over and
// why it stopped early (nil if it did not).
func (k *Kafka) send(ctx context.Context, p *producer, msgs []relay.Message) (c *call, sent int, stop error) {
	defer p.senders.Done()
	if len(msgs) == 0 {
		return nil, 0, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}

	n := len(msgs)
	nHeaders, nBytes := 0, 0
	for i := range msgs {
		nHeaders += len(msgs[i].Headers) + 1
		nBytes += len(msgs[i].MessageID)
		for _, h := range msgs[i].Headers {
			nBytes += len(h.Key)
		}
	}
	c = &call{results: make(chan result, n), retries: &k.retries, retriesAtStart: k.retries.Load()}
	// One allocation each for all of the batch's messages, envelopes,
	// headers, key and value encoders, and header key and message id bytes:
	// the producer holds pointers into them until it reports.
	pms := make([]sarama.ProducerMessage, n)
	envs := make([]envelope, n)
	headers := make([]sarama.RecordHeader, 0, nHeaders)
	encoders := make([]gatedEncoder, 2*n)
	text := make([]byte, 0, nBytes)
	bytesOf := func(s string) []byte {
		start := len(text)
		text = append(text, s...)
		return text[start:len(text):len(text)]
	}
	// The last message of each key (or pinned partition, for keyless
	// messages) so far, for the order gate. Batches usually hold one
	// topic; the topic is part of the key only when they do not.
	var (
		lastByKey  map[string]*envelope
		lastByPart map[int32]*envelope
	)
	oneTopic := true
	for i := range msgs {
		if msgs[i].Topic != msgs[0].Topic {
			oneTopic = false
			break
		}
	}

	input, done := p.sp.Input(), ctx.Done()
	for i := range msgs {
		m := &msgs[i]
		if err := checkMessage(m); err != nil {
			return c, i, newError(i, m, err)
		}
		env := &envs[i]
		*env = envelope{call: c, index: i}
		if m.Partition != nil {
			env.pinned, env.partition = true, *m.Partition
		}
		switch {
		case m.Key != nil:
			if lastByKey == nil {
				lastByKey = make(map[string]*envelope)
			}
			key := string(m.Key)
			if !oneTopic {
				key = m.Topic + "\x00" + key
			}
			env.prev = lastByKey[key]
			lastByKey[key] = env
		case m.Partition != nil && oneTopic:
			if lastByPart == nil {
				lastByPart = make(map[int32]*envelope)
			}
			env.prev = lastByPart[*m.Partition]
			lastByPart[*m.Partition] = env
		}
		start := len(headers)
		for _, h := range m.Headers {
			headers = append(headers, sarama.RecordHeader{Key: bytesOf(h.Key), Value: h.Value})
		}
		if m.MessageID != "" {
			headers = append(headers, sarama.RecordHeader{Key: k.idHeader, Value: bytesOf(m.MessageID)})
		}
		pm := &pms[i]
		pm.Topic = m.Topic
		pm.Headers = headers[start:len(headers):len(headers)]
		pm.Metadata = env
		// A nil []byte must become a nil Encoder, not an empty one: only
		// the former is a keyless record or a tombstone. The first part
		// sarama encodes (the key if any, else the value) runs the gate.
		gated := false
		if m.Key != nil {
			encoders[2*i] = gatedEncoder{b: m.Key, env: env}
			pm.Key = &encoders[2*i]
			gated = true
		}
		if m.Value != nil {
			encoders[2*i+1] = gatedEncoder{b: m.Value}
			if !gated {
				encoders[2*i+1].env = env
			}
			pm.Value = &encoders[2*i+1]
		} else if !gated {
			env.encodes.Store(1) // nothing to encode: a keyless tombstone passes ungated
		}
		// Stop as soon as ctx ends; otherwise hand the message over at once
		// if the producer's input has room, which is cheaper than waiting
		// on both channels.
		select {
		case <-done:
			return c, i, ctx.Err()
		default:
		}
		select {
		case input <- pm:
			continue
		default:
		}
		select {
		case input <- pm:
		case <-done:
			return c, i, ctx.Err()
		}
	}
	return c, n, nil
}

var errNoTopic = relay.Permanent(errors.New("message has no topic"))

// checkMessage rejects what no broker would accept, before it is sent.
func checkMessage(m *relay.Message) error {
	if m.Topic == "" {
		return errNoTopic
	}
	if wire.CheckKafkaTopic(m.Topic) != nil {
		return relay.Permanent(fmt.Errorf("%w: %q", sarama.ErrInvalidTopic, m.Topic))
	}
	if m.Partition != nil && *m.Partition < 0 {
		return relay.Permanent(fmt.Errorf("%w: %d", sarama.ErrInvalidPartition, *m.Partition))
	}
	return nil
}

// reporter is what turns the producer's results of a batch into
// Publish's answer, for the Kafka and the Franz publishers.
type reporter struct {
	logger   *slog.Logger
	unknown  *unknownTopics
	idHeader []byte
	maxBytes int // the record size limit (KafkaConfig.MaxMessageBytes)
}

// reporter is k's reporter.
func (k *Kafka) reporter() reporter {
	return reporter{logger: k.logger, unknown: &k.unknown, idHeader: k.idHeader, maxBytes: k.sc.Producer.MaxMessageBytes}
}

// collect waits for the results of the sent messages, one each on
// results, and computes the acknowledged prefix and the first error. stop
// is why the send stopped before msgs[sent], nil if it sent them all.
func (k reporter) collect(ctx context.Context, msgs []relay.Message, results <-chan result, sent int, stop error) (int, error) {
	var (
		done   = make([]bool, sent)
		errs   = make([]error, sent)
		parts  = make([]int32, sent)
		got    int
		prefix int // leading acknowledged messages
	)
	record := func(r result) {
		got++
		done[r.index], errs[r.index], parts[r.index] = true, r.err, r.partition
		for prefix < sent && done[prefix] && errs[prefix] == nil {
			prefix++
		}
	}
	for got < sent {
		// Results come in bursts, a produce response at a time: take one
		// that is waiting before waiting on both channels.
		select {
		case r := <-results:
			record(r)
			continue
		default:
		}
		select {
		case r := <-results:
			record(r)
			continue
		case <-ctx.Done():
		}
		// Take what already arrived, then give up on the rest: their
		// results land in results's buffer and are dropped with it.
		for drained := false; !drained && got < sent; {
			select {
			case r := <-results:
				record(r)
			default:
				drained = true
			}
		}
		if got == sent {
			break
		}
		if prefix < sent && done[prefix] {
			return prefix, k.failure(msgs, prefix, errs, parts, done, prefix)
		}
		k.logger.DebugContext(ctx, "publish interrupted",
			slog.Int("acked", prefix), slog.Int("pending", sent-got), slog.Any("error", ctx.Err()))
		return prefix, ctx.Err()
	}
	if prefix < sent {
		return prefix, k.failure(msgs, prefix, errs, parts, done, prefix)
	}
	if stop != nil {
		return sent, stop
	}
	return sent, nil
}

// failure builds the *Error for msgs[i] and logs it. errs, parts and
// done are the results of the sent messages (done[j]: a result came for
// msgs[j]).
func (k reporter) failure(msgs []relay.Message, i int, errs []error, parts []int32, done []bool, acked int) error {
	m := &msgs[i]
	err := errs[i]
	e := newError(i, m, k.unknown.classify(m.Topic, err))
	if p := parts[i]; p >= 0 {
		e.Partition = &p
	}
	if IsTooLarge(e.Err) {
		e.Size, e.Limit = clientSizes(err)
		if e.Size == 0 {
			e.Size, e.Limit = recordBytes(m, k.idHeader), k.maxBytes
		}
	}
	e.MaybeWritten = outcomeUnknown(err)
	for j := i + 1; j < len(done); j++ {
		// Acknowledged after a failed message, or sent with no answer
		// (ctx ended) or an answer that leaves the outcome open.
		if !done[j] || errs[j] == nil || outcomeUnknown(errs[j]) {
			e.LaterMaybeWritten = append(e.LaterMaybeWritten, msgs[j].MessageID)
		}
	}
	k.logger.Debug("publish failed",
		slog.Int("index", i), slog.String("message_id", m.MessageID), slog.String("topic", m.Topic),
		slog.Int("acked", acked), slog.Bool("permanent", relay.IsPermanent(e.Err)), slog.Any("error", err))
	return e
}

// newError is the *Error of msgs[i] failing with err.
func newError(i int, m *relay.Message, err error) *Error {
	return &Error{Index: i, MessageID: m.MessageID, Topic: m.Topic, Key: m.Key, Partition: m.Partition, Err: err}
}

// recordBytes is m's size as the producer counts it against
// Producer.MaxMessageBytes (record format v2), with the message-id header
// named idHeader.
func recordBytes(m *relay.Message, idHeader []byte) int {
	pm := sarama.ProducerMessage{}
	if m.Key != nil {
		pm.Key = sarama.ByteEncoder(m.Key)
	}
	if m.Value != nil {
		pm.Value = sarama.ByteEncoder(m.Value)
	}
	for _, h := range m.Headers {
		pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
	}
	if m.MessageID != "" {
		pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: idHeader, Value: []byte(m.MessageID)})
	}
	return pm.ByteSize(2)
}

// observe updates the producer's health after a publish of bucket's
// messages through p and starts a replacement when p can no longer make
// progress: the brokers refused its idempotence state, or every publish,
// or every publish of one bucket, failed for StallTimeout. A cancelled
// publish (the relay stopping, a lease lost) says nothing about the
// producer.
func (k *Kafka) observe(p *producer, bucket, acked int, err error) {
	if errors.Is(err, context.Canceled) || errors.Is(err, ErrClosed) {
		return
	}
	now := time.Now()
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed || p != k.slots[p.slot].lanes[p.lane].cur {
		return // a retired producer's result
	}
	h := &k.slots[p.slot].lanes[p.lane].health
	if acked > 0 || err == nil {
		h.failingSince = time.Time{}
		h.gap = replaceGapMin
		delete(h.buckets, bucket)
		return
	}
	if (relay.IsPermanent(err) && !isProducerState(err)) || errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		return // about the message or its topic, not the producer
	}
	if h.failingSince.IsZero() {
		h.failingSince = now
	}
	bucketSince := h.failing(bucket, now, k.stall)
	var reason string
	stalledBucket := -1 // the bucket that stalled alone, if that is the reason
	switch {
	case isProducerState(err):
		reason = ReplaceProducerState
	case now.Sub(h.failingSince) >= k.stall:
		reason = ReplaceStalled
	case now.Sub(bucketSince) >= k.stall:
		reason, stalledBucket = ReplaceStalled, bucket
	default:
		return
	}
	if h.replacing || (!h.lastReplace.IsZero() && now.Sub(h.lastReplace) < h.gap) {
		return
	}
	h.replacing, h.lastReplace = true, now
	failingFor := now.Sub(h.failingSince)
	if bucketSince.Before(h.failingSince) {
		failingFor = now.Sub(bucketSince)
	}
	k.retired.Add(1)
	go k.replace(p.slot, p.lane, reason, err, failingFor, stalledBucket)
}

// replace builds a new producer for lane l of slot i and puts it in
// service; the old one is closed once the publishes handing messages to it
// are done. On failure (the cluster is unreachable) the old one stays, and
// the next attempt waits twice as long, up to StallTimeout. bucket is the
// bucket whose publishes alone stalled, -1 if none.
func (k *Kafka) replace(i, l int, reason string, cause error, failingFor time.Duration, bucket int) {
	defer k.retired.Done()
	np, err := k.newProducer(i, l)

	k.mu.Lock()
	h := &k.slots[i].lanes[l].health
	h.replacing = false
	h.gap = min(2*h.gap, max(k.stall, replaceGapMin))
	if err != nil {
		k.mu.Unlock()
		k.logger.Warn("kafka producer cannot make progress; replacing it failed, keeping it for now",
			slog.String("reason", reason), slog.Int("producer", i), slog.Bool("lingering", l == laneLinger), slog.Duration("failing_for", failingFor), slog.Any("cause", cause), slog.Any("error", err))
		return
	}
	if k.closed {
		k.mu.Unlock()
		k.retired.Add(1)
		go k.retire(np)
		return
	}
	old := k.slots[i].lanes[l].cur
	k.slots[i].lanes[l].cur = np
	h.failingSince, h.buckets = time.Time{}, nil
	k.mu.Unlock()

	n := k.replacements.Add(1)
	attrs := []any{slog.String("reason", reason), slog.Int("producer", i), slog.Bool("lingering", l == laneLinger),
		slog.Duration("failing_for", failingFor), slog.Int64("replacements", n), slog.Any("cause", cause)}
	msg := replacedMessage(reason)
	if bucket >= 0 {
		msg = "every publish of one bucket through the kafka producer failed for failing_for without an acknowledgement, while others may have gone through; replaced it with a new one (new producer id, new connections)"
		attrs = append(attrs, slog.Int("bucket", bucket))
	}
	k.logger.Warn(msg, attrs...)
	if k.observer != nil {
		k.observer.ProducerReplaced(reason)
	}
	k.retired.Add(1)
	go k.retire(old)
}

// replacedMessage is the log line of a replacement for reason: what the
// publisher observed.
func replacedMessage(reason string) string {
	switch reason {
	case ReplaceProducerState:
		return "the brokers refused the kafka producer's idempotence state; replaced it with a new one (new producer id)"
	case ReplaceBrokersBack:
		return "the brokers answer again after the kafka producer's publishes failed; replaced it with a new one (new producer id), so that its open circuit breakers and broken connections do not hold the next publishes back"
	}
	return "every publish through the kafka producer failed for failing_for without an acknowledgement; replaced it with a new one (new producer id)"
}

// retire closes p once no Publish hands messages to it any more. Its
// dispatcher keeps routing the results of the messages in flight.
func (k *Kafka) retire(p *producer) {
	defer k.retired.Done()
	p.close()
}

// close flushes and stops p. Order matters: no Publish may write to Input
// once AsyncClose began shutting it down, and the dispatcher must keep
// draining Successes and Errors until sarama closes them, or the flush
// deadlocks.
func (p *producer) close() {
	p.senders.Wait()
	p.sp.AsyncClose()
	<-p.dispatched
}

// isProducerState reports whether err says the brokers refused the
// producer's idempotence state.
func isProducerState(err error) bool {
	for _, e := range producerStateErrors {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// Close stops the publisher as Stop does, without a deadline: it flushes
// the messages still in flight (waiting for their acknowledgements or
// errors, bounded by the producer's retry and network timeouts), then
// stops the producer and its goroutines, including a replaced producer
// still flushing and a connect that Start gave up on. Publish calls
// blocked handing messages to the producer finish that first. After
// Close, Publish returns ErrClosed and Start fails. Close is safe to call
// more than once; later calls wait for the first to finish and return
// nil.
func (k *Kafka) Close() error { return k.Stop(context.Background()) }

// shut closes the producer; see Close.
func (k *Kafka) shut() error { return k.seal()() }

// seal refuses new batches and returns the rest of the close: flushing
// and stopping the producer. A later call's close waits for the first's.
func (k *Kafka) seal() (finish func() error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed {
		return func() error {
			k.retired.Wait()
			return nil
		}
	}
	k.closed = true
	var ps []*producer
	for i := range k.slots {
		for l := range k.lanes {
			ps = append(ps, k.slots[i].lanes[l].cur)
		}
	}
	k.retired.Add(1) // later calls wait for this one too
	return func() error {
		closeAll(ps)
		k.retired.Done()
		k.retired.Wait()
		k.logger.Debug("kafka publisher closed")
		return nil
	}
}

// Start connects to the cluster and starts the producer (which
// initialises a producer id), bounded by ctx: if ctx ends first, Start
// returns ctx's error at once and closes whatever the connect opens later.
// It fails if no broker in KafkaConfig.Brokers answers. A failed Start
// leaves the publisher unstarted: Start may be called again, and Stop or
// Close end it.
//
// Once started, the publisher is tied to ctx: when ctx ends, it closes as
// with Stop. Start on a running publisher does nothing and returns nil;
// after Stop or Close it returns an error wrapping ErrStopped. Publish
// before Start fails with ErrNotStarted.
func (k *Kafka) Start(ctx context.Context) error { return k.lifecycle.start(ctx, k.connect, k.shut) }

// Stop closes the publisher (see Close) and waits until it has closed, or
// until ctx ends: Stop then returns ctx's error and the close finishes in
// the background, so a shutdown can bound it by its grace period while a
// broker does not answer. Either way Publish fails with ErrClosed from the
// moment Stop is called. Stop before Start and a second Stop are
// harmless. Stop the relay first.
func (k *Kafka) Stop(ctx context.Context) error { return k.lifecycle.stop(ctx, k.seal) }

// Stopped returns a channel closed when a started publisher has stopped,
// by Stop or by the end of its Start context.
func (k *Kafka) Stopped() <-chan struct{} { return k.lifecycle.life.Stopped() }

// Err returns the error its close returned, once a started publisher has
// stopped; nil otherwise.
func (k *Kafka) Err() error { return k.lifecycle.life.Err() }
