package pgwal_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/internal/promtest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

type env struct {
	db     *dbtest.DB
	plugin *outbox.Plugin
	kafka  *kafkatest.Cluster
	topic  string
	pub    *publisher.Kafka
}

func setup(t *testing.T) *env {
	t.Helper()
	dbt, p := pgwal.OpenWALOutbox(t)
	k := kafkatest.Start(t)
	topic := k.Topic(t, 4)
	pub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: k.Brokers(), Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, pub.Start(context.Background()))
	t.Cleanup(func() { _ = pub.Stop(context.Background()) })
	return &env{db: dbt, plugin: p, kafka: k, topic: topic, pub: pub}
}

// reader makes a reader with short leases; the slot and its publication
// are dropped when the test ends.
func (e *env) reader(t *testing.T, pub relay.Publisher, id string, tune ...func(*pgwal.Config)) *pgwal.Reader {
	t.Helper()
	cfg := pgwal.Config{
		ReplicationDSN: dbtest.PostgresWALDSN(), RelayID: id,
		LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BatchSize: 20, BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
		Logger: dbtest.Logger(t),
	}
	for _, f := range tune {
		f(&cfg)
	}
	r, err := pgwal.New(e.db.DB, e.plugin, pub, cfg)
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(context.Background()), "the slot exists before anything is written")
	slot := r.Config().Slot
	t.Cleanup(func() {
		if stop, ok := running.LoadAndDelete(r); ok {
			_ = stop.(func() error)()
		}
		// The slot is dropped once no reader holds it.
		require.Eventually(t, func() bool {
			return e.db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ? AND NOT active", slot).Error == nil &&
				!slotExists(e.db.DB, slot)
		}, 30*time.Second, 50*time.Millisecond)
		_ = e.db.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})
	return r
}

func slotExists(db *gorm.DB, slot string) bool {
	var n int64
	_ = db.Raw("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&n).Error
	return n > 0
}

// run runs r until the returned stop is called; stop returns Run's error.
func run(r *pgwal.Reader) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stop = sync.OnceValue(func() error { cancel(); return <-done })
	running.Store(r, stop)
	return stop
}

// running holds the stop of each reader run started, so that the cleanup
// of a failed test stops its reader before dropping the slot: a slot
// left active cannot be dropped, and leaked slots fill the server's
// max_replication_slots for every later test.
var running sync.Map // *pgwal.Reader -> func() error

// publishPoisoned publishes msgs to Kafka, and when poisoned fails
// permanently at k0:3 after publishing the messages before it.
func (e *env) publishPoisoned(ctx context.Context, msgs []relay.Message, poisoned bool) (int, error) {
	for i, m := range msgs {
		if poisoned && string(m.Value) == "k0:3" {
			n, err := e.pub.Publish(ctx, msgs[:i])
			if err != nil {
				return n, err
			}
			return i, relay.Permanent(fmt.Errorf("poison %s", m.Value))
		}
	}
	return e.pub.Publish(ctx, msgs)
}

// write commits n messages of key k with values "k:from".. in
// transactions of up to 3 messages.
func (e *env) write(t *testing.T, keys, from, to int) {
	t.Helper()
	for seq := from; seq < to; {
		require.NoError(t, e.db.Transaction(func(tx *gorm.DB) error {
			for i := 0; i < 3 && seq < to; i++ {
				for k := range keys {
					key := "k" + strconv.Itoa(k)
					if err := outbox.Enqueue(tx, &outbox.Message{Topic: e.topic, Key: []byte(key), Value: []byte(key + ":" + strconv.Itoa(seq))}); err != nil {
						return err
					}
				}
				seq++
			}
			return nil
		}))
	}
}

