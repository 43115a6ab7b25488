package metrics

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/gorm-outbox/outbox/relay"
)

// Defaults applied by Config.WithDefaults.
const (
	// OutboxDefault is the outbox label's default value, the default
	// outbox.Config.Name (the messages table name).
	OutboxDefault = "outbox_messages"
	// OutboxMaxLen is the longest accepted Outbox name, in bytes.
	OutboxMaxLen = 128
)

// PublishBucketsDefault are the publish duration histogram's buckets, in
// seconds: 1ms to about 33s, doubling.
var PublishBucketsDefault = prometheus.ExponentialBuckets(0.001, 2, 16)

// CycleBucketsDefault are the cycle duration histogram's buckets, in
// seconds: 1ms to about 33s, doubling.
var CycleBucketsDefault = prometheus.ExponentialBuckets(0.001, 2, 16)

// Metric names, all prefixed by "outbox_". Counters carry the _total
// suffix in their name.
const (
	NameOwnedBuckets        = "outbox_owned_buckets"
	NameLeaseAcquisitions   = "outbox_lease_acquisitions_total"
	NameLeaseExpirations    = "outbox_lease_expirations_total"
	NameLeaseRevocations    = "outbox_lease_revocations_total"
	NameAcknowledged        = "outbox_messages_acknowledged_total"
	NamePublishFailures     = "outbox_publish_failures_total"
	NameDeadLettered        = "outbox_messages_dead_lettered_total"
	NamePublishDuration     = "outbox_publish_duration_seconds"
	NameCycleDuration       = "outbox_cycle_duration_seconds"
	NamePendingAvailable    = "outbox_pending_available"
	NamePending             = "outbox_pending_messages"
	NamePendingOldestAge    = "outbox_pending_oldest_age_seconds"
	NameBucketPending       = "outbox_bucket_pending_messages"
	NameBucketOldestAge     = "outbox_bucket_pending_oldest_age_seconds"
	NameDeadLetters         = "outbox_dead_letter_messages"
	NamePausedBuckets       = "outbox_paused_buckets"
	NamePendingSampleTime   = "outbox_pending_sample_timestamp_seconds"
	NameProducerReplaced    = "outbox_publisher_producer_replacements_total"
	labelOutbox, labelKind  = "outbox", "kind"
	labelState, labelBucket = "state", "bucket"
	labelReason             = "reason"
)

// Label values of outbox_publish_failures_total's kind and
// outbox_messages_dead_lettered_total's state.
const (
	KindRetryable   = "retryable"
	KindPermanent   = "permanent"
	KindUnavailable = "unavailable"
	KindTimeout     = "timeout"
	StateFailed     = "failed"
	StateParked     = "parked"
	// Reasons of outbox_publisher_producer_replacements_total, as
	// publisher.ReplaceProducerState, publisher.ReplaceStalled and
	// publisher.ReplaceBrokersBack.
	ReasonProducerState = "producer_state"
	ReasonStalled       = "stalled"
	ReasonBrokersBack   = "brokers_back"
)

// Config configures a Collector. The zero value is usable.
type Config struct {
	// Outbox is the value of the outbox label on every series: a stable
	// name of the outbox, the same on every relay sharing its tables and
	// distinct between outboxes, so that one registry can hold the
	// collectors of several outboxes. Use outbox.Config.Name. Never a
	// relay id, a host name or anything unbounded. Default OutboxDefault;
	// 1 to 128 bytes of valid UTF-8.
	Outbox string

	// PublishBuckets and CycleBuckets are the upper bounds, in seconds, of
	// the publish and cycle duration histograms, strictly increasing.
	// Defaults PublishBucketsDefault and CycleBucketsDefault.
	PublishBuckets []float64
	CycleBuckets   []float64

	// SampleInterval is the wait after one backlog sample completes before
	// the next one starts. Default relay.BacklogSampleIntervalDefault
	// (30s). Negative disables backlog sampling: the backlog gauges are
	// then never available.
	SampleInterval time.Duration

	// SampleTimeout bounds one backlog sample; a timed-out sample makes
	// the backlog unavailable until the next one succeeds. Default
	// relay.BacklogSampleTimeoutDefault (5s).
	SampleTimeout time.Duration

	// SampleOnBucketZeroOwnerOnly makes only the relay holding bucket 0
	// sample the backlog, so that N relays do not run N identical
	// whole-table queries; the others report it unavailable. Set it on
	// every relay of the outbox and aggregate the backlog gauges with max.
	// Default false: every relay samples.
	SampleOnBucketZeroOwnerOnly bool

	// OmitBucketBacklog leaves out the per-bucket backlog gauges
	// (outbox_bucket_pending_messages and
	// outbox_bucket_pending_oldest_age_seconds), two series per bucket.
	// Default false: they are exported for every bucket of the outbox.
	OmitBucketBacklog bool
}

