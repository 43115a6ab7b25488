package publisher

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/relay"
)

// TransactionalConfig configures a Transactional publisher (strict mode).
// Brokers and TransactionalIDPrefix are required; every other zero field
// takes the default documented on it.
type TransactionalConfig struct {
	// Brokers are the bootstrap broker addresses, "host:port". Required.
	Brokers []string

	// TransactionalIDPrefix is the start of every producer's transactional
	// id: bucket b publishes as TransactionalIDPrefix + strconv.Itoa(b),
	// for example "orders-outbox-" gives "orders-outbox-0" to
	// "orders-outbox-7". Required.
	//
	// Every relay of one outbox must use the same prefix: the relay that
	// takes a bucket over initialises the same transactional id, and that
	// is what makes the broker fence the previous owner. Two outboxes (two
	// services, or two outbox tables of one service) must never share a
	// prefix on one cluster: their relays would fence each other on every
	// batch. The broker's transactional-id ACLs, if any, must allow the
	// prefix (a PREFIXED ACL on it is the usual way).
	TransactionalIDPrefix string

	// Configure, if non-nil, adjusts the sarama configuration of every
	// producer, as KafkaConfig.Configure does: client id (default
	// ClientIDDefault), TLS, SASL, Version (default sarama.DefaultVersion),
	// compression, timeouts, and the transaction's own settings,
	// Producer.Transaction.Timeout (sarama's default 1m: how long the
	// broker lets a stalled relay's open transaction hold back
	// read_committed consumers before aborting it) and
	// Producer.Transaction.Retry (unless Backoff or BackoffFunc is set
	// here, a coordinator request is retried after 2ms ten times, then
	// after 4ms doubling to 100ms, up to 60 times unless Max is set here:
	// about 4.6s in all). It is called once by NewTransactional and
	// once for every producer started after that; an error it returns fails
	// NewTransactional or that producer's start.
	//
	// After it runs, the publisher enforces what KafkaConfig.Configure
	// lists (acks=all, idempotence with one request in flight, at least one
	// retry, Return.Successes and Return.Errors, the
	// partitioner, MaxMessageBytes), Kafka 2.5 or newer
	// (MinTransactionalKafkaVersion), and sets Producer.Transaction.ID to
	// the bucket's transactional id. Setting Producer.Transaction.ID here
	// is an error.
	Configure func(*sarama.Config) error

	// MessageIDHeader is the record header that carries
	// relay.Message.MessageID, appended after the message's own headers.
	// Default MessageIDHeaderDefault.
	MessageIDHeader string

	// MaxMessageBytes is the largest record, in bytes as sarama estimates
	// them, that the publisher sends. A batch holding a larger record fails
	// before any transaction begins, with a permanent error for which
	// IsTooLarge reports true, naming that record. Keep it at or below the
	// topic's max.message.bytes. Default MaxMessageBytesDefault; it must be
	// below sarama.MaxRequestSize.
	MaxMessageBytes int

	// MarkerMaxBytes bounds the progress marker, in bytes: the metadata
	// of the offset every transaction commits in its bucket's progress
	// group (ProgressGroup), which lists the row ids the transaction
	// carried, a byte or two per id for ids close together, or, for
	// ascending ids (a table-mode relay's batches) that do not fit, their
	// span: the first and last id, the count and the digest, at most 46
	// bytes. A WAL-mode batch (its messages have a Position), or one of
	// ids in another order, that does not fit is published up to the last
	// id that fits, and the rest follows in the next transaction
	// (relay.Truncated). Keep it at or below the brokers'
	// offset.metadata.max.bytes. Default MarkerMaxBytesDefault, the
	// broker's default; at least 64.
	MarkerMaxBytes int

	// Logger receives the publisher's logs: Debug for producer lifecycle
	// and failed batches, Warn for fencing and failed aborts. Default
	// slog.Default(). Payloads are never logged.
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every unset optional field set to
// its default.
func (c TransactionalConfig) WithDefaults() TransactionalConfig {
	if c.MessageIDHeader == "" {
		c.MessageIDHeader = MessageIDHeaderDefault
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = MaxMessageBytesDefault
	}
	if c.MarkerMaxBytes == 0 {
		c.MarkerMaxBytes = MarkerMaxBytesDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c TransactionalConfig) validate() error {
	if err := checkBrokers("TransactionalConfig", c.Brokers); err != nil {
		return err
	}
	if c.TransactionalIDPrefix == "" {
		return configError("TransactionalConfig.TransactionalIDPrefix", `""`, "is required: a prefix unique to this outbox, shared by all of its relays", nil)
	}
	if c.MarkerMaxBytes < markerMinBytes {
		return configError("TransactionalConfig.MarkerMaxBytes", strconv.Itoa(c.MarkerMaxBytes), "must be at least "+strconv.Itoa(markerMinBytes), nil)
	}
	return checkMaxMessageBytes("TransactionalConfig", c.MaxMessageBytes)
}

// saramaConfig builds the configuration of the producer with transactional
// id txnID: defaults, the user's Configure, then the enforced guarantees.
// An empty txnID builds the configuration Start checks the brokers with.
// c has its defaults applied.
func (c TransactionalConfig) saramaConfig(txnID string) (*sarama.Config, error) {
	sc, err := guaranteedConfig("TransactionalConfig", c.Configure, c.MaxMessageBytes, txnID,
		"the transactional publisher sets it to TransactionalIDPrefix plus the bucket")
	if err != nil {
		return nil, err
	}
	if !sc.Version.IsAtLeast(MinTransactionalKafkaVersion) {
		sc.Version = MinTransactionalKafkaVersion
	}
	retry, def := &sc.Producer.Transaction.Retry, sarama.NewConfig().Producer.Transaction.Retry
	if retry.BackoffFunc == nil && retry.Backoff == def.Backoff {
		retry.BackoffFunc = txnRetryBackoff
		if retry.Max == def.Max {
			retry.Max = txnRetryMax
		}
	}
	if f := &sc.Producer.Flush; f.Frequency == 0 && f.Messages == 0 && f.Bytes == 0 {
		f.Frequency = TxnLingerDefault
	}
	return sc, nil
}

// MinTransactionalKafkaVersion is the lowest sarama Version the
// strict-mode publisher runs with; a lower one set by
// TransactionalConfig.Configure is raised to it. Its progress marker is
// read with an OffsetFetch that requires stable offsets (KIP-447,
// version 7), which Kafka 2.5 introduced.
var MinTransactionalKafkaVersion = sarama.V2_5_0_0

// TxnLingerDefault is the transactional producers' sarama
// Producer.Flush.Frequency unless TransactionalConfig.Configure sets a
// Producer.Flush threshold: how long a produce request waits for more of
// the transaction's records. Without it sarama sends the first record of a
// transaction alone, and every produce request of a transaction that
// reaches a partition not yet in it costs an AddPartitionsToTxn round
// trip before it; a millisecond collects the whole batch, handed over in
// a tight loop, into one AddPartitionsToTxn and one produce request per
// broker.
const TxnLingerDefault = time.Millisecond

// Shape of txnRetryBackoff and the retry budget that goes with it.
const (
	txnRetryBackoffMin = 2 * time.Millisecond
	txnRetryBackoffMax = 100 * time.Millisecond
	// txnRetryFlat is how many retries wait txnRetryBackoffMin before the
	// waits start doubling.
	txnRetryFlat = 10
	// txnRetryMax is the transactional producers'
	// Producer.Transaction.Retry.Max when txnRetryBackoff applies and
	// Configure left sarama's 50: the flat retries spend ten of the
	// budget in 20ms, and 60 keeps the whole wait before a coordinator
	// request gives up at about 4.6s, as sarama's fixed 100ms over 50
	// retries (5s) would.
	txnRetryMax = 60
)

// txnRetryBackoff is the transactional producer's wait before it resends a
// coordinator request (AddPartitionsToTxn, EndTxn, InitProducerID) that
// failed with a retriable error, unless Configure chose
// Producer.Transaction.Retry.Backoff or BackoffFunc: 2ms for the first
// txnRetryFlat retries, then 4ms doubling up to sarama's fixed default of
// 100ms.
//
// The common retriable error is the coordinator's CONCURRENT_TRANSACTIONS
// for a bucket's next transaction while the broker still writes the
// previous one's commit markers and then its completion. On an idle
// broker that takes about a millisecond; on a broker whose JVM is cold or
// whose machine is loaded, the markers of every transaction it
// coordinates queue for its one marker request in flight to each broker,
// and on three nodes the markers and the completion each wait for the
// followers: the answer stays CONCURRENT_TRANSACTIONS for tens of
// milliseconds. Doubling from the first retry then overshoots by about as
// long as it waited: after the markers were written, the next
// AddPartitionsToTxn came 22ms (median) later, while the waits were 2, 4,
// 8, 16 and 32ms (BENCHMARKS.md, "Strict mode: where the time goes"). A
// flat 2ms keeps that overshoot to a retry's round trip for the first
// txnRetryFlat retries (20ms of waits plus their round trips), at the cost
// of a few more requests the coordinator answers from memory; past them
// the doubling rides out a coordinator that moves or loads its state,
// within the budget of txnRetryMax.
func txnRetryBackoff(retries, _ int) time.Duration {
	if retries < txnRetryFlat {
		return txnRetryBackoffMin
	}
	if n := retries - txnRetryFlat + 1; n < 6 {
		return txnRetryBackoffMin << n
	}
	return txnRetryBackoffMax
}

// Transactional is the strict-mode Kafka publisher: every batch is one Kafka
// transaction of a producer that belongs to the batch's bucket, so a batch
// becomes visible to read_committed consumers entirely or not at all, and a
// relay that lost a bucket is fenced by the broker. It implements
// relay.Publisher and relay.LeaseAware and is safe for concurrent use; see
// the package documentation and docs/strict-mode.md for its guarantees.
//
// Each bucket has its own sarama client and transactional producer, with
// transactional id TransactionalIDPrefix + bucket. The relay starts a
// bucket's producer when it acquires the bucket (LeasesAcquired) and closes
// it when it gives the bucket up (LeasesReleased); Publish starts one
// itself for a bucket it was not told about. A relay therefore holds one
// producer, with its own broker connections, per bucket it owns.
type Transactional struct {
	lifecycle lifecycle
	cfg       TransactionalConfig
	pingCfg   *sarama.Config // Start's check that a broker answers
	idHeader  []byte
	logger    *slog.Logger

	mu      sync.Mutex
	started bool // Start's check succeeded
	closed  bool
	buckets map[int]*txProducer // the current producer of each bucket
	unknown unknownTopics       // topics that failed as unknown, for classify
	// bg counts the goroutines that use producers: starts, transactions
	// and closes. Add is only called under mu while closed is false, or by
	// one of those goroutines, so that Close's Wait covers them all.
	bg sync.WaitGroup
}

var (
	_ relay.Publisher  = (*Transactional)(nil)
	_ relay.LeaseAware = (*Transactional)(nil)
)

var errTransactionalNotStarted = notStarted("Transactional publisher")

var _ relay.ReadyChecker = (*Transactional)(nil)

// CheckReady implements relay.ReadyChecker, so that relay.Start and
// relay.Run fail at once on a publisher that was never started: before
// Start it returns the error Publish would, wrapping ErrNotStarted, a
// *relay.MisconfigurationError; after Stop or Close, a
// *relay.MisconfigurationError wrapping ErrClosed (a publisher runs once);
// nil once started. It reads local state only.
func (t *Transactional) CheckReady(context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.closed:
		return closedAtStart("Transactional publisher")
	case !t.started:
		return errTransactionalNotStarted
	}
	return nil
}

// txProducer is one bucket's transactional producer.
type txProducer struct {
	bucket int
	txnID  string
	group  string // the progress group, ProgressGroup(bucket)
	log    *slog.Logger

	// sem is held, one at a time, by the transaction in progress (from
	// BeginTxn to the end of its commit or abort) and finally by close.
	sem chan struct{}

	// ready is closed once start finished; the fields below it are set
	// before that and read-only after.
	ready      chan struct{}
	client     sarama.Client
	producer   sarama.AsyncProducer
	err        error
	dispatched chan struct{} // closed when dispatch returns

	// last is the bucket's progress marker: read from the progress group
	// at start, then the marker of every transaction the producer
	// committed. Set before ready is closed, then by the holder of sem.
	last marker

	// broken is set, by the holder of sem, when the producer can no longer
	// be used (fenced, or its transaction state is fatal or unknown).
	broken bool
	// closing is set under Transactional.mu once a close was scheduled.
	closing bool
}

// NewTransactional checks cfg and returns the strict-mode publisher. It
// opens no connection and starts no goroutine: Start checks that a broker
// answers, and the producers start per bucket, when the relay acquires a
// bucket or on the bucket's first Publish. It fails, with a *ConfigError
// or the error Configure returned, only if the configuration is invalid.
func NewTransactional(cfg TransactionalConfig) (*Transactional, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	sc, err := cfg.saramaConfig("")
	if err != nil {
		return nil, err
	}
	return &Transactional{
		lifecycle: newLifecycle(),
		cfg:       cfg,
		pingCfg:   sc,
		idHeader:  []byte(cfg.MessageIDHeader),
		logger:    cfg.Logger.With(slog.String("component", "outbox_publisher"), slog.Bool("transactional", true)),
		buckets:   map[int]*txProducer{},
	}, nil
}

// connect checks that a broker answers, bounded by ctx, so that Start
// fails fast on unreachable brokers as the Kafka publisher's does. The
// producers have clients of their own. Close waits for it.
func (t *Transactional) connect(ctx context.Context) error {
	err := connect(ctx, guard{&t.mu, &t.closed, &t.bg}, func() (struct{}, error) {
		client, err := sarama.NewClient(t.cfg.Brokers, t.pingCfg)
		if err != nil {
			return struct{}{}, fmt.Errorf("publisher: connect to Kafka: %w", err)
		}
		_ = client.Close()
		return struct{}{}, nil
	}, func(struct{}) { t.started = true }, func(struct{}) {})
	if err == nil {
		t.logger.Debug("transactional publisher started", slog.Any("brokers", t.cfg.Brokers),
			slog.String("transactional_id_prefix", t.cfg.TransactionalIDPrefix))
	}
	return err
}

// TransactionalID returns the transactional id bucket's producer uses:
// TransactionalIDPrefix followed by the bucket number in decimal.
func (t *Transactional) TransactionalID(bucket int) string {
	return t.cfg.TransactionalIDPrefix + strconv.Itoa(bucket)
}

// LeasesAcquired starts the producers of the newly owned buckets, all at
// once, and returns when they are ready or ctx ends. Starting a producer
// costs a metadata request, a FindCoordinator and an InitProducerID round
// trip; the InitProducerID is what fences the bucket's previous owner and
// aborts its open transaction, if any, so when LeasesAcquired returns nil
// the previous owner can no longer commit, before this relay reads its
// first batch. A producer that failed to start is reported and started
// again by the bucket's next Publish. It implements relay.LeaseAware.
// Before Start it fails, as Publish does, with ErrNotStarted, which stops
// the relay.
func (t *Transactional) LeasesAcquired(ctx context.Context, leases []relay.Lease) error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return ErrClosed
	}
	if !t.started {
		t.mu.Unlock()
		return errTransactionalNotStarted
	}
	var started []*txProducer
	for _, l := range leases {
		p := t.buckets[l.Bucket]
		if p == nil {
			p = t.startLocked(l.Bucket)
		}
		started = append(started, p)
	}
	t.mu.Unlock()

	var errs []error
	for _, p := range started {
		select {
		case <-p.ready:
			if p.err != nil {
				errs = append(errs, p.err)
			}
		case <-ctx.Done():
			return fmt.Errorf("publisher: starting transactional producers: %w", ctx.Err())
		}
	}
	return errors.Join(errs...)
}

