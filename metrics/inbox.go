package metrics

import (
	"fmt"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names of the inbox (package inbox), all prefixed by
// "outbox_inbox_".
const (
	NameInboxProcessed  = "outbox_inbox_processed_total"
	NameInboxDuplicates = "outbox_inbox_duplicates_skipped_total"
	NameInboxFailures   = "outbox_inbox_failures_total"
	NameInboxPurged     = "outbox_inbox_purged_total"
	labelInbox          = "inbox"
)

// Label values of outbox_inbox_failures_total's kind.
const (
	KindHandler  = "handler"
	KindDatabase = "database"
)

// InboxDefault is the inbox label's default value, the default
// inbox.Config.Name (the inbox table name).
const InboxDefault = "outbox_inbox"

// InboxConfig configures an InboxCollector. The zero value is usable.
type InboxConfig struct {
	// Inbox is the value of the inbox label on every series: a stable
	// name, the same on every consumer sharing the inbox table. Use
	// inbox.Config.Name. Default InboxDefault; 1 to 128 bytes of valid
	// UTF-8.
	Inbox string
}

// InboxCollector holds the metrics of one inbox. It implements
// prometheus.Collector (register it on your registry) and inbox.Observer
// (pass it as inbox.Config.Observer). Counters add up across consumers.
// All methods are safe for concurrent use.
type InboxCollector struct {
	inbox      string
	processed  prometheus.Counter
	duplicates prometheus.Counter
	failures   *prometheus.CounterVec
	purged     prometheus.Counter
}

// NewInbox returns an InboxCollector for cfg. It fails, with an error
// wrapping ErrInvalidConfig, on an invalid name.
func NewInbox(cfg InboxConfig) (*InboxCollector, error) {
	if cfg.Inbox == "" {
		cfg.Inbox = InboxDefault
	}
	if len(cfg.Inbox) > OutboxMaxLen || !utf8.ValidString(cfg.Inbox) {
		return nil, fmt.Errorf("%w: Inbox: 1 to %d bytes of valid UTF-8", ErrInvalidConfig, OutboxMaxLen)
	}
	cl := prometheus.Labels{labelInbox: cfg.Inbox}
	counter := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: cl})
	}
	c := &InboxCollector{
		inbox: cfg.Inbox,
		processed: counter(NameInboxProcessed,
			"Records whose handler transaction committed, with their message id recorded (or without one, when the inbox allows records without an id)."),
		duplicates: counter(NameInboxDuplicates,
			"Records skipped because their message id was already recorded, by an earlier delivery or a concurrent one that committed first."),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameInboxFailures, ConstLabels: cl,
			Help: "Processing attempts that committed nothing, by kind: handler when the handler returned an error, database when beginning, recording or committing failed."},
			[]string{labelKind}),
		purged: counter(NameInboxPurged,
			"Processed message ids deleted by the retention purge."),
	}
	c.failures.WithLabelValues(KindHandler)
	c.failures.WithLabelValues(KindDatabase)
	return c, nil
}

// Inbox returns the inbox label's value.
func (c *InboxCollector) Inbox() string { return c.inbox }

func (c *InboxCollector) instruments() []prometheus.Collector {
	return []prometheus.Collector{c.processed, c.duplicates, c.failures, c.purged}
}

// Describe implements prometheus.Collector.
func (c *InboxCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, i := range c.instruments() {
		i.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c *InboxCollector) Collect(ch chan<- prometheus.Metric) {
	for _, i := range c.instruments() {
		i.Collect(ch)
	}
}

// Processed implements inbox.Observer.
func (c *InboxCollector) Processed(string) { c.processed.Inc() }

// DuplicateSkipped implements inbox.Observer.
func (c *InboxCollector) DuplicateSkipped(string) { c.duplicates.Inc() }

// Failed implements inbox.Observer.
func (c *InboxCollector) Failed(_ string, handler bool) {
	kind := KindDatabase
	if handler {
		kind = KindHandler
	}
	c.failures.WithLabelValues(kind).Inc()
}

// Purged implements inbox.Observer.
func (c *InboxCollector) Purged(n int64) { c.purged.Add(float64(n)) }
