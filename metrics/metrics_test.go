package metrics_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox/internal/promtest"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/relay"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// bundle is a collector registered on its own pedantic registry.
type bundle struct {
	c   *metrics.Collector
	reg *prometheus.Registry
}

func setup(t *testing.T, cfg metrics.Config) *bundle {
	t.Helper()
	c, err := metrics.New(cfg)
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	return &bundle{c: c, reg: reg}
}

// series returns the gathered value of every series of the family name,
// keyed by its labels other than outbox ("" for none), e.g. "bucket=3".
// Counters and gauges give their value, histograms their sample count.
func (b *bundle) series(t *testing.T, name string) map[string]float64 {
	t.Helper()
	return promtest.Series(t, b.reg, name, "")
}

func TestLint(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{Outbox: "orders"})
	b.c.BacklogSampled(relay.Backlog{BucketCount: 2, Pending: 1, Oldest: time.Now(), DeadLettersKnown: true, SampledAt: time.Now()})
	problems, err := testutil.CollectAndLint(b.c)
	require.NoError(t, err)
	require.Empty(t, problems)
	_, err = b.reg.Gather() // the pedantic registry checks descriptions and consistency
	require.NoError(t, err)
}

func TestConfig(t *testing.T) {
	t.Parallel()
	c, err := metrics.New(metrics.Config{})
	require.NoError(t, err)
	require.Equal(t, metrics.OutboxDefault, c.Outbox())
	require.Equal(t, relay.BacklogSampling{Interval: 30 * time.Second, Timeout: 5 * time.Second}, c.BacklogSampling())

	for _, cfg := range []metrics.Config{
		{Outbox: strings.Repeat("x", metrics.OutboxMaxLen+1)},
		{Outbox: "\xff"},
		{PublishBuckets: []float64{1, 1}},
		{CycleBuckets: []float64{}},
		{SampleTimeout: -time.Second},
	} {
		_, err := metrics.New(cfg)
		require.ErrorIs(t, err, metrics.ErrInvalidConfig, "%+v", cfg)
	}
}

// Collectors of different outboxes share a registry; two of one outbox
// collide instead of silently mixing.
func TestRegistryIsolation(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	for _, name := range []string{"orders", "billing"} {
		c, err := metrics.New(metrics.Config{Outbox: name})
		require.NoError(t, err)
		require.NoError(t, reg.Register(c))
		c.Published(relay.PublishEvent{Messages: 2, Acked: 2})
	}
	dup, err := metrics.New(metrics.Config{Outbox: "orders"})
	require.NoError(t, err)
	var are prometheus.AlreadyRegisteredError
	require.ErrorAs(t, reg.Register(dup), &are)

	n, err := testutil.GatherAndCount(reg, metrics.NameAcknowledged)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	// Nothing went to the global registry.
	n, err = testutil.GatherAndCount(prometheus.DefaultGatherer, metrics.NameAcknowledged)
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestRelayEvents(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{Outbox: "orders"})

	// Every label value exists before the first event.
	require.Equal(t, map[string]float64{"kind=retryable": 0, "kind=permanent": 0, "kind=unavailable": 0, "kind=timeout": 0},
		b.series(t, metrics.NamePublishFailures))
	require.Equal(t, map[string]float64{"state=failed": 0, "state=parked": 0}, b.series(t, metrics.NameDeadLettered))

	b.c.OwnedBuckets(3)
	b.c.LeasesAcquired(3)
	b.c.LeasesAcquired(1)
	b.c.LeasesExpired(2)
	b.c.Published(relay.PublishEvent{Bucket: 1, Messages: 10, Acked: 10, Duration: 20 * time.Millisecond})
	b.c.Published(relay.PublishEvent{Bucket: 1, Messages: 10, Acked: 4, Duration: time.Second, Err: errors.New("broker down")})
	b.c.Published(relay.PublishEvent{Bucket: 2, Messages: 1, Err: relay.Permanent(errors.New("too large"))})
	b.c.Published(relay.PublishEvent{Bucket: 2, Messages: 5, Acked: 1, Cancelled: true})
	b.c.Published(relay.PublishEvent{Bucket: 3, Messages: 5, Err: relay.Unavailable(errors.New("connection refused"))})
	b.c.Published(relay.PublishEvent{Bucket: 3, Messages: 5, Err: relay.Unavailable(fmt.Errorf("%w: after 1m", relay.ErrPublishTimeout))})
	b.c.CycleFinished(5 * time.Millisecond)
	b.c.MessagesDeadLettered(1, false)
	b.c.MessagesDeadLettered(7, true)
	b.c.MessagesDeadLettered(0, true)

	require.Equal(t, map[string]float64{"": 3}, b.series(t, metrics.NameOwnedBuckets))
	require.Equal(t, map[string]float64{"": 4}, b.series(t, metrics.NameLeaseAcquisitions))
	require.Equal(t, map[string]float64{"": 2}, b.series(t, metrics.NameLeaseExpirations))
	require.Equal(t, map[string]float64{"": 15}, b.series(t, metrics.NameAcknowledged))
	require.Equal(t, 15.0, b.c.Acknowledged(), "the counter's value, read directly")
	require.Equal(t, map[string]float64{"kind=retryable": 1, "kind=permanent": 1, "kind=unavailable": 1, "kind=timeout": 1},
		b.series(t, metrics.NamePublishFailures))
	require.Equal(t, map[string]float64{"state=failed": 1, "state=parked": 7}, b.series(t, metrics.NameDeadLettered))
	require.Equal(t, map[string]float64{"": 6}, b.series(t, metrics.NamePublishDuration), "every call is timed")
	require.Equal(t, map[string]float64{"": 1}, b.series(t, metrics.NameCycleDuration))

	// The histogram is in seconds.
	require.NoError(t, testutil.CollectAndCompare(b.c, strings.NewReader(`
# HELP outbox_cycle_duration_seconds Duration of relay loop passes that did work (lease maintenance) and of discoveries.
# TYPE outbox_cycle_duration_seconds histogram
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.001"} 0
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.002"} 0
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.004"} 0
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.008"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.016"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.032"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.064"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.128"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.256"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="0.512"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="1.024"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="2.048"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="4.096"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="8.192"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="16.384"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="32.768"} 1
outbox_cycle_duration_seconds_bucket{outbox="orders",le="+Inf"} 1
outbox_cycle_duration_seconds_sum{outbox="orders"} 0.005
outbox_cycle_duration_seconds_count{outbox="orders"} 1
`), metrics.NameCycleDuration))
}