// LeasesReleased closes the producers of buckets the relay gave up or lost,
// in the background: a transaction in progress is finished first. It
// implements relay.LeaseAware.
func (t *Transactional) LeasesReleased(_ context.Context, leases []relay.Lease) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	for _, l := range leases {
		if p := t.buckets[l.Bucket]; p != nil {
			t.retireLocked(p)
		}
	}
}

// startLocked starts bucket's producer in the background. t.mu is held and
// t.closed is false.
func (t *Transactional) startLocked(bucket int) *txProducer {
	txnID := t.TransactionalID(bucket)
	p := &txProducer{
		bucket: bucket,
		txnID:  txnID,
		group:  t.ProgressGroup(bucket),
		log:    t.logger.With(slog.Int("bucket", bucket), slog.String("transactional_id", txnID)),
		sem:    make(chan struct{}, 1),
		ready:  make(chan struct{}),
	}
	t.buckets[bucket] = p
	t.bg.Add(1)
	go func() {
		defer t.bg.Done()
		defer close(p.ready)
		p.client, p.producer, p.err = t.newProducer(p.txnID)
		if p.err == nil {
			// After InitProducerID: the previous owner's last
			// transaction is committed or aborted, and its marker is
			// what the group holds.
			if p.last, p.err = t.readMarker(p.client, p.group); p.err != nil {
				_ = p.producer.Close()
				_ = p.client.Close()
				p.client, p.producer = nil, nil
			}
		}
		if p.err != nil {
			p.log.Debug("start transactional producer failed", slog.Any("error", p.err))
			return
		}
		p.dispatched = make(chan struct{})
		go p.dispatch(t.logger)
		p.log.Debug("transactional producer started")
	}()
	return p
}