// checkDelivered waits until every key has every value 0..n-1 in Kafka,
// and checks that each key's values first appear in order.
func (e *env) checkDelivered(t *testing.T, keys, n int) (records int) {
	t.Helper()
	var (
		recs    []kafkatest.Record
		missing []string
	)
	require.Eventually(t, func() bool {
		recs = e.kafka.ReadLog(t, e.topic, 30*time.Second)
		seen := map[string]bool{}
		for _, r := range recs {
			seen[string(r.Value)] = true
		}
		missing = missing[:0]
		for k := range keys {
			for i := range n {
				if v := "k" + strconv.Itoa(k) + ":" + strconv.Itoa(i); !seen[v] {
					missing = append(missing, v)
				}
			}
		}
		return len(missing) == 0
	}, 60*time.Second, 100*time.Millisecond, "every message reaches Kafka: missing %v", &missing)
	next := map[string]int{}
	for _, r := range recs { // ordered by partition, then offset: per-key order
		key, seqText, _ := strings.Cut(string(r.Value), ":")
		seq, err := strconv.Atoi(seqText)
		require.NoError(t, err)
		require.Equal(t, key, string(r.Key))
		switch {
		case seq == next[key]:
			next[key]++
		case seq < next[key]: // a duplicate of a message already seen
		default:
			t.Fatalf("key %s: %d arrived before %d", key, seq, next[key])
		}
	}
	return len(recs)
}

// TestReaderPublishesInOrder: messages written in WAL mode reach Kafka
// once each, in per-key order, and the slot's confirmed position moves
// past them.
func TestReaderPublishesInOrder(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	e.write(t, 5, 0, 40)
	require.Equal(t, 5*40, e.checkDelivered(t, 5, 40), "no duplicates without a failure")
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && st.Exists && st.Confirmed >= r.Stats().Confirmed && r.Stats().Published == 200 &&
			r.Stats().Confirmed > 0
	}, 30*time.Second, 50*time.Millisecond)
	reg := prometheus.NewRegistry()
	reg.MustRegister(r.Collector())
	name := e.plugin.Config().Name
	require.Equal(t, map[string]float64{"slot=" + r.Config().Slot: 200}, promtest.Series(t, reg, pgwal.NamePublished, name))
	require.Equal(t, map[string]float64{"slot=" + r.Config().Slot: 0}, promtest.Series(t, reg, pgwal.NameSlotLost, name))
	require.Len(t, promtest.Series(t, reg, pgwal.NameRetainedBytes, name), 1)
	require.NoError(t, stop())
	var dead int64
	require.NoError(t, e.db.Table(e.plugin.Config().Tables.DeadLettersTable()).Count(&dead).Error)
	require.Zero(t, dead)
}

// TestReaderKilledMidStreamLosesNothing: a reader cancelled mid-stream
// (no graceful stop, its lease left to lapse) is replaced by another that
// replays from the confirmed position: every message arrives at least
// once, each key in order.
func TestReaderKilledMidStreamLosesNothing(t *testing.T) {
	e := setup(t)
	const keys, n = 8, 150
	slow := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		// Slower than the writer: messages wait in the queues, received
		// and reported in standby updates, when the reader dies.
		time.Sleep(30 * time.Millisecond)
		return e.pub.Publish(ctx, msgs)
	})
	a := e.reader(t, slow, "a", func(c *pgwal.Config) { c.BatchSize = 5 })
	stopA := run(a)
	var wg sync.WaitGroup
	wg.Go(func() { e.write(t, keys, 0, n) })
	require.Eventually(t, func() bool { return a.Stats().Published >= keys*n/4 }, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, stopA())
	killedAt := a.Stats()
	require.Less(t, killedAt.Published, uint64(keys*n), "the reader died before publishing everything")

	b := e.reader(t, e.pub, "b")
	stopB := run(b)
	wg.Wait()
	records := e.checkDelivered(t, keys, n)
	require.NoError(t, stopB())
	t.Logf("killed after %d published (confirmed %s); %d records for %d messages", killedAt.Published, killedAt.Confirmed, records, keys*n)
	// Duplicates are what the dead reader published, acknowledged or in
	// flight (a batch per bucket) when it died.
	inFlight := e.plugin.Config().BucketCount * a.Config().BatchSize
	require.LessOrEqual(t, records-keys*n, int(killedAt.Published)+inFlight, "duplicates are bounded")
}