// backlogNames are the gauges that exist only while a sample does.
var backlogNames = []string{
	metrics.NamePending, metrics.NamePendingOldestAge, metrics.NameBucketPending,
	metrics.NameBucketOldestAge, metrics.NameDeadLetters, metrics.NamePendingSampleTime,
}

func requireUnavailable(t *testing.T, b *bundle) {
	t.Helper()
	require.Equal(t, map[string]float64{"": 0}, b.series(t, metrics.NamePendingAvailable))
	for _, name := range backlogNames {
		require.Empty(t, b.series(t, name), "%s must be absent, not zero, without a sample", name)
	}
	_, ok := b.c.Backlog()
	require.False(t, ok)
}

func TestBacklogUnavailableIsNotZero(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{Outbox: "orders"})
	requireUnavailable(t, b)

	now := time.Now()
	b.c.BacklogSampled(relay.Backlog{BucketCount: 4, SampledAt: now, DeadLettersKnown: true, PausedKnown: true})
	require.Equal(t, map[string]float64{"": 1}, b.series(t, metrics.NamePendingAvailable))
	require.Equal(t, map[string]float64{"": 0}, b.series(t, metrics.NamePausedBuckets), "none paused is zero")
	require.Equal(t, map[string]float64{"": 0}, b.series(t, metrics.NamePending), "a known empty backlog is zero")
	require.Equal(t, map[string]float64{"": 0}, b.series(t, metrics.NamePendingOldestAge))
	require.Equal(t, map[string]float64{"": 0}, b.series(t, metrics.NameDeadLetters))
	require.Len(t, b.series(t, metrics.NameBucketOldestAge), 4)
	require.InDelta(t, float64(now.UnixNano())/1e9, b.series(t, metrics.NamePendingSampleTime)[""], 0.001)

	b.c.BacklogUnavailable(errors.New("timed out"))
	requireUnavailable(t, b)
}