// WithDefaults returns a copy of c with every zero field set to its
// default.
func (c Config) WithDefaults() Config {
	if c.Outbox == "" {
		c.Outbox = OutboxDefault
	}
	if c.PublishBuckets == nil {
		c.PublishBuckets = PublishBucketsDefault
	}
	if c.CycleBuckets == nil {
		c.CycleBuckets = CycleBucketsDefault
	}
	if c.SampleInterval == 0 {
		c.SampleInterval = relay.BacklogSampleIntervalDefault
	}
	if c.SampleTimeout == 0 {
		c.SampleTimeout = relay.BacklogSampleTimeoutDefault
	}
	return c
}

// ErrInvalidConfig is wrapped by every error New returns.
var ErrInvalidConfig = errors.New("metrics: invalid configuration")

func (c Config) validate() error {
	bad := func(field, reason string) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, reason)
	}
	switch {
	case len(c.Outbox) > OutboxMaxLen:
		return bad("Outbox", fmt.Sprintf("at most %d bytes", OutboxMaxLen))
	case !utf8.ValidString(c.Outbox):
		return bad("Outbox", "must be valid UTF-8")
	case c.SampleTimeout < 0:
		return bad("SampleTimeout", "must be positive")
	}
	for _, h := range []struct {
		field   string
		buckets []float64
	}{{"PublishBuckets", c.PublishBuckets}, {"CycleBuckets", c.CycleBuckets}} {
		if len(h.buckets) == 0 {
			return bad(h.field, "needs at least one bucket")
		}
		for i := 1; i < len(h.buckets); i++ {
			if h.buckets[i] <= h.buckets[i-1] {
				return bad(h.field, "bounds must be strictly increasing")
			}
		}
	}
	return nil
}

// Collector holds one relay's metrics. It implements prometheus.Collector
// (register it on your registry) and relay.BacklogObserver (pass it as
// relay.Config.Observer). Give every relay its own Collector: the owned
// buckets gauge and the backlog sample belong to one relay. All methods
// are safe for concurrent use.
type Collector struct {
	cfg Config

	owned        prometheus.Gauge
	acquisitions prometheus.Counter
	expirations  prometheus.Counter
	revocations  prometheus.Counter
	acknowledged prometheus.Counter
	failures     *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	replaced     *prometheus.CounterVec
	publishDur   prometheus.Histogram
	cycleDur     prometheus.Histogram

	available, pending, oldestAge, bucketPending, bucketAge, deadLetters, paused, sampledAt *prometheus.Desc

	mu      sync.Mutex
	backlog *relay.Backlog // nil: no current sample
	now     func() time.Time
}

var (
	_ prometheus.Collector     = (*Collector)(nil)
	_ relay.BacklogObserver    = (*Collector)(nil)
	_ relay.RevocationObserver = (*Collector)(nil)
)