// TestReaderSecondReaderWaits: while one reader holds the lease another
// does not read; it takes over when the first stops.
func TestReaderSecondReaderWaits(t *testing.T) {
	e := setup(t)
	a := e.reader(t, e.pub, "a")
	b := e.reader(t, e.pub, "b")
	stopA := run(a)
	e.write(t, 2, 0, 10)
	e.checkDelivered(t, 2, 10)
	stopB := run(b)
	e.write(t, 2, 10, 20)
	e.checkDelivered(t, 2, 20)
	require.Zero(t, b.Stats().Received, "the second reader waits while the first holds the lease")
	require.NoError(t, stopA())
	e.write(t, 2, 20, 30)
	e.checkDelivered(t, 2, 30)
	require.NotZero(t, b.Stats().Published)
	require.NoError(t, stopB())
}

// TestReaderFailures: an outage is retried without dead-lettering; a
// message that fails permanently is dead-lettered, its key's later
// messages parked behind it, and the other keys and the slot move on.
func TestReaderFailures(t *testing.T) {
	e := setup(t)
	var mu sync.Mutex
	outage := 5
	poison := true
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		mu.Lock()
		down := outage > 0
		if down {
			outage--
		}
		mu.Unlock()
		if down {
			return 0, relay.Unavailable(errors.New("broker down"))
		}
		mu.Lock()
		poisoned := poison
		mu.Unlock()
		return e.publishPoisoned(ctx, msgs, poisoned)
	})
	obs := &recorder{}
	r := e.reader(t, pub, "a", func(c *pgwal.Config) { c.Observer = obs })
	stop := run(r)
	e.write(t, 3, 0, 10)
	dl := e.plugin.Config().Tables.DeadLettersTable()
	var rows []outbox.DeadLetterRow
	require.Eventually(t, func() bool {
		rows = nil
		return e.db.Table(dl).Order("created_at_ms, id DESC").Find(&rows).Error == nil && len(rows) == 7
	}, 30*time.Second, 50*time.Millisecond)
	// k0:3 failed, k0:4..9 parked; k1 and k2 complete.
	states := map[string]string{}
	for _, row := range rows {
		states[string(row.Value)] = row.State
		require.Less(t, row.ID, int64(0), "WAL mode dead letters have negative ids")
		require.Equal(t, "k0", string(row.Key))
	}
	require.Equal(t, "failed", states["k0:3"])
	for i := 4; i < 10; i++ {
		require.Equal(t, "parked", states["k0:"+strconv.Itoa(i)])
	}
	var recs []kafkatest.Record
	require.Eventually(t, func() bool {
		recs = e.kafka.ReadLog(t, e.topic, 30*time.Second)
		return len(recs) == 23
	}, 30*time.Second, 50*time.Millisecond)
	mu.Lock()
	require.Zero(t, outage, "the outage was retried through")
	mu.Unlock()
	// The engine's observer events, as in table mode.
	got := obs.snapshot()
	require.GreaterOrEqual(t, got.deadFailed, 1, "the failed message reported dead-lettered")
	require.GreaterOrEqual(t, got.parked, 6, "the key's later messages reported parked")
	require.GreaterOrEqual(t, got.acked, 23, "the publishes reported")
	require.GreaterOrEqual(t, got.publishErr, 5, "the outage's and the poison's failed publishes reported")
	require.Equal(t, e.plugin.Config().BucketCount, got.owned, "the reader owns every bucket")
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && st.Confirmed > 0 && r.Stats().Confirmed >= st.Confirmed && st.Confirmed == r.Stats().Confirmed
	}, 30*time.Second, 50*time.Millisecond)

	// Requeue: the key's dead letters are emitted again in order and
	// removed, and the key flows again, later writes included.
	mu.Lock()
	poison = false
	mu.Unlock()
	termBefore := e.term(t, r)
	n, err := pgwal.RequeueKey(context.Background(), e.db.DB, e.plugin, []byte("k0"))
	require.NoError(t, err)
	require.Equal(t, 7, n)
	e.write(t, 1, 10, 12) // k0:10, k0:11
	want := make([]string, 12)
	for i := range want {
		want[i] = "k0:" + strconv.Itoa(i)
	}
	var k0 []string
	require.Eventually(t, func() bool {
		recs = e.kafka.ReadLog(t, e.topic, 30*time.Second)
		k0 = k0[:0]
		seen := map[string]bool{}
		for _, rec := range recs {
			if v := string(rec.Value); string(rec.Key) == "k0" && !seen[v] {
				seen[v] = true
				k0 = append(k0, v)
			}
		}
		return len(k0) == len(want)
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, want, k0, "the key in order")
	// Nothing twice while the reader kept its lease; on a machine busy
	// enough for a renewal to miss the lease, the next term publishes
	// again from the confirmed position (at-least-once).
	if termAfter := e.term(t, r); termAfter == termBefore {
		require.Len(t, recs, 32, "nothing twice within one term")
	} else {
		t.Logf("the lease was taken again (term %d to %d): %d records for 32 messages", termBefore, termAfter, len(recs))
	}
	var left int64
	require.NoError(t, e.db.Table(dl).Count(&left).Error)
	require.Zero(t, left)
	require.NoError(t, stop())
}

