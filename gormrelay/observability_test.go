package gormrelay_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/internal/promtest"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// obsBundle is an outbox with its plugin, store and a Kafka cluster.
type obsBundle struct {
	db     *dbtest.DB
	plugin *outbox.Plugin
	store  *gormrelay.Store
	kafka  *kafkatest.Cluster
	topic  string
}

func setupObservability(t *testing.T, dialect string, rules ...outbox.Rule) *obsBundle {
	t.Helper()
	db := dbtest.Open(t, dialect)
	p, err := outbox.NewPlugin(outbox.Config{Name: "orders", Rules: rules})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), db.DB))
	store, err := gormrelay.NewStore(db.DB, p.Config())
	require.NoError(t, err)
	k := kafkatest.Start(t)
	return &obsBundle{db: db, plugin: p, store: store, kafka: k, topic: k.Topic(t, 4)}
}

// newKafkaPublisher returns a started Kafka publisher closed when the test ends.
func (b *obsBundle) newKafkaPublisher(t *testing.T) *publisher.Kafka {
	t.Helper()
	return publishertest.StartKafka(t, publisher.KafkaConfig{
		Brokers: b.kafka.Brokers(),
		Configure: func(sc *sarama.Config) error {
			sc.Producer.Retry.Backoff = 10 * time.Millisecond
			sc.Metadata.Retry.Backoff = 10 * time.Millisecond
			return nil
		},
		Logger: slog.New(slog.DiscardHandler),
	})
}

// enqueue writes n messages with keys spread over the buckets, in one
// transaction per message, under ctx.
func (b *obsBundle) enqueue(t *testing.T, ctx context.Context, n int) {
	t.Helper()
	for i := range n {
		require.NoError(t, b.db.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx, &outbox.Message{Topic: b.topic, Key: fmt.Appendf(nil, "key-%d", i), Value: fmt.Appendf(nil, "v%d", i)})
		}))
	}
}

// newCollector returns a collector registered on a fresh registry.
func newCollector(t *testing.T, cfg metrics.Config) (*metrics.Collector, *prometheus.Registry) {
	t.Helper()
	m, err := metrics.New(cfg)
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(m))
	return m, reg
}

// gather returns the series of family name by their labels other than
// outbox ("" for none), whose value must be "orders".
func gather(t require.TestingT, reg prometheus.Gatherer, name string) map[string]float64 {
	helper(t)
	return promtest.Series(t, reg, name, "orders")
}

func one(t require.TestingT, reg prometheus.Gatherer, name string) float64 {
	helper(t)
	s := gather(t, reg, name)
	require.Len(t, s, 1, name)
	return s[""]
}

// gate holds the first Publish until it is opened.
type gate struct {
	next relay.Publisher
	open chan struct{}
}

func (g *gate) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	select {
	case <-g.open:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	return g.next.Publish(ctx, msgs)
}