// New returns a Collector for cfg, completed with WithDefaults. It fails,
// with an error wrapping ErrInvalidConfig, on an invalid field.
func New(cfg Config) (*Collector, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	cl := prometheus.Labels{labelOutbox: cfg.Outbox}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: cl})
	}
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, cl)
	}
	c := &Collector{
		cfg: cfg,
		now: time.Now,
		owned: prometheus.NewGauge(prometheus.GaugeOpts{Name: NameOwnedBuckets, ConstLabels: cl,
			Help: "Buckets this relay holds a trusted lease on (its local view)."}),
		acquisitions: counter(NameLeaseAcquisitions,
			"Bucket leases this relay acquired, counting re-acquisitions under a new term."),
		expirations: counter(NameLeaseExpirations,
			"Bucket leases this relay lost without releasing them: expired without renewal or taken over. Leases an operator revoked are counted apart."),
		revocations: counter(NameLeaseRevocations,
			"Bucket leases an operator revoked from this relay (a requeue, purge or discard of the bucket's dead letters advanced the lease term); the relay takes the bucket again under the new term."),
		acknowledged: counter(NameAcknowledged,
			"Messages the sink acknowledged (the contiguous prefix of each batch), counted again when republished."),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NamePublishFailures, ConstLabels: cl,
			Help: "Failed publish calls (batches), by kind: permanent when the sink rejects the message, unavailable when the sink could not take writes (not counted against the message), timeout when the relay cancelled the publish after its PublishTimeout, else retryable."},
			[]string{labelKind}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameDeadLettered, ConstLabels: cl,
			Help: "Messages moved to the dead-letter table, by state: failed, or parked behind a failed message of the same key."},
			[]string{labelState}),
		replaced: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameProducerReplaced, ConstLabels: cl,
			Help: "Kafka producers the publisher replaced because they could no longer make progress, by reason: producer_state (the brokers refused its sequence numbers or epoch) or stalled (every publish failed for the publisher's StallTimeout)."},
			[]string{labelReason}),
		publishDur: prometheus.NewHistogram(prometheus.HistogramOpts{Name: NamePublishDuration, ConstLabels: cl,
			Help: "Duration of publish calls (one per batch), including failed and cancelled ones.", Buckets: cfg.PublishBuckets}),
		cycleDur: prometheus.NewHistogram(prometheus.HistogramOpts{Name: NameCycleDuration, ConstLabels: cl,
			Help: "Duration of relay loop passes that did work (lease maintenance) and of discoveries.", Buckets: cfg.CycleBuckets}),

		available: desc(NamePendingAvailable,
			"1 when a backlog sample is available, 0 when the backlog is unknown (its gauges are then absent, not zero)."),
		pending: desc(NamePending,
			"Pending messages in the whole outbox at the last sample."),
		oldestAge: desc(NamePendingOldestAge,
			"Age of the oldest pending message, from the last sample's creation time to now; 0 when nothing is pending."),
		bucketPending: desc(NameBucketPending,
			"Pending messages per bucket at the last sample.", labelBucket),
		bucketAge: desc(NameBucketOldestAge,
			"Age of the oldest pending message per bucket, from the last sample's creation time to now; 0 for an empty bucket.", labelBucket),
		deadLetters: desc(NameDeadLetters,
			"Messages in the dead-letter table at the last sample."),
		paused: desc(NamePausedBuckets,
			"Buckets an operator paused at the last sample: no relay publishes their messages until they are resumed."),
		sampledAt: desc(NamePendingSampleTime,
			"Unix time of the last backlog sample."),
	}
	// Export every label value from the start, so rate() and increase()
	// see the first failure.
	c.failures.WithLabelValues(KindRetryable)
	c.failures.WithLabelValues(KindPermanent)
	c.failures.WithLabelValues(KindUnavailable)
	c.failures.WithLabelValues(KindTimeout)
	c.deadLettered.WithLabelValues(StateFailed)
	c.deadLettered.WithLabelValues(StateParked)
	c.replaced.WithLabelValues(ReasonProducerState)
	c.replaced.WithLabelValues(ReasonStalled)
	c.replaced.WithLabelValues(ReasonBrokersBack)
	return c, nil
}

// Outbox returns the outbox label's value.
func (c *Collector) Outbox() string { return c.cfg.Outbox }

func (c *Collector) instruments() []prometheus.Collector {
	return []prometheus.Collector{c.owned, c.acquisitions, c.expirations, c.revocations, c.acknowledged,
		c.failures, c.deadLettered, c.replaced, c.publishDur, c.cycleDur}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, i := range c.instruments() {
		i.Describe(ch)
	}
	for _, d := range []*prometheus.Desc{c.available, c.pending, c.oldestAge, c.bucketPending, c.bucketAge, c.deadLetters, c.paused, c.sampledAt} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. It never queries the database:
// the backlog gauges come from the last sample.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, i := range c.instruments() {
		i.Collect(ch)
	}
	c.mu.Lock()
	b := c.backlog
	now := c.now()
	c.mu.Unlock()

	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	if b == nil {
		gauge(c.available, 0)
		return
	}
	gauge(c.available, 1)
	if !b.SampledAt.IsZero() {
		gauge(c.sampledAt, float64(b.SampledAt.UnixNano())/1e9)
	}
	gauge(c.pending, float64(b.Pending))
	if age, ok := ageAt(b.Pending, b.Oldest, now); ok {
		gauge(c.oldestAge, age.Seconds())
	}
	if b.DeadLettersKnown {
		gauge(c.deadLetters, float64(b.DeadLetters))
	}
	if b.PausedKnown {
		gauge(c.paused, float64(len(b.Paused)))
	}
	if c.cfg.OmitBucketBacklog {
		return
	}
	emit := func(bb relay.BucketBacklog) {
		label := strconv.Itoa(bb.Bucket)
		gauge(c.bucketPending, float64(bb.Pending), label)
		if age, ok := ageAt(bb.Pending, bb.Oldest, now); ok {
			gauge(c.bucketAge, age.Seconds(), label)
		}
	}
	if b.BucketCount <= 0 {
		// Buckets unknown: export the ones holding messages.
		for _, bb := range b.Buckets {
			emit(bb)
		}
		return
	}
	next := 0
	for bucket := range b.BucketCount {
		for next < len(b.Buckets) && b.Buckets[next].Bucket < bucket {
			next++
		}
		if next < len(b.Buckets) && b.Buckets[next].Bucket == bucket {
			emit(b.Buckets[next])
		} else {
			emit(relay.BucketBacklog{Bucket: bucket})
		}
	}
}