// newProducer connects a client and initialises a transactional producer
// on it (FindCoordinator, InitProducerID). The producer does not own the
// client: both must be closed.
func (t *Transactional) newProducer(txnID string) (sarama.Client, sarama.AsyncProducer, error) {
	sc, err := t.cfg.saramaConfig(txnID)
	if err != nil {
		return nil, nil, startError(txnID, err)
	}
	client, err := sarama.NewClient(t.cfg.Brokers, sc)
	if err != nil {
		return nil, nil, startError(txnID, err)
	}
	producer, err := sarama.NewAsyncProducerFromClient(client)
	if err != nil {
		_ = client.Close()
		return nil, nil, startError(txnID, err)
	}
	return client, producer, nil
}

// startError wraps an error starting a producer. Errors that no retry can
// fix (the transactional id is not authorized, the transaction timeout is
// above the broker's maximum) are a *relay.MisconfigurationError, which
// stops the relay.
func startError(txnID string, err error) error {
	err = fmt.Errorf("publisher: start transactional producer %q: %w", txnID, err)
	switch {
	case errors.Is(err, sarama.ErrTransactionalIDAuthorizationFailed):
		return &relay.MisconfigurationError{Setting: "TransactionalIDPrefix",
			Reason: "the broker does not authorize the transactional id; grant WRITE and DESCRIBE on it (a PREFIXED ACL on the prefix)", Err: err}
	case errors.Is(err, sarama.ErrInvalidTransactionTimeout):
		return &relay.MisconfigurationError{Setting: "Producer.Transaction.Timeout",
			Reason: "it exceeds the broker's transaction.max.timeout.ms", Err: err}
	}
	return err
}