// A real drain, PostgreSQL to Kafka: the backlog is sampled before it
// (with a backdated bucket standing out), the counters match what
// happened, and the backlog reads zero after it.
func TestObservabilityDrainMetrics(t *testing.T) {
	t.Parallel()
	b := setupObservability(t, dbtest.Postgres)
	const n = 40
	b.enqueue(t, context.Background(), n)
	old := outbox.Bucket([]byte("key-0"), nil, "", outbox.BucketCountDefault)
	require.NoError(t, b.db.DB.Exec("UPDATE "+b.plugin.Config().Tables.MessagesTable()+" SET created_at_ms = created_at_ms - ? WHERE bucket = ?",
		time.Hour.Milliseconds(), old).Error)

	m, reg := newCollector(t, metrics.Config{Outbox: "orders", SampleInterval: 20 * time.Millisecond})
	g := &gate{next: b.newKafkaPublisher(t), open: make(chan struct{})}
	cfg := fastConfig(t, "a")
	cfg.Observer = m
	// The test asserts there are no duplicates: a lease that lapses on a
	// busy machine would let the relay publish a batch again, so give the
	// single relay a lease no stall of the machine outlasts.
	cfg.LeaseDuration, cfg.LeaseRenewInterval = 30*time.Second, 200*time.Millisecond
	r := startRelay(t, b.store, g, cfg)

	// Before the drain: the sample sees everything, bucket `old` an hour old.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.True(c, func() bool {
			s := gather(c, reg, metrics.NamePending)
			return s[""] == n && one(c, reg, metrics.NameOwnedBuckets) == 8
		}())
	}, deliverWithin, 5*time.Millisecond)
	require.Equal(t, 1.0, one(t, reg, metrics.NamePendingAvailable))
	require.GreaterOrEqual(t, one(t, reg, metrics.NamePendingOldestAge), 3600.0)
	ages, perBucket := gather(t, reg, metrics.NameBucketOldestAge), gather(t, reg, metrics.NameBucketPending)
	require.Len(t, ages, 8)
	require.Len(t, perBucket, 8)
	sum := 0.0
	for bucket := range 8 {
		label := fmt.Sprintf("bucket=%d", bucket)
		sum += perBucket[label]
		if bucket == old {
			require.GreaterOrEqual(t, ages[label], 3600.0)
		} else {
			require.Less(t, ages[label], 600.0, "bucket %d", bucket)
		}
	}
	require.Equal(t, float64(n), sum)
	require.Equal(t, 0.0, one(t, reg, metrics.NameDeadLetters))

	close(g.open)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.True(c, one(c, reg, metrics.NameAcknowledged) == n && gather(c, reg, metrics.NamePending)[""] == 0)
	}, deliverWithin, 5*time.Millisecond)
	recs := b.kafka.ReadAll(t, b.topic, n, 15*time.Second)
	require.Len(t, recs, n)
	require.EqualValues(t, n, b.kafka.RecordCount(t, b.topic), "no duplicates: acknowledged equals enqueued")

	require.Equal(t, 0.0, one(t, reg, metrics.NamePendingOldestAge), "nothing pending")
	for label, age := range gather(t, reg, metrics.NameBucketOldestAge) {
		require.Zero(t, age, label)
	}
	require.Equal(t, map[string]float64{"kind=retryable": 0, "kind=permanent": 0, "kind=unavailable": 0, "kind=timeout": 0}, gather(t, reg, metrics.NamePublishFailures))
	// Eight buckets acquired; on a busy machine a lease may lapse (the
	// trust window is a few hundred milliseconds here) and be acquired
	// again: every acquisition past the eight follows a counted loss.
	acquired, expired := one(t, reg, metrics.NameLeaseAcquisitions), one(t, reg, metrics.NameLeaseExpirations)
	require.GreaterOrEqual(t, acquired, 8.0)
	require.LessOrEqual(t, acquired-8, expired, "every re-acquisition follows a counted loss")
	require.GreaterOrEqual(t, one(t, reg, metrics.NamePublishDuration), 8.0, "one publish per bucket at least")
	require.Positive(t, one(t, reg, metrics.NameCycleDuration))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Stop(ctx))
	require.Zero(t, one(t, reg, metrics.NameOwnedBuckets))
	require.Zero(t, one(t, reg, metrics.NamePendingAvailable), "a stopped relay vouches for no sample")
	require.Empty(t, gather(t, reg, metrics.NamePending))
}

// With SampleOnBucketZeroOwnerOnly, only the relay holding bucket 0 runs
// the backlog query; the other reports the backlog unavailable, with no
// zero-valued backlog series.
func TestObservabilityBucketZeroOwnerOnly(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	sb := newStoreBundle(t, db, outbox.Config{Name: "orders"})
	sb.insert(t, keyed(keysN(8), 2)...)
	never := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		return 0, errors.New("sink down") // keep the backlog in place
	})
	type member struct {
		r   *relay.Relay
		reg *prometheus.Registry
	}
	var members []member
	for _, id := range []string{"a", "b"} {
		m, reg := newCollector(t, metrics.Config{Outbox: "orders", SampleInterval: 20 * time.Millisecond, SampleOnBucketZeroOwnerOnly: true})
		cfg := fastConfig(t, id)
		cfg.LeaseDuration, cfg.LeaseRenewInterval = 3*time.Second, 50*time.Millisecond
		cfg.BackoffMin, cfg.BackoffMax = time.Second, time.Second
		cfg.FailureHandler = relay.FailureHandlerFunc(func(context.Context, relay.Failure) (relay.FailureAction, error) {
			return relay.FailureBackoff, nil // never dead-letter: the backlog stays
		})
		cfg.Observer = m
		members = append(members, member{startRelay(t, sb.store, never, cfg), reg})
	}
	holds0 := func(r *relay.Relay) bool {
		for _, l := range r.Leases() {
			if l.Bucket == 0 {
				return true
			}
		}
		return false
	}
	var owner, other member
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.True(c, func() bool {
			if len(members[0].r.Leases()) != 4 || len(members[1].r.Leases()) != 4 {
				return false
			}
			owner, other = members[0], members[1]
			if holds0(other.r) {
				owner, other = other, owner
			}
			return one(c, owner.reg, metrics.NamePendingAvailable) == 1 && one(c, other.reg, metrics.NamePendingAvailable) == 0
		}())
	}, deliverWithin, 5*time.Millisecond)
	require.Equal(t, 16.0, gather(t, owner.reg, metrics.NamePending)[""])
	for _, name := range []string{metrics.NamePending, metrics.NamePendingOldestAge, metrics.NameBucketPending, metrics.NameBucketOldestAge, metrics.NameDeadLetters} {
		require.Empty(t, gather(t, other.reg, name), "%s: unavailable, not zero", name)
	}
}

