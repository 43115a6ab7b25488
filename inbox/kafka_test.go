package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// kafkaDeadline bounds every wait on the brokers and the consumers: a
// deadline for a hung run, far above what the tests take.
const kafkaDeadline = 3 * time.Minute

// consumer is one member of a consumer group running the inbox adapter.
type consumer struct {
	group  sarama.ConsumerGroup
	cancel context.CancelFunc
	done   chan struct{}
}

// startConsumer joins group on topic. With autoCommit false the marked
// offsets are never committed, so stopping it is a crash as far as the
// group's offsets go: the next member re-reads everything it read.
func startConsumer(t *testing.T, brokers []string, group, topic string, ib *inbox.Inbox, h inbox.Handler, autoCommit bool) *consumer {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.ClientID = "inbox-test"
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Offsets.AutoCommit.Enable = autoCommit
	cfg.Consumer.Offsets.AutoCommit.Interval = 100 * time.Millisecond
	cfg.Consumer.Group.Rebalance.Retry.Backoff = 100 * time.Millisecond
	cfg.Metadata.Retry.Backoff = 100 * time.Millisecond
	cfg.Consumer.Retry.Backoff = 100 * time.Millisecond
	g, err := sarama.NewConsumerGroup(brokers, group, cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	c := &consumer{group: g, cancel: cancel, done: make(chan struct{})}
	handler := ib.ConsumerGroupHandler(h)
	go func() {
		defer close(c.done)
		for ctx.Err() == nil {
			if err := g.Consume(ctx, []string{topic}, handler); err != nil && !errors.Is(err, sarama.ErrClosedConsumerGroup) && ctx.Err() == nil {
				t.Logf("consume: %v", err)
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond): // retry pause of a failed join
				}
			}
		}
	}()
	t.Cleanup(c.stop)
	return c
}

// stop leaves the group: the session ends, in-flight records finish or
// are left unmarked, marked offsets are committed (with auto-commit).
func (c *consumer) stop() {
	c.cancel()
	<-c.done
	_ = c.group.Close()
}

func newKafka(t *testing.T, brokers []string) *publisher.Kafka {
	t.Helper()
	return publishertest.StartKafka(t, publisher.KafkaConfig{
		Brokers: brokers,
		Configure: func(c *sarama.Config) error {
			c.Producer.Retry.Backoff = 10 * time.Millisecond
			c.Metadata.Retry.Backoff = 10 * time.Millisecond
			return nil
		},
		Logger: testLogger(t),
	})
}

// failFirstAttempt runs h, then fails the first attempt at every record
// (by message id) that fails selects, so that its transaction, with what h
// wrote, rolls back and the record is processed again.
func failFirstAttempt(h inbox.Handler, fails func(rec inbox.Record, id []byte) bool) inbox.Handler {
	var failed sync.Map
	return func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
		id, _ := rec.Header(inbox.MessageIDHeaderDefault)
		if err := h(ctx, tx, rec); err != nil {
			return err
		}
		if _, again := failed.LoadOrStore(string(id), true); !again && fails(rec, id) {
			return errors.New("first attempt fails")
		}
		return nil
	}
}

// The consumer-group adapter: a duplicate record is skipped, a failing
// handler is retried until it applies the record once, and offsets are
// marked only after the commit, so a restarted member resumes after the
// last processed record instead of re-reading the topic.
func TestConsumerGroupHandler(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		cluster := kafkatest.Start(t)
		topic := cluster.Topic(t, 2)
		m, err := metrics.NewInbox(metrics.InboxConfig{})
		require.NoError(t, err)
		b := setup(t, db, inbox.Config{Observer: m})
		pub := newKafka(t, cluster.Brokers())
		ctx := context.Background()

		msgs := make([]relay.Message, 10)
		for i := range msgs {
			msgs[i] = relay.Message{MessageID: fmt.Sprintf("msg-%d", i), Topic: topic, Key: fmt.Appendf(nil, "k%d", i%3), Value: []byte("v")}
		}
		// Every message once, then five of them again: what a relay that
		// lost its lease after publishing leaves on the topic.
		n, err := pub.Publish(ctx, append(append([]relay.Message{}, msgs...), msgs[:5]...))
		require.NoError(t, err)
		require.Equal(t, 15, n)

		var calls atomic.Int32
		handler := failFirstAttempt(apply("g", &calls), func(rec inbox.Record, id []byte) bool {
			return len(id) > 0 && id[len(id)-1]%3 == 0 // msg-0, msg-3, msg-6, msg-9
		})
		group := dbtest.Name("g_")
		c1 := startConsumer(t, cluster.Brokers(), group, topic, b.inbox, handler, true)
		assert.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Equal(c, 10.0, counterValue(t, m, metrics.NameInboxProcessed, ""))
			assert.Equal(c, 5.0, counterValue(t, m, metrics.NameInboxDuplicates, ""))
		}, kafkaDeadline, 20*time.Millisecond)
		c1.stop()
		require.Equal(t, 4.0, counterValue(t, m, metrics.NameInboxFailures, metrics.KindHandler))
		for _, msg := range msgs {
			require.EqualValues(t, 1, b.applied(t, msg.MessageID), msg.MessageID)
		}
		require.Len(t, b.recorded(t), 10)

		// The next member starts after the marked offsets: it sees only
		// the new record.
		_, err = pub.Publish(ctx, []relay.Message{{MessageID: "msg-new", Topic: topic, Key: []byte("k0"), Value: []byte("v")}})
		require.NoError(t, err)
		before := calls.Load()
		startConsumer(t, cluster.Brokers(), group, topic, b.inbox, handler, true)
		assert.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.EqualValues(c, 1, b.applied(t, "msg-new"))
		}, kafkaDeadline, 20*time.Millisecond)
		require.Equal(t, before+1, calls.Load(), "only the new record was handled")
		require.Equal(t, 5.0, counterValue(t, m, metrics.NameInboxDuplicates, ""), "nothing was redelivered")
	})
}