// dispatch routes every producer result to the transaction that sent the
// message, until sarama closed both output channels.
func (p *txProducer) dispatch(logger *slog.Logger) {
	defer close(p.dispatched)
	successes, errs := p.producer.Successes(), p.producer.Errors()
	for successes != nil || errs != nil {
		var (
			msg *sarama.ProducerMessage
			err error
		)
		select {
		case m, ok := <-successes:
			if !ok {
				successes = nil
				continue
			}
			msg = m
		case perr, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			msg, err = perr.Msg, perr.Err
		}
		env, ok := msg.Metadata.(*envelope)
		if !ok {
			logger.Warn("kafka producer returned a message the publisher did not send", slog.String("topic", msg.Topic))
			continue
		}
		select {
		case env.call.results <- result{index: env.index, err: err}:
		default:
			logger.Warn("kafka producer reported a message twice", slog.String("topic", msg.Topic), slog.Int("index", env.index))
		}
	}
}

// retireLocked takes p out of service and closes it in the background once
// its transaction in progress, if any, ended. t.mu is held, and t.closed is
// false or the caller is counted in t.bg.
func (t *Transactional) retireLocked(p *txProducer) {
	if t.buckets[p.bucket] == p {
		delete(t.buckets, p.bucket)
	}
	if p.closing {
		return
	}
	p.closing = true
	t.bg.Add(1)
	go func() {
		defer t.bg.Done()
		<-p.ready
		// Wait for the transaction in progress. A Publish that took p from
		// the map before it was retired gets sem after us, finds p retired
		// and starts a new producer.
		p.sem <- struct{}{}
		defer func() { <-p.sem }()
		if p.producer == nil {
			return
		}
		// Order matters: AsyncClose waits for the messages in flight,
		// which needs the dispatcher draining; the client is not the
		// producer's to close.
		p.producer.AsyncClose()
		<-p.dispatched
		_ = p.client.Close()
		p.log.Debug("transactional producer closed")
	}()
}