// Failures of a function publisher are counted by kind, and the retries
// still deliver everything.
func TestObservabilityPublishFailures(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	sb := newStoreBundle(t, db, outbox.Config{Name: "orders"})
	rows := sb.insert(t, keyed([]string{"only-key"}, 5)...)
	var calls atomic.Int32
	var acked atomic.Int32
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		switch calls.Add(1) {
		case 1:
			acked.Add(2)
			return 2, errors.New("broker unavailable")
		case 2:
			return 0, relay.Permanent(errors.New("rejected once"))
		}
		acked.Add(int32(len(msgs)))
		return len(msgs), nil
	})
	m, reg := newCollector(t, metrics.Config{Outbox: "orders", SampleInterval: -1})
	cfg := fastConfig(t, "a")
	cfg.Observer = m
	// Retry everything: this test is about counting failures, not about
	// the failure policy.
	cfg.FailureHandler = relay.FailureHandlerFunc(func(context.Context, relay.Failure) (relay.FailureAction, error) {
		return relay.FailureBackoff, nil
	})
	startRelay(t, sb.store, pub, cfg)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, sb.count(c) == 0) }, deliverWithin, 5*time.Millisecond)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, one(c, reg, metrics.NameAcknowledged) == float64(len(rows))) }, deliverWithin, 5*time.Millisecond)
	require.EqualValues(t, len(rows), acked.Load())
	require.Equal(t, map[string]float64{"kind=retryable": 1, "kind=permanent": 1, "kind=unavailable": 0, "kind=timeout": 0}, gather(t, reg, metrics.NamePublishFailures))
	require.Equal(t, 3.0, one(t, reg, metrics.NamePublishDuration), "three calls, each timed")
	require.Equal(t, 0.0, one(t, reg, metrics.NamePendingAvailable), "sampling disabled: unavailable")
}

// With the store's default failure policy, a permanently rejected message
// is dead-lettered and the later messages of its key are parked: both
// counters and the sampled dead-letter gauge say so.
func TestObservabilityDeadLetters(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	sb := newStoreBundle(t, db, outbox.Config{Name: "orders"})
	rows := sb.insert(t, keyed([]string{"only-key"}, 5)...)
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		for i, m := range msgs {
			if string(m.Value) == "only-key/2" {
				return i, relay.Permanent(errors.New("rejected by the sink"))
			}
		}
		return len(msgs), nil
	})
	m, reg := newCollector(t, metrics.Config{Outbox: "orders", SampleInterval: 20 * time.Millisecond})
	cfg := fastConfig(t, "a")
	cfg.Observer = m
	cfg.Logger = dbtest.Logger(t)
	startRelay(t, sb.store, pub, cfg)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.True(c, gather(c, reg, metrics.NamePending)[""] == 0 && gather(c, reg, metrics.NameDeadLetters)[""] == 3)
	}, deliverWithin, 5*time.Millisecond)
	// The sample reads the table, which can show the parked rows before
	// the relay has told the Observer of them.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, map[string]float64{"state=failed": 1, "state=parked": 2}, gather(c, reg, metrics.NameDeadLettered))
	}, deliverWithin, 5*time.Millisecond)
	require.Equal(t, 2.0, one(t, reg, metrics.NameAcknowledged))
	require.Equal(t, map[string]float64{"kind=retryable": 0, "kind=permanent": 1, "kind=unavailable": 0, "kind=timeout": 0}, gather(t, reg, metrics.NamePublishFailures))
	require.Len(t, rows, 5)
}