// dupPublisher publishes every third batch to Kafka and then reports it
// failed, as a relay does that crashes or loses its lease after the broker
// acknowledged: the relay publishes the batch again, so the topic holds
// duplicates of real outbox records.
type dupPublisher struct {
	relay.Publisher
	calls atomic.Int64
}

func (p *dupPublisher) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	n, err := p.Publisher.Publish(ctx, msgs)
	if err == nil && p.calls.Add(1)%3 == 0 {
		return 0, errors.New("acknowledged, but the relay did not see it")
	}
	return n, err
}

// End to end: orders written with their events through the outbox, relays
// that publish duplicates and are killed and replaced, Kafka, consumer
// group members that crash (offsets not committed), restart and rebalance,
// and a handler that fails first attempts. Every event's effect is
// applied exactly once: one business row per message.
func TestEndToEndExactlyOnceEffects(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const orders = 60
		cluster := kafkatest.Start(t)
		topic := cluster.Topic(t, 3)
		m, err := metrics.NewInbox(metrics.InboxConfig{})
		require.NoError(t, err)
		b := setup(t, db, inbox.Config{Observer: m})
		ctx := context.Background()
		p, err := outbox.Lookup(db.DB, "")
		require.NoError(t, err)
		store, err := gormrelay.NewStore(db.DB, p.Config())
		require.NoError(t, err)
		pub := &dupPublisher{Publisher: newKafka(t, cluster.Brokers())}

		write := func(from, to int) {
			for i := from; i < to; i++ {
				require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
					return outbox.EnqueueJSON(tx, topic, fmt.Appendf(nil, "order-%d", i%7), map[string]int{"order": i})
				}))
			}
		}
		var relays []*relay.Relay
		startRelay := func(id string) *relay.Relay {
			r, err := relay.New(store, pub, relay.Config{
				RelayID: id, BatchSize: 5, PollInterval: 50 * time.Millisecond,
				LeaseDuration: 2 * time.Second, LeaseRenewInterval: 500 * time.Millisecond,
				BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond,
				Hints: p.Notifier(), Logger: testLogger(t),
			})
			require.NoError(t, err)
			require.NoError(t, r.Start(ctx))
			relays = append(relays, r)
			return r
		}
		// kill stops a relay without a grace period: its in-flight batch
		// is abandoned and its leases are left to expire.
		kill := func(r *relay.Relay) {
			dead, cancel := context.WithCancel(ctx)
			cancel()
			_ = r.Stop(dead)
			<-r.Stopped()
		}
		t.Cleanup(func() {
			for _, r := range relays {
				kill(r)
			}
		})

		var calls atomic.Int32
		handler := failFirstAttempt(apply("e2e", &calls), func(rec inbox.Record, _ []byte) bool { return rec.Offset%4 == 0 })
		appliedRows := func() int64 {
			var n int64
			assert.NoError(t, db.DB.Model(&Applied{}).Count(&n).Error)
			return n
		}
		waitApplied := func(atLeast int64) {
			t.Helper()
			assert.EventuallyWithT(t, func(c *assert.CollectT) {
				assert.GreaterOrEqual(c, appliedRows(), atLeast)
			}, kafkaDeadline, 20*time.Millisecond)
		}
		group := dbtest.Name("g_")
		brokers := cluster.Brokers()

		write(0, orders/2)
		r1 := startRelay("relay-1")
		c1 := startConsumer(t, brokers, group, topic, b.inbox, handler, false)
		waitApplied(10)
		c1.stop() // crashed: its offsets were never committed
		kill(r1)

		write(orders/2, orders)
		r2 := startRelay("relay-2")
		c2 := startConsumer(t, brokers, group, topic, b.inbox, handler, true)
		waitApplied(orders * 3 / 4)
		kill(r2)
		c2.stop()
		startRelay("relay-3")
		startConsumer(t, brokers, group, topic, b.inbox, handler, true)
		startConsumer(t, brokers, group, topic, b.inbox, handler, true) // a rebalance splits the partitions
		waitApplied(orders)

		// Everything was published and everything published was consumed.
		assert.EventuallyWithT(t, func(c *assert.CollectT) {
			var pending int64
			assert.NoError(c, db.DB.Table(p.Config().Tables.MessagesTable()).Count(&pending).Error)
			assert.Zero(c, pending)
			consumed := counterValue(t, m, metrics.NameInboxProcessed, "") + counterValue(t, m, metrics.NameInboxDuplicates, "")
			assert.GreaterOrEqual(c, consumed, float64(cluster.RecordCount(t, topic)))
		}, kafkaDeadline, 50*time.Millisecond)

		require.Greater(t, cluster.RecordCount(t, topic), int64(orders), "the relays published duplicates")
		require.Positive(t, counterValue(t, m, metrics.NameInboxDuplicates, ""), "the inbox skipped them")
		require.Positive(t, counterValue(t, m, metrics.NameInboxFailures, metrics.KindHandler))
		var twice []string
		require.NoError(t, db.DB.Model(&Applied{}).Select("message_id").Group("message_id").Having("COUNT(*) > 1").Find(&twice).Error)
		require.Empty(t, twice, "effects applied more than once")
		require.EqualValues(t, orders, appliedRows(), "one business row per message")
		require.Len(t, b.recorded(t), orders)
	})
}