// TestReaderStopsOnDroppedSlot: a slot dropped while no reader ran is a
// *SlotLostError that Run returns; it is never silently recreated.
func TestReaderStopsOnDroppedSlot(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	e.write(t, 1, 0, 3)
	e.checkDelivered(t, 1, 3)
	require.Eventually(t, func() bool { return r.Stats().Confirmed > 0 }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, stop())
	slot := r.Config().Slot
	require.Eventually(t, func() bool {
		return e.db.Exec("SELECT pg_drop_replication_slot(?)", slot).Error == nil
	}, 30*time.Second, 50*time.Millisecond)
	e.write(t, 1, 3, 6) // lost: no slot holds them
	reg := prometheus.NewRegistry()
	reg.MustRegister(r.Collector())
	require.Equal(t, map[string]float64{"slot=" + slot: 1}, promtest.Series(t, reg, pgwal.NameSlotLost, e.plugin.Config().Name))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := r.Run(ctx)
	var lost *pgwal.SlotLostError
	require.ErrorAs(t, err, &lost)
	require.ErrorIs(t, err, pgwal.ErrSlotLost)
	require.Contains(t, err.Error(), "dropped")
	require.False(t, slotExists(e.db.DB, slot), "the slot is not created again silently")
}

// TestReaderStrictMode: the strict-mode publisher (Kafka transactions,
// one transactional id per bucket) works unchanged under a WAL reader: a
// read_committed consumer sees each key in order, once.
func TestReaderStrictMode(t *testing.T) {
	e := setup(t)
	tx := publishertest.StartTransactional(t, publisher.TransactionalConfig{
		Brokers:               e.kafka.Brokers(),
		TransactionalIDPrefix: fmt.Sprintf("wal-strict-%d-", time.Now().UnixNano()),
		Logger:                dbtest.Logger(t),
	})
	r := e.reader(t, tx, "a")
	stop := run(r)
	e.write(t, 4, 0, 15)
	require.Eventually(t, func() bool {
		return len(e.kafka.ReadLog(t, e.topic, 30*time.Second, kafkatest.ReadCommitted())) == 60
	}, 60*time.Second, 100*time.Millisecond)
	byKey := map[string][]string{}
	for _, rec := range e.kafka.ReadLog(t, e.topic, 30*time.Second, kafkatest.ReadCommitted()) {
		byKey[string(rec.Key)] = append(byKey[string(rec.Key)], string(rec.Value))
	}
	for k := range 4 {
		key := "k" + strconv.Itoa(k)
		want := make([]string, 15)
		for i := range want {
			want[i] = key + ":" + strconv.Itoa(i)
		}
		require.Equal(t, want, byKey[key])
	}
	require.NoError(t, stop())
}

// term is the reader lease's term for r's slot.
func (e *env) term(t *testing.T, r *pgwal.Reader) int64 {
	t.Helper()
	var term int64
	require.NoError(t, e.db.Table(r.Config().LeaseTable).Select("term").Where("slot = ?", r.Config().Slot).Scan(&term).Error)
	return term
}