// The GORM store's sample on every database: per-bucket counts and oldest
// creation times, the dead-letter count and the paused buckets.
func TestStoreSampleBacklog(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 4})
		s, err := b.store.SampleBacklog(ctx)
		require.NoError(t, err)
		require.Empty(t, s.Paused)
		s.Paused = nil
		require.Equal(t, relay.Backlog{BucketCount: 4, DeadLettersKnown: true, PausedKnown: true, SampledAt: s.SampledAt}, s, "empty")
		age, known := s.OldestAge()
		require.True(t, known)
		require.Zero(t, age)

		base := time.Now().Add(-time.Hour).UnixMilli()
		b.insert(t,
			outbox.MessageRow{Bucket: 1, CreatedAtMs: base + 500},
			outbox.MessageRow{Bucket: 1, CreatedAtMs: base + 100},
			outbox.MessageRow{Bucket: 3, CreatedAtMs: base + 2000},
		)
		require.NoError(t, db.DB.Table(b.cfg.Tables.DeadLettersTable()).Create(&outbox.DeadLetterRow{
			ID: 99, MessageID: "dead", Topic: "events", CreatedAtMs: base, DeadAtMs: base, State: "failed",
		}).Error)
		admin := b.newAdmin(t)
		require.NoError(t, admin.PauseBucket(ctx, 3))
		require.NoError(t, admin.PauseBucket(ctx, 0))
		s, err = b.store.SampleBacklog(ctx)
		require.NoError(t, err)
		require.True(t, s.PausedKnown)
		require.Equal(t, []int{0, 3}, s.Paused)
		require.EqualValues(t, 3, s.Pending)
		require.Equal(t, base+100, s.Oldest.UnixMilli())
		require.Equal(t, []relay.BucketBacklog{
			{Bucket: 1, Pending: 2, Oldest: time.UnixMilli(base + 100)},
			{Bucket: 3, Pending: 1, Oldest: time.UnixMilli(base + 2000)},
		}, s.Buckets)
		require.EqualValues(t, 1, s.DeadLetters)
		age, known = s.OldestAge()
		require.True(t, known)
		require.InDelta(t, time.Hour.Seconds(), age.Seconds(), 60)

		// The timeout is honoured.
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		_, err = b.store.SampleBacklog(cctx)
		require.ErrorIs(t, err, context.Canceled)
	})
}

// recordingTP is a TracerProvider that records the spans started on it.
type recordingTP struct {
	noop.TracerProvider
	mu    sync.Mutex
	spans []recordedSpan
}

type recordedSpan struct {
	name string
	cfg  trace.SpanConfig
}

func (p *recordingTP) Tracer(string, ...trace.TracerOption) trace.Tracer {
	return recordingTracer{p: p}
}

type recordingTracer struct {
	noop.Tracer
	p *recordingTP
}

func (t recordingTracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	t.p.mu.Lock()
	t.p.spans = append(t.p.spans, recordedSpan{name, trace.NewSpanStartConfig(opts...)})
	t.p.mu.Unlock()
	return t.Tracer.Start(ctx, name, opts...)
}

// TracedOrder is a model whose inserts publish through a rule.
type TracedOrder struct {
	ID    uint64 `gorm:"primaryKey"`
	Total int
}

func spanContext(t *testing.T, traceID, spanID string) trace.SpanContext {
	t.Helper()
	var tid trace.TraceID
	var sid trace.SpanID
	_, err := hex.Decode(tid[:], []byte(traceID))
	require.NoError(t, err)
	_, err = hex.Decode(sid[:], []byte(spanID))
	require.NoError(t, err)
	ts, err := trace.ParseTraceState("vendor=opaque")
	require.NoError(t, err)
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true})
}

func header(r kafkatest.Record, key string) (string, int) {
	v, n := "", 0
	for _, h := range r.Headers {
		if h.Key == key {
			v, n = string(h.Value), n+1
		}
	}
	return v, n
}

