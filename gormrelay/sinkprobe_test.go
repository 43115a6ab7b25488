package gormrelay_test

import (
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// outageTimes records when the relay's publishes failed as unavailable
// and when they succeeded.
type outageTimes struct {
	relay.NopObserver
	mu          sync.Mutex
	unavailable []time.Time
	ok          []time.Time
}

func (p *outageTimes) Published(e relay.PublishEvent) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case e.Err == nil && !e.Cancelled:
		p.ok = append(p.ok, now)
	case relay.IsUnavailable(e.Err):
		p.unavailable = append(p.unavailable, now)
	}
}

func (p *outageTimes) get() (unavailable, ok []time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.unavailable), slices.Clone(p.ok)
}

// recovery is what one broker outage came to.
type recovery struct {
	failures    int           // unavailable publishes before the brokers came back
	backoffLeft time.Duration // the least the bucket's backoff still had to run then
	firstAfter  time.Duration // from the brokers answering again to the first publish that succeeded
}

// outageFailures is how many publishes fail during an outage before the
// brokers come back: the bucket then backs off for at least
// BackoffMin·2^(outageFailures-1)/2.
const outageFailures = 4

// kafkaOutage publishes one message through a Kafka publisher (kfake)
// while every broker drops its connections, until outageFailures
// publishes failed as unavailable; then the brokers answer again, and it
// waits until the message is delivered. With probe false, the relay gets
// the publisher without its SinkProber.
func kafkaOutage(t *testing.T, db *dbtest.DB, probe bool) recovery {
	b := newStoreBundle(t, db, outbox.Config{})
	cluster := kafkatest.Start(t, kafkatest.InProcess())
	topic := cluster.Topic(t, 1)
	down := newOutage(cluster.RequireFake(t))
	k := publishertest.StartKafka(t, publisher.KafkaConfig{
		Brokers:   cluster.Brokers(),
		Logger:    dbtest.Logger(t),
		Configure: outageSarama,
	})
	var pub relay.Publisher = k
	if !probe {
		pub = relay.PublisherFunc(k.Publish)
	}
	times := &outageTimes{}
	cfg := b.relayConfig(t, "sinkprobe")
	cfg.BackoffMin, cfg.BackoffMax = 2*time.Second, 10*time.Minute
	cfg.Observer = times
	down.on.Store(true)
	startRelay(t, b.store, pub, cfg)
	b.insert(t, outbox.MessageRow{Topic: topic, Key: []byte("k"), Value: []byte("v")})

	require.EventuallyWithT(t, func(c *assert.CollectT) {
		failed, _ := times.get()
		assert.GreaterOrEqual(c, len(failed), outageFailures)
	}, 5*time.Minute, 10*time.Millisecond)
	down.on.Store(false)
	back := time.Now()
	failed, _ := times.get()
	last := failed[len(failed)-1]
	// The backoff after the n-th failure is BackoffMin doubled n-1 times,
	// its upper half jittered.
	minBackoff := cfg.BackoffMin << (len(failed) - 1) / 2
	b.requireDrained(t)
	failedAfter, ok := times.get()
	require.Len(t, failedAfter, len(failed), "no publish failed after the brokers came back")
	require.NotEmpty(t, ok)
	return recovery{failures: len(failed), backoffLeft: last.Add(minBackoff).Sub(back), firstAfter: ok[0].Sub(back)}
}

// Once the brokers answer again, the relay publishes the bucket that
// backs off after unavailable publishes at the first probe that answers,
// while the bucket's backoff still had seconds to run.
func TestKafkaReturnEndsTheBackoff(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		r := kafkaOutage(t, db, true)
		require.Less(t, r.firstAfter, r.backoffLeft,
			"published before the backoff after %d failed publishes ended", r.failures)
		t.Logf("the first publish came %s after the brokers answered again; the backoff had at least %s to run",
			r.firstAfter.Round(time.Millisecond), r.backoffLeft.Round(time.Millisecond))
	})
}

