package gormrelay_test

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// outage makes the cluster drop every connection, for every request,
// while it is on: to a client, every broker is down.
type outage struct{ on atomic.Bool }

func newOutage(fake *kfake.Cluster) *outage {
	o := &outage{}
	fake.Control(func(kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if o.on.Load() {
			return nil, errors.New("outage: connection dropped"), true
		}
		return nil, nil, false
	})
	return o
}

// outageSarama keeps the producer's retries and timeouts short, so that
// a publish fails within seconds of an outage.
func outageSarama(sc *sarama.Config) error {
	sc.Producer.Retry.Max = 2
	sc.Producer.Retry.Backoff = 10 * time.Millisecond
	sc.Producer.Timeout = time.Second
	sc.Metadata.Retry.Max = 1
	sc.Metadata.Retry.Backoff = 10 * time.Millisecond
	sc.Net.DialTimeout = time.Second
	sc.Net.ReadTimeout = time.Second
	sc.Net.WriteTimeout = time.Second
	return nil
}

// publishStats counts the relay's publish outcomes.
type publishStats struct {
	relay.NopObserver
	mu          sync.Mutex
	unavailable int
	other       []error
}

func (s *publishStats) Published(e relay.PublishEvent) {
	if e.Err == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if relay.IsUnavailable(e.Err) {
		s.unavailable++
	} else {
		s.other = append(s.other, e.Err)
	}
}

func (s *publishStats) get() (int, []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.unavailable, append([]error(nil), s.other...)
}

// TestBrokerOutageIsNotPoison runs the default failure policy through a
// broker outage with the timing scaled down: the outage lasts many times
// MaxAttempts × BackoffMax (the scaled equivalent of a ten-minute outage
// with the defaults). Nothing is dead-lettered, and once the cluster is
// back everything is delivered, every key in order, without an operator.
func TestBrokerOutageIsNotPoison(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})
		cluster := kafkatest.Start(t)
		fake := cluster.RequireFake(t)
		topic := cluster.Topic(t, 3)
		down := newOutage(fake)

		k := publishertest.StartKafka(t, publisher.KafkaConfig{
			Brokers:   cluster.Brokers(),
			Logger:    dbtest.Logger(t),
			Configure: outageSarama,
		})

		const maxAttempts = 3
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{MaxAttempts: maxAttempts, Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		stats := &publishStats{}
		cfg := b.relayConfig(t, "outage")
		cfg.FailureHandler = policy
		cfg.Observer = stats
		startRelay(t, b.store, k, cfg)

		keys := keysN(12)
		rows := func(from, to int) []outbox.MessageRow {
			var out []outbox.MessageRow
			for seq := from; seq < to; seq++ {
				for _, key := range keys {
					out = append(out, outbox.MessageRow{
						MessageID: fmt.Sprintf("%s-%d", key, seq),
						Topic:     topic,
						Key:       []byte(key),
						Value:     fmt.Appendf(nil, "%s/%d", key, seq),
					})
				}
			}
			return out
		}
		b.insert(t, rows(0, 5)...)
		waitEmpty := func(within time.Duration) {
			t.Helper()
			require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, b.count(t)) }, within, 20*time.Millisecond)
		}
		waitEmpty(30 * time.Second)

		// The outage: every broker refuses, while writers go on.
		down.on.Store(true)
		outageStart := time.Now()
		b.insert(t, rows(5, 25)...)
		// Outlast MaxAttempts many times over in every bucket that holds
		// messages.
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			n, _ := stats.get()
			assert.GreaterOrEqual(c, n, 3*maxAttempts*cfg.BucketCount)
		}, 2*time.Minute, 20*time.Millisecond)
		unavailable, other := stats.get()
		require.Empty(t, b.deadRows(t), "an outage dead-letters nothing")

		// Back up: everything drains without an operator.
		down.on.Store(false)
		back := time.Now()
		outageLen := back.Sub(outageStart)
		waitEmpty(2 * time.Minute)
		drained := time.Since(back)
		require.Empty(t, b.deadRows(t), "nothing dead-lettered or parked")
		t.Logf("outage: %s long (%.0f × MaxAttempts × BackoffMax), %d unavailable publishes, %d other failures (%v); 0 dead letters; the backlog drained %s after the brokers came back",
			outageLen.Round(time.Millisecond), float64(outageLen)/float64(maxAttempts*cfg.BackoffMax), unavailable, len(other), other, drained.Round(time.Millisecond))

		// Every message arrived. Per-key order of first deliveries is
		// reported, not failed on: the order gate closes the retry paths,
		// but the publisher package documentation ("order under failures")
		// names what it cannot see.
		want := len(keys) * 25
		recs := cluster.ReadAll(t, topic, want, 30*time.Second)
		next := map[string]int{}
		seen := map[string]bool{}
		late := 0
		for _, r := range recs {
			key, seqText, ok := strings.Cut(string(r.Value), "/")
			require.True(t, ok)
			seq, err := strconv.Atoi(seqText)
			require.NoError(t, err)
			if seen[string(r.Value)] {
				continue // a duplicate
			}
			seen[string(r.Value)] = true
			if seq < next[key] {
				late++
			}
			next[key] = max(next[key], seq+1)
		}
		for _, key := range keys {
			for seq := range 25 {
				require.True(t, seen[fmt.Sprintf("%s/%d", key, seq)], "key %s seq %d delivered", key, seq)
			}
		}
		t.Logf("outage: %d records for %d messages, %d first deliveries after a later message of their key", len(recs), want, late)
	})
}