func (t *Transactional) retire(p *txProducer) {
	t.mu.Lock()
	t.retireLocked(p)
	t.mu.Unlock()
}

// Publish sends msgs as one Kafka transaction of their bucket's producer
// and returns len(msgs), nil once the transaction committed. Every message
// must come from the same bucket, msgs[0].Bucket, as the relay's batches
// do.
//
// Any failure aborts the transaction: Publish returns 0 and nothing of the
// batch becomes visible to read_committed consumers (read_uncommitted
// consumers may see the aborted records). A failure caused by one message
// is a *Error naming it: its Index is that message's position in the batch,
// not the acknowledged count, so that the relay's failure policy can deal
// with that message (relay.FailedIndex). A message that cannot be sent at
// all (no topic, a negative partition, larger than MaxMessageBytes) fails
// the batch before the transaction begins.
//
// When the broker fenced the producer, because another relay initialised
// the bucket's transactional id after this one, Publish returns an error
// for which relay.IsFenced reports true; the relay then drops the bucket
// without deleting anything, and the producer is closed.
//
// If ctx ends first, Publish returns 0 and ctx.Err() at once, and the
// transaction is aborted in the background (it may already have been
// committed, in which case the batch is published again later: at least
// once). The bucket's next Publish waits for that abort.
//
// Publish does not copy msgs' keys, values or header values; the producer
// reads them until the transaction ended, also after an early return. Do
// not modify them meanwhile.
//
// Publish calls for different buckets run concurrently; calls for one
// bucket run one transaction at a time. After Close it returns ErrClosed;
// before Start, an error wrapping ErrNotStarted for which
// relay.IsMisconfiguration reports true.
func (t *Transactional) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	t.mu.Lock()
	closed, started := t.closed, t.started
	t.mu.Unlock()
	if closed {
		return 0, ErrClosed
	}
	if !started {
		return 0, errTransactionalNotStarted
	}
	if len(msgs) == 0 {
		return 0, nil
	}
	bucket := msgs[0].Bucket
	for i := range msgs {
		if msgs[i].Bucket != bucket {
			return 0, fmt.Errorf("publisher: a transactional batch holds one bucket: message %d is in bucket %d, message 0 in bucket %d",
				i, msgs[i].Bucket, bucket)
		}
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	ids := make([]int64, len(msgs))
	for i := range msgs {
		ids[i] = msgs[i].ID
	}
	positioned := msgs[len(msgs)-1].Position != 0
	meta, fit := encodeMarkerSums(ids, t.cfg.MarkerMaxBytes, positioned, func(n int) markerSums {
		sums := markerSums{digest: relay.MessagesDigest(msgs[:n])}
		if positioned && n > 0 {
			sums.position, sums.last = msgs[n-1].Position, relay.MessagesDigest(msgs[n-1:n])
		}
		return sums
	})
	var cut error
	if fit < len(msgs) {
		cut = relay.Truncated(fmt.Errorf("publisher: the row ids of %d of the batch's %d messages fit in MarkerMaxBytes %d; the rest follows in the next transaction",
			fit, len(msgs), t.cfg.MarkerMaxBytes))
		msgs = msgs[:fit]
	}
	b, err := t.build(msgs)
	if err != nil {
		t.logFailure(msgs, err)
		return 0, err
	}
	b.marker = meta
	if b.rec, err = decodeMarker(meta); err != nil {
		return 0, err // cannot happen: encodeMarkerSums' own output
	}
	p, err := t.acquire(ctx, bucket)
	if err != nil {
		return 0, err
	}

	// The transaction runs on its own goroutine (counted in t.bg by
	// acquire) so that Publish can return when ctx ends while the
	// transaction is aborted, which has to wait for the records in flight.
	done := make(chan txOutcome, 1)
	go func() {
		defer t.bg.Done()
		done <- t.transact(ctx, p, msgs, b)
	}()
	select {
	case o := <-done:
		return o.acked, o.outcomeErr(cut)
	case <-ctx.Done():
		select {
		case o := <-done:
			return o.acked, o.outcomeErr(cut)
		default:
			return 0, ctx.Err()
		}
	}
}