// ageAt is relay.Backlog.OldestAge of a backlog of pending messages, the
// oldest created at oldest, sampled at now.
func ageAt(pending int64, oldest, now time.Time) (time.Duration, bool) {
	return relay.Backlog{Pending: pending, Oldest: oldest, SampledAt: now}.OldestAge()
}

// OwnedBuckets implements relay.Observer.
func (c *Collector) OwnedBuckets(n int) { c.owned.Set(float64(n)) }

// LeasesAcquired implements relay.Observer.
func (c *Collector) LeasesAcquired(n int) { c.acquisitions.Add(float64(n)) }

// LeasesExpired implements relay.Observer.
func (c *Collector) LeasesExpired(n int) { c.expirations.Add(float64(n)) }

// LeasesRevoked implements relay.RevocationObserver.
func (c *Collector) LeasesRevoked(n int) { c.revocations.Add(float64(n)) }

// Published implements relay.Observer: acknowledged messages, a failure
// by kind, and the duration of every call.
func (c *Collector) Published(e relay.PublishEvent) {
	if e.Acked > 0 {
		c.acknowledged.Add(float64(e.Acked))
	}
	if e.Failed() {
		kind := KindRetryable
		switch {
		case relay.IsPermanent(e.Err):
			kind = KindPermanent
		case errors.Is(e.Err, relay.ErrPublishTimeout):
			kind = KindTimeout
		case relay.IsUnavailable(e.Err):
			kind = KindUnavailable
		}
		c.failures.WithLabelValues(kind).Inc()
	}
	c.publishDur.Observe(e.Duration.Seconds())
}

// Acknowledged returns the running total of acknowledged messages (the
// outbox_messages_acknowledged_total counter), for a rate outside
// Prometheus such as gormrelay.UIOptions.Published.
func (c *Collector) Acknowledged() float64 {
	var m dto.Metric
	if err := c.acknowledged.Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}

// ProducerReplaced implements publisher.ProducerObserver: set the
// collector as publisher.KafkaConfig.Observer to count the Kafka
// publisher's producer replacements.
func (c *Collector) ProducerReplaced(reason string) { c.replaced.WithLabelValues(reason).Inc() }

// CycleFinished implements relay.Observer.
func (c *Collector) CycleFinished(d time.Duration) { c.cycleDur.Observe(d.Seconds()) }

// MessagesDeadLettered implements relay.Observer.
func (c *Collector) MessagesDeadLettered(n int, parked bool) {
	if n <= 0 {
		return
	}
	state := StateFailed
	if parked {
		state = StateParked
	}
	c.deadLettered.WithLabelValues(state).Add(float64(n))
}

// BacklogSampling implements relay.BacklogObserver with the sampling
// settings of the Config.
func (c *Collector) BacklogSampling() relay.BacklogSampling {
	return relay.BacklogSampling{
		Interval:            c.cfg.SampleInterval,
		Timeout:             c.cfg.SampleTimeout,
		BucketZeroOwnerOnly: c.cfg.SampleOnBucketZeroOwnerOnly,
	}
}

// BacklogSampled implements relay.BacklogObserver: b becomes the sample
// the backlog gauges report.
func (c *Collector) BacklogSampled(b relay.Backlog) {
	b.Buckets = slices.Clone(b.Buckets)
	slices.SortFunc(b.Buckets, func(x, y relay.BucketBacklog) int { return x.Bucket - y.Bucket })
	c.mu.Lock()
	c.backlog = &b
	c.mu.Unlock()
}

// BacklogUnavailable implements relay.BacklogObserver: the backlog
// gauges disappear and outbox_pending_available drops to 0.
func (c *Collector) BacklogUnavailable(error) {
	c.mu.Lock()
	c.backlog = nil
	c.mu.Unlock()
}

// Backlog returns the current backlog sample, and false when none is
// available.
func (c *Collector) Backlog() (relay.Backlog, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.backlog == nil {
		return relay.Backlog{}, false
	}
	return *c.backlog, true
}
