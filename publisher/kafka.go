package publisher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/internal/recordsize"
	"github.com/gorm-outbox/outbox/relay"
)

const (
	// DefaultMessageIDHeader is the record header the Kafka publisher stamps
	// with relay.Message.MessageID unless KafkaConfig.MessageIDHeader says
	// otherwise.
	DefaultMessageIDHeader = recordsize.MessageIDHeaderDefault

	// DefaultMaxMessageBytes is KafkaConfig.MaxMessageBytes's default: just
	// under the broker's default message.max.bytes (1048588), so that sarama
	// rejects an oversized record on its own before the broker would fail
	// the whole batch it travels in. The write side refuses at enqueue what
	// this default would refuse (internal/recordsize holds both).
	DefaultMaxMessageBytes = recordsize.MaxMessageBytesDefault

	// DefaultClientID is the Kafka client id the publisher sets before
	// KafkaConfig.Configure runs, which may change it.
	DefaultClientID = "gorm-outbox"

	// DefaultRetryMax is what the publisher raises sarama's
	// Producer.Retry.Max to when KafkaConfig.Configure leaves it below 1:
	// the idempotent producer needs at least one retry. It is sarama's own
	// default.
	DefaultRetryMax = 3
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
	// producer is built: client id (default DefaultClientID), TLS, SASL,
	// Version (default sarama.DefaultVersion), compression, timeouts,
	// retry backoff, flush settings. It receives sarama.NewConfig()'s
	// defaults; an error it returns fails NewKafka.
	//
	// After it runs, the publisher enforces what its guarantees depend on,
	// overriding whatever Configure set:
	//   - Producer.RequiredAcks = sarama.WaitForAll (acks=all);
	//   - Producer.Idempotent = true and Net.MaxOpenRequests = 1, so that
	//     retries neither duplicate nor reorder records;
	//   - Producer.Retry.Max raised to DefaultRetryMax if below 1;
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
	// Default DefaultMessageIDHeader. A message with an empty MessageID
	// gets no such header.
	MessageIDHeader string

	// MaxMessageBytes is the largest record, in bytes as sarama estimates
	// them (key, value, headers and per-record overhead), the producer
	// sends; it also caps the size of one partition's batch in a request.
	// A larger record fails before it is sent with an error for which
	// IsTooLarge and relay.IsPermanent report true. Keep it at or below
	// the topic's max.message.bytes (the broker's message.max.bytes by
	// default). Default DefaultMaxMessageBytes; it must be below
	// sarama.MaxRequestSize.
	MaxMessageBytes int

	// Logger receives the publisher's logs: Debug for failed publishes and
	// lifecycle, Warn for anomalies. Default slog.Default(). Payloads are
	// never logged.
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every unset field set to its
// default.
func (c KafkaConfig) WithDefaults() KafkaConfig {
	if c.MessageIDHeader == "" {
		c.MessageIDHeader = DefaultMessageIDHeader
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c KafkaConfig) validate() error {
	if len(c.Brokers) == 0 {
		return errors.New("publisher: KafkaConfig.Brokers must name at least one broker")
	}
	if c.MaxMessageBytes <= 0 || c.MaxMessageBytes >= int(sarama.MaxRequestSize) {
		return fmt.Errorf("publisher: KafkaConfig.MaxMessageBytes must be between 1 and %d, got %d",
			sarama.MaxRequestSize-1, c.MaxMessageBytes)
	}
	return nil
}

// saramaConfig builds the sarama configuration: defaults, the user's
// Configure, then the enforced guarantees. c has its defaults applied.
func (c KafkaConfig) saramaConfig() (*sarama.Config, error) {
	sc := sarama.NewConfig()
	sc.ClientID = DefaultClientID
	if c.Configure != nil {
		if err := c.Configure(sc); err != nil {
			return nil, fmt.Errorf("publisher: KafkaConfig.Configure: %w", err)
		}
	}
	if sc.Producer.Transaction.ID != "" {
		return nil, errors.New("publisher: sarama Producer.Transaction.ID must be empty: the Kafka publisher is not transactional")
	}

	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = DefaultRetryMax
	}
	if !sc.Version.IsAtLeast(MinKafkaVersion) {
		sc.Version = MinKafkaVersion
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = newPartitioner
	sc.Producer.MaxMessageBytes = c.MaxMessageBytes

	if err := sc.Validate(); err != nil {
		return nil, fmt.Errorf("publisher: invalid sarama configuration: %w", err)
	}
	return sc, nil
}

// Kafka publishes batches to Kafka through one long-lived sarama
// AsyncProducer. It implements relay.Publisher and is safe for concurrent
// use; see the package documentation for its guarantees.
type Kafka struct {
	producer sarama.AsyncProducer
	idHeader []byte
	logger   *slog.Logger

	mu      sync.Mutex
	closed  bool
	senders sync.WaitGroup // Publish calls handing messages to the producer

	dispatched chan struct{} // closed when dispatch returns
}

var _ relay.Publisher = (*Kafka)(nil)

// NewKafka connects to the cluster and starts the producer. It fails if
// the configuration is invalid or no broker in cfg.Brokers answers.
func NewKafka(cfg KafkaConfig) (*Kafka, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sc, err := cfg.saramaConfig()
	if err != nil {
		return nil, err
	}
	producer, err := sarama.NewAsyncProducer(cfg.Brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("publisher: start Kafka producer: %w", err)
	}
	k := &Kafka{
		producer:   producer,
		idHeader:   []byte(cfg.MessageIDHeader),
		logger:     cfg.Logger.With(slog.String("component", "outbox_publisher")),
		dispatched: make(chan struct{}),
	}
	go k.dispatch()
	k.logger.Debug("kafka publisher started", slog.Any("brokers", cfg.Brokers))
	return k, nil
}

// call is one Publish call's share of the producer's output.
type call struct {
	// results has room for one result per message handed to the producer,
	// so that dispatch never blocks on it, even after Publish gave up
	// waiting because its context ended.
	results chan result
}

type result struct {
	index int
	err   error
}

// envelope travels through sarama in ProducerMessage.Metadata.
type envelope struct {
	call      *call
	index     int
	pinned    bool
	partition int32
}

// dispatch routes every producer result to the Publish call that sent the
// message. It returns once sarama closed both output channels, which
// happens after AsyncClose flushed everything in flight.
func (k *Kafka) dispatch() {
	defer close(k.dispatched)
	successes, errs := k.producer.Successes(), k.producer.Errors()
	for successes != nil || errs != nil {
		// Successes are the common case: take one that is waiting without
		// the cost of waiting on both channels.
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			k.deliver(msg, nil)
			continue
		default:
		}
		select {
		case msg, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			k.deliver(msg, nil)
		case perr, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			k.deliver(perr.Msg, perr.Err)
		}
	}
}

func (k *Kafka) deliver(msg *sarama.ProducerMessage, err error) {
	env, ok := msg.Metadata.(*envelope)
	if !ok {
		k.logger.Warn("kafka producer returned a message the publisher did not send", slog.String("topic", msg.Topic))
		return
	}
	select {
	case env.call.results <- result{index: env.index, err: err}:
	default:
		// sarama reports each message exactly once; a second report would
		// overflow the buffer. Never block the dispatcher on it.
		k.logger.Warn("kafka producer reported a message twice",
			slog.String("topic", msg.Topic), slog.Int("index", env.index))
	}
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
// returns ErrClosed.
func (k *Kafka) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return 0, ErrClosed
	}
	k.senders.Add(1)
	k.mu.Unlock()

	c, sent, stop := k.send(ctx, msgs)
	if sent == 0 {
		return 0, stop
	}
	return k.collect(ctx, msgs, c, sent, stop)
}