// acquire returns bucket's producer, started and ready, with its sem held
// and t.bg incremented for the transaction that will use it.
func (t *Transactional) acquire(ctx context.Context, bucket int) (*txProducer, error) {
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return nil, ErrClosed
		}
		p := t.buckets[bucket]
		if p == nil {
			p = t.startLocked(bucket)
		}
		t.mu.Unlock()

		select {
		case <-p.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if p.err != nil {
			t.retire(p) // the next Publish starts a new one
			return nil, p.err
		}
		select {
		case p.sem <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		t.mu.Lock()
		usable := !t.closed && t.buckets[bucket] == p && !p.broken
		if usable {
			t.bg.Add(1)
		}
		t.mu.Unlock()
		if usable {
			return p, nil
		}
		<-p.sem // retired while we waited: take the current one
	}
}

// txBatch is a batch converted for the producer.
type txBatch struct {
	pms  []sarama.ProducerMessage
	envs []envelope
	call *call
	// marker is the encoded progress marker of the batch, rec what it
	// records.
	marker string
	rec    relay.Committed
}

// build converts msgs to producer messages and checks each against what no
// broker would accept, so that a batch that cannot succeed fails before
// its transaction begins.
func (t *Transactional) build(msgs []relay.Message) (*txBatch, error) {
	n := len(msgs)
	nHeaders := 0
	for i := range msgs {
		nHeaders += len(msgs[i].Headers) + 1
	}
	b := &txBatch{
		pms:  make([]sarama.ProducerMessage, n),
		envs: make([]envelope, n),
		call: &call{results: make(chan result, n)},
	}
	headers := make([]sarama.RecordHeader, 0, nHeaders)
	for i := range msgs {
		m := &msgs[i]
		if err := checkMessage(m); err != nil {
			return nil, newError(i, m, err)
		}
		env := &b.envs[i]
		*env = envelope{call: b.call, index: i}
		if m.Partition != nil {
			env.pinned, env.partition = true, *m.Partition
		}
		start := len(headers)
		for _, h := range m.Headers {
			headers = append(headers, sarama.RecordHeader{Key: []byte(h.Key), Value: h.Value})
		}
		if m.MessageID != "" {
			headers = append(headers, sarama.RecordHeader{Key: t.idHeader, Value: []byte(m.MessageID)})
		}
		pm := &b.pms[i]
		pm.Topic = m.Topic
		pm.Headers = headers[start:len(headers):len(headers)]
		pm.Metadata = env
		if m.Key != nil {
			pm.Key = sarama.ByteEncoder(m.Key)
		}
		if m.Value != nil {
			pm.Value = sarama.ByteEncoder(m.Value)
		}
		// The size sarama's dispatcher checks, record format v2 (the
		// enforced Version is at least 0.11).
		if size := pm.ByteSize(2); size > t.cfg.MaxMessageBytes {
			e := newError(i, m, relay.Permanent(
				fmt.Errorf("%w: record of %d bytes exceeds MaxMessageBytes %d", ErrTooLarge, size, t.cfg.MaxMessageBytes)))
			e.Size, e.Limit = size, t.cfg.MaxMessageBytes
			return nil, e
		}
	}
	return b, nil
}

type txOutcome struct {
	acked int
	err   error
}

// outcomeErr is the error Publish returns: the transaction's, or cut if
// the batch was truncated to the ids its marker holds and committed.
func (o txOutcome) outcomeErr(cut error) error {
	if o.err == nil && o.acked > 0 {
		return cut
	}
	return o.err
}