// TestMeasureKafkaReturn measures, when OUTBOX_MEASURE_SINK_PROBE is set,
// the time from the brokers (kfake) answering again to the first publish,
// without and with the sink probe, alternating, three of each, on
// SQLite.
func TestMeasureKafkaReturn(t *testing.T) {
	if os.Getenv("OUTBOX_MEASURE_SINK_PROBE") == "" {
		t.Skip("set OUTBOX_MEASURE_SINK_PROBE=1 to measure")
	}
	var without, with []time.Duration
	for i := range 6 {
		probe := i%2 == 1
		t.Run(map[bool]string{false: "without", true: "with"}[probe], func(t *testing.T) {
			r := kafkaOutage(t, dbtest.Open(t, dbtest.SQLite), probe)
			if probe {
				with = append(with, r.firstAfter)
			} else {
				without = append(without, r.firstAfter)
			}
		})
	}
	median := func(ds []time.Duration) time.Duration {
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	t.Logf("from the brokers answering again to the first publish: without the probe %v (median %s), with it %v (median %s)",
		without, median(without).Round(time.Millisecond), with, median(with).Round(time.Millisecond))
}

// TestMeasureKafkaNodeReturn measures, when OUTBOX_MEASURE_KAFKA_NODE is
// set, the same as TestMeasureKafkaReturn against the one-node Apache
// Kafka of scripts/kafka.sh (KAFKA_BROKERS, OUTBOX_KAFKA_DIR and
// OUTBOX_KAFKA_PORT set for it), which it kills and starts again, with the
// relay's default backoff (500ms doubling to 30s): the node is started
// once seven publishes failed, the time is taken from the first
// ApiVersions answer of the restarted node.
func TestMeasureKafkaNodeReturn(t *testing.T) {
	if os.Getenv("OUTBOX_MEASURE_KAFKA_NODE") == "" || os.Getenv(kafkatest.EnvBrokers) == "" {
		t.Skip("set OUTBOX_MEASURE_KAFKA_NODE=1 and KAFKA_BROKERS to measure")
	}
	script := func(args ...string) {
		out, err := exec.Command("../scripts/kafka.sh", args...).CombinedOutput()
		require.NoError(t, err, "kafka.sh %v: %s", args, out)
	}
	answers := func(addr string) bool {
		b := sarama.NewBroker(addr)
		if b.Open(nil) != nil {
			return false
		}
		defer func() { _ = b.Close() }()
		_, err := b.ApiVersions(&sarama.ApiVersionsRequest{})
		return err == nil
	}
	var without, with []time.Duration
	for i := range 6 {
		probe := i%2 == 1
		t.Run(map[bool]string{false: "without", true: "with"}[probe], func(t *testing.T) {
			b := newStoreBundle(t, dbtest.Open(t, dbtest.SQLite), outbox.Config{})
			cluster := kafkatest.Start(t)
			topic := cluster.Topic(t, 1)
			k := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: cluster.Brokers(), Logger: dbtest.Logger(t)})
			var pub relay.Publisher = k
			if !probe {
				pub = relay.PublisherFunc(k.Publish)
			}
			times := &outageTimes{}
			cfg := b.relayConfig(t, "node")
			cfg.BackoffMin, cfg.BackoffMax = relay.BackoffMinDefault, relay.BackoffMaxDefault
			cfg.Observer = times
			startRelay(t, b.store, pub, cfg)
			b.insert(t, outbox.MessageRow{Topic: topic, Key: []byte("k"), Value: []byte("before")})
			b.requireDrained(t)

			script("kill", "1")
			b.insert(t, outbox.MessageRow{Topic: topic, Key: []byte("k"), Value: []byte("during")})
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				failed, _ := times.get()
				assert.GreaterOrEqual(c, len(failed), 7)
			}, 5*time.Minute, 10*time.Millisecond)
			script("start-node", "1")
			require.Eventually(t, func() bool { return answers(cluster.Brokers()[0]) }, 2*time.Minute, 20*time.Millisecond)
			back := time.Now()
			b.requireDrained(t)
			_, ok := times.get()
			var first time.Time
			for _, at := range ok {
				if at.After(back) {
					first = at
					break
				}
			}
			require.False(t, first.IsZero())
			d := first.Sub(back)
			t.Logf("first publish %s after the node answered", d.Round(time.Millisecond))
			if probe {
				with = append(with, d)
			} else {
				without = append(without, d)
			}
		})
	}
	median := func(ds []time.Duration) time.Duration {
		slices.Sort(ds)
		return ds[len(ds)/2]
	}
	t.Logf("from the node answering again to the first publish: without the probe %v (median %s), with it %v (median %s)",
		without, median(without).Round(time.Millisecond), with, median(with).Round(time.Millisecond))
}