// send hands msgs to the producer in order, stopping before a message that
// cannot be sent or when ctx ends. It returns how many it handed over and
// why it stopped early (nil if it did not).
func (k *Kafka) send(ctx context.Context, msgs []relay.Message) (c *call, sent int, stop error) {
	defer k.senders.Done()
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
	c = &call{results: make(chan result, n)}
	// One allocation each for all of the batch's messages, envelopes,
	// headers, key and value encoders, and header key and message id bytes:
	// the producer holds pointers into them until it reports. (A
	// ByteEncoder stored in an Encoder would be allocated on its own; a
	// pointer to one is not.)
	pms := make([]sarama.ProducerMessage, n)
	envs := make([]envelope, n)
	headers := make([]sarama.RecordHeader, 0, nHeaders)
	encoders := make([]sarama.ByteEncoder, 2*n)
	text := make([]byte, 0, nBytes)
	bytesOf := func(s string) []byte {
		start := len(text)
		text = append(text, s...)
		return text[start:len(text):len(text)]
	}

	input, done := k.producer.Input(), ctx.Done()
	for i := range msgs {
		m := &msgs[i]
		if err := checkMessage(m); err != nil {
			return c, i, &Error{Index: i, MessageID: m.MessageID, Topic: m.Topic, Err: err}
		}
		env := &envs[i]
		*env = envelope{call: c, index: i}
		if m.Partition != nil {
			env.pinned, env.partition = true, *m.Partition
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
		// A nil []byte must become a nil Encoder, not a ByteEncoder(nil):
		// only the former is a keyless record or a tombstone.
		if m.Key != nil {
			encoders[2*i] = m.Key
			pm.Key = &encoders[2*i]
		}
		if m.Value != nil {
			encoders[2*i+1] = m.Value
			pm.Value = &encoders[2*i+1]
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
	if m.Partition != nil && *m.Partition < 0 {
		return relay.Permanent(fmt.Errorf("%w: %d", sarama.ErrInvalidPartition, *m.Partition))
	}
	return nil
}

// collect waits for the results of the sent messages and computes the
// acknowledged prefix and the first error. stop is why send stopped before
// msgs[sent], nil if it sent them all.
func (k *Kafka) collect(ctx context.Context, msgs []relay.Message, c *call, sent int, stop error) (int, error) {
	var (
		done   = make([]bool, sent)
		errs   = make([]error, sent)
		got    int
		prefix int // leading acknowledged messages
	)
	record := func(r result) {
		got++
		done[r.index], errs[r.index] = true, r.err
		for prefix < sent && done[prefix] && errs[prefix] == nil {
			prefix++
		}
	}
	for got < sent {
		// Results come in bursts, a produce response at a time: take one
		// that is waiting before waiting on both channels.
		select {
		case r := <-c.results:
			record(r)
			continue
		default:
		}
		select {
		case r := <-c.results:
			record(r)
			continue
		case <-ctx.Done():
		}
		// Take what already arrived, then give up on the rest: their
		// results land in c.results's buffer and are dropped with it.
		for drained := false; !drained && got < sent; {
			select {
			case r := <-c.results:
				record(r)
			default:
				drained = true
			}
		}
		if got == sent {
			break
		}
		if prefix < sent && done[prefix] {
			return prefix, k.failure(msgs, prefix, errs[prefix], prefix)
		}
		k.logger.DebugContext(ctx, "publish interrupted",
			slog.Int("acked", prefix), slog.Int("pending", sent-got), slog.Any("error", ctx.Err()))
		return prefix, ctx.Err()
	}
	if prefix < sent {
		return prefix, k.failure(msgs, prefix, errs[prefix], prefix)
	}
	if stop != nil {
		return sent, stop
	}
	return sent, nil
}

// failure builds the *Error for msgs[i] and logs it.
func (k *Kafka) failure(msgs []relay.Message, i int, err error, acked int) error {
	m := &msgs[i]
	e := &Error{Index: i, MessageID: m.MessageID, Topic: m.Topic, Err: classify(err)}
	k.logger.Debug("publish failed",
		slog.Int("index", i), slog.String("message_id", m.MessageID), slog.String("topic", m.Topic),
		slog.Int("acked", acked), slog.Bool("permanent", relay.IsPermanent(e.Err)), slog.Any("error", err))
	return e
}

// Close flushes the messages still in flight (waiting for their
// acknowledgements or errors, bounded by the producer's retry and network
// timeouts), then stops the producer and its goroutines. Publish calls
// blocked handing messages to the producer finish that first. After Close,
// Publish returns ErrClosed. Close is safe to call more than once; later
// calls wait for the first to finish and return nil.
func (k *Kafka) Close() error {
	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		<-k.dispatched
		return nil
	}
	k.closed = true
	k.mu.Unlock()

	// Order matters: no Publish may write to Input once AsyncClose began
	// shutting it down, and the dispatcher must keep draining Successes and
	// Errors until sarama closes them, or the flush deadlocks.
	k.senders.Wait()
	k.producer.AsyncClose()
	<-k.dispatched
	k.logger.Debug("kafka publisher closed")
	return nil
}