// transact runs one transaction on p, whose sem the caller holds; it
// releases it. It returns only after the transaction committed or was
// aborted (or the producer was found unusable and retired).
func (t *Transactional) transact(ctx context.Context, p *txProducer, msgs []relay.Message, b *txBatch) (o txOutcome) {
	defer func() {
		if p.broken {
			t.retire(p)
		}
		<-p.sem
	}()
	log := p.log

	if err := p.producer.BeginTxn(); err != nil {
		// A producer between transactions is Ready; anything else is a
		// state it will not leave. Start a new one next time.
		p.broken = true
		return txOutcome{err: t.txnError(p, "begin transaction", err)}
	}

	input := p.producer.Input()
	sent := 0
send:
	for i := range b.pms {
		select {
		case input <- &b.pms[i]:
			sent++
		case <-ctx.Done():
			break send
		}
	}

	// Wait for every result: the first error reported is the cause, later
	// ones are usually its consequence (the transaction is in error and
	// fails what follows).
	failed, got := -1, 0
	var (
		cause      error
		failedPart int32
	)
wait:
	for got < sent {
		select {
		case r := <-b.call.results:
			got++
			if r.err != nil && failed < 0 {
				failed, cause, failedPart = r.index, r.err, r.partition
			}
		case <-ctx.Done():
			break wait
		}
	}

	switch {
	case failed >= 0:
		abortErr := t.abort(p, log)
		if isFenced(cause) || isFenced(abortErr) {
			p.broken = true
			return txOutcome{err: t.fenced(p, errors.Join(cause, abortErr))}
		}
		e := newError(failed, &msgs[failed], t.unknown.classify(msgs[failed].Topic, cause))
		if p := failedPart; p >= 0 {
			e.Partition = &p
		}
		if IsTooLarge(e.Err) {
			e.Size, e.Limit = recordBytes(&msgs[failed], t.idHeader), t.cfg.MaxMessageBytes
		}
		t.logFailure(msgs, e)
		return txOutcome{err: e}
	case got < len(b.pms) || ctx.Err() != nil:
		// Abandoned: AbortTxn waits for what is still in flight. Nobody
		// waits for the outcome, so a fenced abort only retires p.
		_ = t.abort(p, log)
		log.Debug("transaction abandoned and aborted", slog.Int("sent", sent), slog.Int("batch", len(msgs)), slog.Any("error", ctx.Err()))
		return txOutcome{err: ctx.Err()}
	}

	// The progress marker commits with the records: the next owner of the
	// bucket, or this relay after a failed delete, learns from it which
	// rows Kafka holds (see ProgressGroup).
	seq := p.last.seq + 1
	if err := p.producer.AddOffsetsToTxn(map[string][]*sarama.PartitionOffsetMetadata{
		msgs[0].Topic: {{Partition: 0, Offset: seq, LeaderEpoch: -1, Metadata: &b.marker}},
	}, p.group); err != nil {
		_ = t.abort(p, log)
		return txOutcome{err: t.txnError(p, "add progress marker", err)}
	}
	if err := p.producer.CommitTxn(); err != nil {
		if isFenced(err) {
			p.broken = true
			return txOutcome{err: t.fenced(p, err)}
		}
		if p.producer.TxnStatus()&sarama.ProducerTxnFlagAbortableError != 0 {
			if abortErr := t.abort(p, log); isFenced(abortErr) {
				return txOutcome{err: t.fenced(p, errors.Join(err, abortErr))}
			}
		} else {
			p.broken = true
		}
		log.Debug("commit failed", slog.Int("batch", len(msgs)), slog.Any("error", err))
		return txOutcome{err: t.commitError(p, err)}
	}
	p.last = marker{seq: seq, rec: b.rec}
	return txOutcome{acked: len(msgs)}
}

// abort aborts p's transaction. A failed abort leaves the producer in an
// unknown state: it is retired, and the transaction is aborted by the next
// InitProducerID of the transactional id (this relay's next producer or the
// next owner's) or by the broker's transaction timeout.
func (t *Transactional) abort(p *txProducer, log *slog.Logger) error {
	err := p.producer.AbortTxn()
	if err == nil {
		return nil
	}
	p.broken = true
	if isFenced(err) {
		log.Debug("abort refused: producer fenced", slog.Any("error", err))
		return err
	}
	log.Warn("abort transaction failed; closing the producer", slog.Any("error", err))
	return err
}

// fenced builds the error for a fenced producer and logs it.
func (t *Transactional) fenced(p *txProducer, err error) error {
	p.log.Warn("producer fenced: another producer initialised the transactional id; the relay leaves the bucket",
		slog.Any("error", err))
	return relay.Fenced(fmt.Errorf("publisher: transactional id %q fenced: %w", p.txnID, err))
}