// The trace context of the request that enqueued a message (explicit
// Enqueue and a publish rule alike) reaches the Kafka record's headers,
// through the database and the relay; a message that carries its own is
// left alone, and one written outside a trace gets none. The optional
// publish span links to the messages' traces.
func TestTraceContextReachesKafka(t *testing.T) {
	t.Parallel()
	var topic string // the rule reads it after setup
	b := setupObservability(t, dbtest.Postgres, outbox.OnCreate(func(c outbox.Change[*TracedOrder]) (*outbox.Message, error) {
		return &outbox.Message{Topic: topic, Key: fmt.Appendf(nil, "order-%d", c.Entity.ID), Value: []byte("placed")}, nil
	}))
	topic = b.topic
	require.NoError(t, b.db.DB.AutoMigrate(&TracedOrder{}))

	sc := spanContext(t, "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
	wantParent := "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	own := "00-11111111111111111111111111111111-2222222222222222-01"

	require.NoError(t, b.db.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&TracedOrder{Total: 42}).Error; err != nil { // rule-built message
			return err
		}
		headers := []outbox.Header{{Key: "content-type", Value: []byte("text/plain")}}
		if err := outbox.Enqueue(tx,
			&outbox.Message{Topic: topic, Key: []byte("explicit"), Value: []byte("explicit"), Headers: headers},
			&outbox.Message{Topic: topic, Key: []byte("own"), Value: []byte("own"), Headers: []outbox.Header{{Key: "traceparent", Value: []byte(own)}}},
		); err != nil {
			return err
		}
		require.Len(t, headers, 1, "the caller's header slice is not appended to")
		return nil
	}))
	require.NoError(t, b.db.DB.Transaction(func(tx *gorm.DB) error { // no trace
		return outbox.Enqueue(tx, &outbox.Message{Topic: topic, Key: []byte("untraced"), Value: []byte("untraced")})
	}))

	tp := &recordingTP{}
	r, err := relay.New(b.store, publisher.TracingPublisher(b.newKafkaPublisher(t), tp), fastConfig(t, "a"))
	require.NoError(t, err)
	published, err := r.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 4, published)

	recs := b.kafka.ReadAll(t, topic, 4, 15*time.Second)
	require.Len(t, recs, 4)
	byValue := map[string]kafkatest.Record{}
	for _, rec := range recs {
		byValue[string(rec.Value)] = rec
	}
	for _, v := range []string{"placed", "explicit"} {
		rec := byValue[v]
		parent, n := header(rec, outbox.TraceParentHeader)
		require.Equal(t, 1, n, v)
		require.Equal(t, wantParent, parent, v)
		state, _ := header(rec, outbox.TraceStateHeader)
		require.Equal(t, "vendor=opaque", state, v)

		// A consumer continues the request's trace.
		var hs []outbox.Header
		for _, h := range rec.Headers {
			hs = append(hs, outbox.Header{Key: h.Key, Value: h.Value})
		}
		got := trace.SpanContextFromContext(outbox.ExtractTraceContext(context.Background(), hs))
		require.Equal(t, sc.TraceID(), got.TraceID())
		require.Equal(t, sc.SpanID(), got.SpanID())
	}
	ct, _ := header(byValue["explicit"], "content-type")
	require.Equal(t, "text/plain", ct, "the message's own headers are kept")
	parent, n := header(byValue["own"], outbox.TraceParentHeader)
	require.Equal(t, 1, n)
	require.Equal(t, own, parent, "a message's own traceparent wins")
	_, n = header(byValue["own"], outbox.TraceStateHeader)
	require.Zero(t, n, "no tracestate of another trace is added")
	_, n = header(byValue["untraced"], outbox.TraceParentHeader)
	require.Zero(t, n)

	// The publish spans link to every traced message, nothing else.
	tp.mu.Lock()
	defer tp.mu.Unlock()
	require.NotEmpty(t, tp.spans)
	links := map[string]int{}
	for _, s := range tp.spans {
		require.Equal(t, "send "+topic, s.name)
		require.Equal(t, trace.SpanKindProducer, s.cfg.SpanKind())
		for _, l := range s.cfg.Links() {
			links[l.SpanContext.TraceID().String()]++
		}
	}
	require.Equal(t, map[string]int{sc.TraceID().String(): 2, "11111111111111111111111111111111": 1}, links)
}

// Enqueue adds no trace headers without a valid span context, and they
// count against MaxMessageBytes when it does.
func TestTraceContextSizeAndAbsence(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	msg := func() *outbox.Message { return &outbox.Message{Topic: "t", Value: make([]byte, 40)} }
	p, err := outbox.NewPlugin(outbox.Config{MaxMessageBytes: msg().Size() + 20})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), db.DB))

	require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, msg()) }), "fits without a trace")

	ctx := trace.ContextWithSpanContext(context.Background(), spanContext(t, "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
	var tooLarge *outbox.TooLargeError
	require.ErrorAs(t, db.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, msg()) }), &tooLarge,
		"the trace headers are part of the message")

	// An invalid span context (zero ids) adds nothing.
	ctx = trace.ContextWithSpanContext(context.Background(), trace.SpanContext{})
	m := msg()
	require.NoError(t, db.DB.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, m) }))
	require.Empty(t, m.Headers)
}