func TestBacklogAges(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{Outbox: "orders"})
	now := time.Now()
	b.c.BacklogSampled(relay.Backlog{
		BucketCount: 4,
		Pending:     7,
		Oldest:      now.Add(-time.Hour),
		Buckets: []relay.BucketBacklog{ // out of order on purpose
			{Bucket: 3, Pending: 2, Oldest: now.Add(time.Minute)}, // a writer clock ahead
			{Bucket: 1, Pending: 5, Oldest: now.Add(-time.Hour)},
		},
		DeadLetters:      9,
		DeadLettersKnown: true,
		SampledAt:        now,
	})
	require.Equal(t, map[string]float64{"": 7}, b.series(t, metrics.NamePending))
	require.Equal(t, map[string]float64{"": 9}, b.series(t, metrics.NameDeadLetters))
	require.Empty(t, b.series(t, metrics.NamePausedBuckets), "paused buckets unknown")
	require.Equal(t, map[string]float64{"bucket=0": 0, "bucket=1": 5, "bucket=2": 0, "bucket=3": 2}, b.series(t, metrics.NameBucketPending))

	ages := b.series(t, metrics.NameBucketOldestAge)
	require.Equal(t, 0.0, ages["bucket=0"], "empty bucket")
	require.Equal(t, 0.0, ages["bucket=2"], "empty bucket")
	require.Equal(t, 0.0, ages["bucket=3"], "a future creation time is clamped")
	require.GreaterOrEqual(t, ages["bucket=1"], 3600.0)

	// The age grows between samples: it is computed at scrape time.
	total := b.series(t, metrics.NamePendingOldestAge)[""]
	require.GreaterOrEqual(t, total, 3600.0)
	require.Less(t, total, 3600.0+60)

	// A store that knows counts but not timestamps: ages are omitted, not 0.
	b.c.BacklogSampled(relay.Backlog{Pending: 3, Buckets: []relay.BucketBacklog{{Bucket: 2, Pending: 3}}, SampledAt: now})
	require.Equal(t, map[string]float64{"": 3}, b.series(t, metrics.NamePending))
	require.Empty(t, b.series(t, metrics.NamePendingOldestAge))
	require.Empty(t, b.series(t, metrics.NameBucketOldestAge))
	require.Empty(t, b.series(t, metrics.NameDeadLetters), "dead letters unknown")
	require.Equal(t, map[string]float64{"bucket=2": 3}, b.series(t, metrics.NameBucketPending), "bucket count unknown: only non-empty buckets")
}

func TestOmitBucketBacklog(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{OmitBucketBacklog: true})
	b.c.BacklogSampled(relay.Backlog{BucketCount: 8, Pending: 1, Oldest: time.Now(),
		Buckets: []relay.BucketBacklog{{Bucket: 5, Pending: 1, Oldest: time.Now()}}})
	require.Equal(t, map[string]float64{"": 1}, b.series(t, metrics.NamePending))
	require.Empty(t, b.series(t, metrics.NameBucketPending))
	require.Empty(t, b.series(t, metrics.NameBucketOldestAge))
}

// The collector is called from the relay's goroutines while scrapes run.
func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 200 {
			b.c.Published(relay.PublishEvent{Messages: 1, Acked: 1})
			b.c.OwnedBuckets(i % 8)
			if i%2 == 0 {
				b.c.BacklogSampled(relay.Backlog{BucketCount: 8, Pending: int64(i)})
			} else {
				b.c.BacklogUnavailable(nil)
			}
		}
	}()
	for range 50 {
		_, err := b.reg.Gather()
		require.NoError(t, err)
	}
	<-done
	require.Equal(t, map[string]float64{"": 200}, b.series(t, metrics.NameAcknowledged))
}

func ExampleNew() {
	registry := prometheus.NewRegistry() // yours; never the global one implicitly
	m, err := metrics.New(metrics.Config{Outbox: "orders", SampleOnBucketZeroOwnerOnly: true})
	if err != nil {
		panic(err)
	}
	registry.MustRegister(m)
	// r, err := relay.New(store, publisher, relay.Config{Observer: m})

	m.Published(relay.PublishEvent{Messages: 3, Acked: 3}) // what the relay calls
	families, _ := registry.Gather()
	for _, f := range families {
		switch f.GetName() {
		case metrics.NameAcknowledged:
			fmt.Println(f.GetName(), f.GetMetric()[0].GetCounter().GetValue())
		case metrics.NamePendingAvailable:
			fmt.Println(f.GetName(), f.GetMetric()[0].GetGauge().GetValue())
		}
	}
	// Output:
	// outbox_messages_acknowledged_total 3
	// outbox_pending_available 0
}

// TestPausedBuckets: the gauge counts the buckets an operator paused, at
// the last sample.
func TestPausedBuckets(t *testing.T) {
	t.Parallel()
	b := setup(t, metrics.Config{Outbox: "orders"})
	b.c.BacklogSampled(relay.Backlog{BucketCount: 8, Paused: []int{2, 5}, PausedKnown: true, SampledAt: time.Now()})
	require.Equal(t, map[string]float64{"": 2}, b.series(t, metrics.NamePausedBuckets))
	b.c.BacklogSampled(relay.Backlog{BucketCount: 8, Paused: []int{5}, PausedKnown: true, SampledAt: time.Now()})
	require.Equal(t, map[string]float64{"": 1}, b.series(t, metrics.NamePausedBuckets))
}