// commitError wraps a failed commit. The broker refusing the progress
// marker (the group or the topic is not authorized for it, the marker is
// larger than offset.metadata.max.bytes) is a *relay.MisconfigurationError:
// no retry can fix it, and nothing of the batch became visible.
func (t *Transactional) commitError(p *txProducer, err error) error {
	err = t.txnError(p, "commit transaction", err)
	switch {
	case errors.Is(err, sarama.ErrGroupAuthorizationFailed), errors.Is(err, sarama.ErrTopicAuthorizationFailed):
		return &relay.MisconfigurationError{Setting: "TransactionalIDPrefix",
			Reason: "the broker refuses the transaction's progress marker; grant READ on the group " + p.group +
				" (a PREFIXED group ACL on the prefix) and on the outbox's topics", Err: err}
	case errors.Is(err, sarama.ErrOffsetMetadataTooLarge):
		return &relay.MisconfigurationError{Setting: "MarkerMaxBytes",
			Reason: "it exceeds the brokers' offset.metadata.max.bytes", Err: err}
	}
	return err
}

// txnError wraps a transaction-level failure, one no single message caused.
func (t *Transactional) txnError(p *txProducer, op string, err error) error {
	if isFenced(err) {
		return t.fenced(p, err)
	}
	return fmt.Errorf("publisher: %s %q: %w", op, p.txnID, err)
}

func (t *Transactional) logFailure(msgs []relay.Message, err error) {
	var e *Error
	if !errors.As(err, &e) {
		return
	}
	t.logger.Debug("transactional publish failed; nothing of the batch is visible",
		slog.Int("bucket", msgs[0].Bucket), slog.Int("index", e.Index), slog.String("message_id", e.MessageID),
		slog.String("topic", e.Topic), slog.Int("batch", len(msgs)), slog.Bool("permanent", relay.IsPermanent(e.Err)),
		slog.Any("error", e.Err))
}

// isFenced reports whether err says that the producer's epoch is no longer
// the transactional id's current one: PRODUCER_FENCED (90; older sarama
// versions print it as an unknown error code) or INVALID_PRODUCER_EPOCH
// (47, what brokers answer to clients below protocol 2.7, and to a produce
// request of a fenced producer).
func isFenced(err error) bool {
	return errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch)
}

// Close stops the publisher as Stop does, without a deadline: it closes
// every producer, after the transaction in progress on it, if any,
// committed or aborted (bounded by the producer's retry and network
// timeouts), and waits for a broker check that Start gave up on. After
// Close, Publish returns ErrClosed and Start fails. Close is safe to call
// more than once; later calls wait for the first to finish. Stop the
// relay before closing its publisher.
func (t *Transactional) Close() error { return t.Stop(context.Background()) }

// shut closes every producer; see Close.
func (t *Transactional) shut() error { return t.seal()() }

// seal refuses new batches and leases, retires every producer (each
// finishes its transaction in the background) and returns the rest of the
// close: waiting for them. A later call's close waits as well.
func (t *Transactional) seal() (finish func() error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	first := !t.closed
	if first {
		for _, p := range t.buckets {
			t.retireLocked(p)
		}
		t.closed = true
	}
	return func() error {
		t.bg.Wait()
		if first {
			t.logger.Debug("transactional publisher closed")
		}
		return nil
	}
}

// Start checks that a broker in TransactionalConfig.Brokers answers,
// bounded by ctx: if ctx ends first, Start returns ctx's error at once and
// closes whatever the check opens later. It starts no producer (see
// LeasesAcquired). A failed Start leaves the publisher unstarted: Start
// may be called again, and Stop or Close end it.
//
// Once started, the publisher is tied to ctx: when ctx ends, it closes as
// with Stop. Start on a running publisher does nothing and returns nil;
// after Stop or Close it returns an error wrapping ErrStopped. Publish and
// LeasesAcquired before Start fail with ErrNotStarted.
func (t *Transactional) Start(ctx context.Context) error {
	return t.lifecycle.start(ctx, t.connect, t.shut)
}

// Stop closes the publisher (see Close) and waits until it has closed, or
// until ctx ends: Stop then returns ctx's error and the close finishes in
// the background, so a shutdown can bound it by its grace period while a
// broker does not answer. Either way Publish fails with ErrClosed from the
// moment Stop is called. Stop before Start and a second Stop are
// harmless. Stop the relay first.
func (t *Transactional) Stop(ctx context.Context) error { return t.lifecycle.stop(ctx, t.seal) }

// Stopped returns a channel closed when a started publisher has stopped,
// by Stop or by the end of its Start context.
func (t *Transactional) Stopped() <-chan struct{} { return t.lifecycle.life.Stopped() }

// Err returns the error its close returned, once a started publisher has
// stopped; nil otherwise.
func (t *Transactional) Err() error { return t.lifecycle.life.Err() }