// leaseAwarePub is a publisher with the LeaseAware capability.
type leaseAwarePub struct {
	relay.PublisherFunc
	acquired, released []relay.Lease
}

func (p *leaseAwarePub) LeasesAcquired(_ context.Context, ls []relay.Lease) error {
	p.acquired = append(p.acquired, ls...)
	return nil
}

func (p *leaseAwarePub) LeasesReleased(_ context.Context, ls []relay.Lease) {
	p.released = append(p.released, ls...)
}

// reconcilingPub is a LeaseAware publisher that is also a Reconciler: it
// names the lease's bucket and term.
type reconcilingPub struct{ *leaseAwarePub }

func (reconcilingPub) Reconcile(_ context.Context, l relay.Lease) (relay.Committed, error) {
	return relay.Committed{IDs: []int64{int64(l.Bucket), l.Term}}, nil
}

// reconcilingOnly is a Reconciler that is not LeaseAware.
type reconcilingOnly struct{ p *reconcilingPub }

func (r reconcilingOnly) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	return r.p.Publish(ctx, msgs)
}

func (r reconcilingOnly) Reconcile(ctx context.Context, l relay.Lease) (relay.Committed, error) {
	return r.p.Reconcile(ctx, l)
}

// TracingPublisher keeps the wrapped publisher's LeaseAware and Reconciler
// capabilities and adds none it lacks; errors pass through unchanged.
func TestTracingPublisherWrapping(t *testing.T) {
	t.Parallel()
	boom := relay.Permanent(errors.New("rejected"))
	inner := &leaseAwarePub{PublisherFunc: func(_ context.Context, msgs []relay.Message) (int, error) { return 1, boom }}
	wrapped := publisher.TracingPublisher(inner, &recordingTP{})
	la, ok := wrapped.(relay.LeaseAware)
	require.True(t, ok)
	require.NoError(t, la.LeasesAcquired(t.Context(), []relay.Lease{{Bucket: 1, Term: 2}}))
	la.LeasesReleased(t.Context(), []relay.Lease{{Bucket: 1, Term: 2}})
	require.Equal(t, []relay.Lease{{Bucket: 1, Term: 2}}, inner.acquired)
	require.Equal(t, []relay.Lease{{Bucket: 1, Term: 2}}, inner.released)
	acked, err := wrapped.Publish(t.Context(), []relay.Message{{Topic: "a"}, {Topic: "b"}})
	require.Equal(t, 1, acked)
	require.ErrorIs(t, err, boom)
	_, ok = wrapped.(relay.Reconciler)
	require.False(t, ok, "a capability the wrapped publisher lacks")

	// The strict-mode publisher's two capabilities, together or alone.
	for name, inner := range map[string]relay.Publisher{
		"both":       &reconcilingPub{leaseAwarePub: &leaseAwarePub{}},
		"reconciler": reconcilingOnly{&reconcilingPub{leaseAwarePub: &leaseAwarePub{}}},
	} {
		wrapped := publisher.TracingPublisher(inner, &recordingTP{})
		rc, ok := wrapped.(relay.Reconciler)
		require.True(t, ok, name)
		c, err := rc.Reconcile(t.Context(), relay.Lease{Bucket: 3, Term: 4})
		require.NoError(t, err, name)
		require.Equal(t, []int64{3, 4}, c.IDs, name)
		_, isLA := wrapped.(relay.LeaseAware)
		require.Equal(t, name == "both", isLA, name)
	}

	tp := &recordingTP{}
	plain := publisher.TracingPublisher(relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		return len(msgs), nil
	}), tp)
	_, ok = plain.(relay.LeaseAware)
	require.False(t, ok)
	_, ok = plain.(relay.Reconciler)
	require.False(t, ok)
	acked, err = plain.Publish(t.Context(), []relay.Message{{Topic: "a"}, {Topic: "b"}})
	require.NoError(t, err)
	require.Equal(t, 2, acked)
	require.Len(t, tp.spans, 1)
	require.Equal(t, "send", tp.spans[0].name, "a batch of several topics")
	require.Empty(t, tp.spans[0].cfg.Links())
}
