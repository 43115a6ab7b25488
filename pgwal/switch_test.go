package pgwal_test

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// Writer phases of the switch test.
const (
	phaseTable int32 = iota
	phaseMixed       // each write in table mode or WAL mode at random
	phaseWAL
)

// switchWriters write each key's messages k<i>:<seq> sequentially, so
// per key commit order is seq order, through a table-mode or a WAL-mode
// plugin on the same outbox as the phase says.
type switchWriters struct {
	phase atomic.Int32
	// used[k] is the phase key k's last committed write was made in.
	used []atomic.Int32
	next []atomic.Int64
	// wal and table count the writes made in each mode.
	wal, table atomic.Int64
	stop       chan struct{}
	wg         sync.WaitGroup
}

func startSwitchWriters(t *testing.T, keys int, topic string, walDB, tableDB *gorm.DB) *switchWriters {
	w := &switchWriters{used: make([]atomic.Int32, keys), next: make([]atomic.Int64, keys), stop: make(chan struct{})}
	for k := range keys {
		w.wg.Go(func() {
			key := "k" + strconv.Itoa(k)
			for {
				select {
				case <-w.stop:
					return
				default:
				}
				ph := w.phase.Load()
				toWAL := ph == phaseWAL || ph == phaseMixed && rand.IntN(2) == 0
				db := tableDB
				if toWAL {
					db = walDB
				}
				seq := w.next[k].Load()
				err := db.Transaction(func(tx *gorm.DB) error {
					return outbox.Enqueue(tx, &outbox.Message{Topic: topic, Key: []byte(key), Value: []byte(key + ":" + strconv.FormatInt(seq, 10))})
				})
				if err != nil {
					t.Errorf("write %s:%d: %v", key, seq, err)
					return
				}
				w.next[k].Add(1)
				w.used[k].Store(ph)
				if toWAL {
					w.wal.Add(1)
				} else {
					w.table.Add(1)
				}
			}
		})
	}
	t.Cleanup(w.halt)
	return w
}

// switchTo sets the phase and waits until every key committed a write
// in it: no write of the former phase commits after that.
func (w *switchWriters) switchTo(t *testing.T, ph int32) {
	t.Helper()
	defer func() { t.Logf("phase %d from %d", ph, w.next[0].Load()) }()
	w.phase.Store(ph)
	require.Eventually(t, func() bool {
		for k := range w.used {
			if w.used[k].Load() != ph {
				return false
			}
		}
		return true
	}, 60*time.Second, 10*time.Millisecond)
}

// writeMore waits until n more writes committed.
func (w *switchWriters) writeMore(t *testing.T, n int64) {
	t.Helper()
	from := w.wal.Load() + w.table.Load()
	require.Eventually(t, func() bool { return w.wal.Load()+w.table.Load() >= from+n }, 60*time.Second, 10*time.Millisecond)
}

// written returns each key's count of committed writes.
func (w *switchWriters) written() []int64 {
	out := make([]int64, len(w.next))
	for k := range w.next {
		out[k] = w.next[k].Load()
	}
	return out
}

// requireTableEmpty waits until the messages table is empty.
func (e *env) requireTableEmpty(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int64
		return e.db.Table(e.plugin.Config().Tables.Messages).Count(&n).Error == nil && n == 0
	}, 30*time.Second, 20*time.Millisecond, "the messages table ends empty")
}

func (w *switchWriters) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.wg.Wait()
}

// TestSwitchBothWays switches a service from table mode to WAL mode and
// back while writers in both modes write the same keys at the same time,
// through the staged procedure of docs/wal-mode.md: every message
// reaches Kafka, each key's messages first appear in commit order, and
// the messages table ends empty.
func TestSwitchBothWays(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tableDB, tablePlugin := e.tableSide(t)
	tablePub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: e.kafka.Brokers(), Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, tablePub.Start(ctx))
	t.Cleanup(func() { _ = tablePub.Stop(context.Background()) })
	startTableRelay := func(id string) *relay.Relay { return startTableRelay(t, tableDB, tablePlugin, tablePub, id) }

	const keys = 6
	w := startSwitchWriters(t, keys, e.topic, e.db.DB, tableDB)
	rl := startTableRelay("table-1")
	w.writeMore(t, 200)

	// Table → WAL. 1: a bridging slot, and the mark of what the table
	// held before it.
	r := e.reader(t, e.pub, "wal-1", func(c *pgwal.Config) { c.Bridge = true })
	mark, err := r.TableMark(ctx)
	require.NoError(t, err)
	require.Positive(t, mark)
	w.writeMore(t, 100)
	// 2: the table relays publish every row committed before the slot.
	require.Eventually(t, func() bool { ok, err := r.TableDrained(ctx, mark); return err == nil && ok }, 60*time.Second, 20*time.Millisecond)
	// 3: they stop; 4: the bridging reader runs.
	require.NoError(t, rl.Stop(ctx))
	require.Eventually(t, func() bool { ok, err := r.TableRelaysStopped(ctx); return err == nil && ok }, 30*time.Second, 20*time.Millisecond)
	t.Logf("reader starts at %d", w.next[0].Load())
	stopReader := run(r)
	w.writeMore(t, 100)
	// 5: the rolling deploy: writers of both modes at once, then WAL only.
	w.switchTo(t, phaseMixed)
	w.writeMore(t, 400)
	w.switchTo(t, phaseWAL)
	w.writeMore(t, 200)
	walWrites, tableWrites := w.wal.Load(), w.table.Load()

	// WAL → table: the reader still bridges; writers of both modes, then
	// table only.
	w.switchTo(t, phaseMixed)
	w.writeMore(t, 400)
	w.switchTo(t, phaseTable)
	w.writeMore(t, 100)
	// Everything committed before the mark is published; then the reader
	// stops and a table relay takes over.
	lsn, err := r.WALMark(ctx)
	require.NoError(t, err)
	require.Eventually(t, func() bool { ok, err := r.PublishedThrough(ctx, lsn); return err == nil && ok }, 60*time.Second, 20*time.Millisecond)
	require.NoError(t, stopReader())
	t.Logf("reader stopped at %d", w.next[0].Load())
	rl2 := startTableRelay("table-2")
	t.Cleanup(func() { _ = rl2.Stop(context.Background()) })
	w.writeMore(t, 200)
	w.halt()

	require.Greater(t, w.wal.Load(), walWrites, "WAL writes during the way back")
	require.Greater(t, walWrites, int64(0))
	require.Greater(t, w.table.Load(), tableWrites)
	st := r.Stats()
	require.Positive(t, st.Published)
	t.Logf("writes: %d WAL, %d table; reader published %d", w.wal.Load(), w.table.Load(), st.Published)

	checkKeysDelivered(t, e, w.written())
	e.requireTableEmpty(t)
}

// tableSide opens a second connection to e's schema with a table-mode
// plugin of the same outbox: the writers not switched yet.
func (e *env) tableSide(t *testing.T) (*gorm.DB, *outbox.Plugin) {
	t.Helper()
	tableDB, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	t.Cleanup(func() {
		if sqlDB, err := tableDB.DB(); err == nil {
			_ = sqlDB.Close()
		}
	})
	p, err := outbox.NewPlugin(outbox.Config{Name: e.plugin.Config().Name})
	require.NoError(t, err)
	require.NoError(t, tableDB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), tableDB))
	return tableDB, p
}

// startTableRelay starts a table-mode relay with short intervals.
func startTableRelay(t *testing.T, db *gorm.DB, p *outbox.Plugin, pub relay.Publisher, id string) *relay.Relay {
	t.Helper()
	rl, err := gormrelay.New(db, p, pub, gormrelay.WithRelayConfig(relay.Config{
		RelayID: id, BatchSize: 20, PollInterval: 50 * time.Millisecond, LeaseDuration: 2 * time.Second,
		LeaseRenewInterval: 200 * time.Millisecond, BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond,
		Logger: dbtest.Logger(t)}))
	require.NoError(t, err)
	require.NoError(t, rl.Start(context.Background()))
	return rl
}

// enqueue commits one message k:v through db.
func enqueue(t *testing.T, db *gorm.DB, topic, k string, v int) {
	t.Helper()
	require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: topic, Key: []byte(k), Value: []byte(k + ":" + strconv.Itoa(v))})
	}))
}

// TestBridgeKeepsTableDeadLetters: a key the table-mode relay
// dead-lettered before the switch stays parked behind its dead letter
// when the bridging reader takes over: its later messages, written in
// either mode, are parked in order (the table rows deleted), the other
// keys flow.
func TestBridgeKeepsTableDeadLetters(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tableDB, tablePlugin := e.tableSide(t)
	r := e.reader(t, e.pub, "wal-1", func(c *pgwal.Config) { c.Bridge = true })
	poison := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		for i, m := range msgs {
			if string(m.Value) == "k0:1" {
				n, err := e.pub.Publish(ctx, msgs[:i])
				if err != nil {
					return n, err
				}
				return i, relay.Permanent(errors.New("poison k0:1"))
			}
		}
		return e.pub.Publish(ctx, msgs)
	})
	for v := range 3 {
		enqueue(t, tableDB, e.topic, "k0", v)
		enqueue(t, tableDB, e.topic, "k1", v)
	}
	rl := startTableRelay(t, tableDB, tablePlugin, poison, "table-1")
	dl := e.plugin.Config().Tables.DeadLettersTable()
	countDead := func() int64 {
		var n int64
		require.NoError(t, e.db.Table(dl).Count(&n).Error)
		return n
	}
	require.Eventually(t, func() bool { return countDead() == 2 }, 30*time.Second, 20*time.Millisecond, "k0:1 failed, k0:2 parked")
	require.Eventually(t, func() bool { ok, err := r.TableDrained(ctx, 1<<62); return err == nil && ok }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, rl.Stop(ctx))

	stop := run(r)
	t.Cleanup(func() { _ = stop() })
	enqueue(t, e.db.DB, e.topic, "k0", 3)
	enqueue(t, tableDB, e.topic, "k0", 4)
	enqueue(t, e.db.DB, e.topic, "k1", 3)
	enqueue(t, tableDB, e.topic, "k1", 4)
	require.Eventually(t, func() bool { return countDead() == 4 }, 30*time.Second, 20*time.Millisecond, "k0:3 and k0:4 parked")
	var rows []outbox.DeadLetterRow
	require.NoError(t, e.db.Table(dl).Find(&rows).Error)
	for _, row := range rows {
		require.Equal(t, "k0", string(row.Key), "only k0 is dead-lettered")
	}
	checkKeysDelivered(t, e, []int64{1, 5})
	for _, rec := range e.kafka.ReadLog(t, e.topic, 30*time.Second) {
		require.NotContains(t, []string{"k0:1", "k0:2", "k0:3", "k0:4"}, string(rec.Value), "a parked message reached Kafka")
	}
	var left int64
	require.NoError(t, e.db.Table(e.plugin.Config().Tables.Messages).Count(&left).Error)
	require.Zero(t, left, "the parked table row left the messages table")

	// EndBridge: the table's rows are not the reader's any more.
	require.NoError(t, r.EndBridge(ctx))
	var pubTables int64
	require.NoError(t, e.db.Raw("SELECT count(*) FROM pg_publication_tables WHERE pubname = ?", r.Config().Slot).Scan(&pubTables).Error)
	require.Zero(t, pubTables)
	enqueue(t, tableDB, e.topic, "k1", 5)
	lsn, err := r.WALMark(ctx)
	require.NoError(t, err)
	require.Eventually(t, func() bool { ok, err := r.PublishedThrough(ctx, lsn); return err == nil && ok }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, e.db.Table(e.plugin.Config().Tables.Messages).Count(&left).Error)
	require.Equal(t, int64(1), left, "a row written after EndBridge stays for a table relay")
}

// TestBridgeWaitsForTableRelays: a bridging reader does not read while a
// table-mode relay holds leases, and reads once it stopped.
func TestBridgeWaitsForTableRelays(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tableDB, tablePlugin := e.tableSide(t)
	rl := startTableRelay(t, tableDB, tablePlugin, publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: e.kafka.Brokers()}), "table-1")
	logs := &dbtest.LogBuffer{}
	r := e.reader(t, e.pub, "wal-1", func(c *pgwal.Config) {
		c.Bridge = true
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	require.Eventually(t, func() bool { ok, err := r.TableRelaysStopped(ctx); return err == nil && !ok }, 30*time.Second, 20*time.Millisecond)
	stop := run(r)
	t.Cleanup(func() { _ = stop() })
	enqueue(t, e.db.DB, e.topic, "k0", 0)
	require.Eventually(t, func() bool { return strings.Count(logs.String(), pgwal.ErrTableRelaysRunning.Error()) >= 2 }, 30*time.Second, 20*time.Millisecond)
	require.Zero(t, r.Stats().Received, "nothing read while the table relay runs")
	require.NotContains(t, logs.String(), `msg="`+logReading+`"`, "a term that does not read does not say it reads")
	require.Zero(t, e.term(t, r), "the lease is not taken while the table relay runs: no term per retry")
	require.NoError(t, rl.Stop(ctx))
	checkKeysDelivered(t, e, []int64{1})
	require.Contains(t, logs.String(), `msg="`+logReading+`"`)
}

// TestBridgeKilledMidStream: a bridging reader cancelled mid-stream while
// writers of both modes write the same keys is replaced by another that
// replays from the confirmed position: rows the first one deleted are
// skipped, the others published again; every message arrives, each key
// in order, and the table ends empty.
func TestBridgeKilledMidStream(t *testing.T) {
	e := setup(t)
	tableDB, _ := e.tableSide(t)
	slow := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		time.Sleep(20 * time.Millisecond) // messages wait in the queues when the reader dies
		return e.pub.Publish(ctx, msgs)
	})
	bridge := func(c *pgwal.Config) { c.Bridge = true; c.BatchSize = 5 }
	a := e.reader(t, slow, "a", bridge)
	stopA := run(a)
	const keys = 6
	w := startSwitchWriters(t, keys, e.topic, e.db.DB, tableDB)
	w.switchTo(t, phaseMixed)
	require.Eventually(t, func() bool { return a.Stats().Published >= 200 }, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, stopA())
	require.Less(t, a.Stats().Published, a.Stats().Received, "the reader died with messages queued")

	b := e.reader(t, e.pub, "b", bridge)
	stopB := run(b)
	t.Cleanup(func() { _ = stopB() })
	w.writeMore(t, 200)
	w.halt()
	checkKeysDelivered(t, e, w.written())
	e.requireTableEmpty(t)
}

// TestBridgeStopsWhenATableRelayStarts: a table relay that starts while
// a bridging reader reads makes the reader stop reading and log an error;
// the reader reads again once the relay stopped.
func TestBridgeStopsWhenATableRelayStarts(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	tableDB, tablePlugin := e.tableSide(t)
	logs := &dbtest.LogBuffer{}
	r := e.reader(t, e.pub, "wal-1", func(c *pgwal.Config) {
		c.Bridge = true
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	stop := run(r)
	t.Cleanup(func() { _ = stop() })
	enqueue(t, e.db.DB, e.topic, "k0", 0)
	checkKeysDelivered(t, e, []int64{1})
	rl := startTableRelay(t, tableDB, tablePlugin, publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: e.kafka.Brokers()}), "table-1")
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), "a table-mode relay started while the reader bridges")
	}, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, rl.Stop(ctx))
	enqueue(t, e.db.DB, e.topic, "k0", 1)
	checkKeysDelivered(t, e, []int64{2})
}

// checkKeysDelivered waits until key k<i> has every value 0..last[i]-1 in
// Kafka and checks that each key's values first appear in order.
func checkKeysDelivered(t *testing.T, e *env, last []int64) {
	t.Helper()
	var missing []string
	var recs []kafkaRecord
	require.Eventually(t, func() bool {
		recs = recs[:0]
		for _, r := range e.kafka.ReadLog(t, e.topic, 30*time.Second) {
			recs = append(recs, kafkaRecord{key: string(r.Key), value: string(r.Value), offset: r.Offset, producer: r.ProducerID})
		}
		seen := map[string]bool{}
		for _, r := range recs {
			seen[r.value] = true
		}
		missing = missing[:0]
		for k, n := range last {
			for i := range n {
				if v := "k" + strconv.Itoa(k) + ":" + strconv.FormatInt(i, 10); !seen[v] {
					missing = append(missing, v)
				}
			}
		}
		return len(missing) == 0
	}, 90*time.Second, 200*time.Millisecond, "every message reaches Kafka: missing %v", &missing)
	next := map[string]int64{}
	for _, r := range recs { // ordered by partition, then offset: per-key order
		key, seqText, _ := strings.Cut(r.value, ":")
		seq, err := strconv.ParseInt(seqText, 10, 64)
		require.NoError(t, err)
		require.Equal(t, key, r.key)
		switch {
		case seq == next[key]:
			next[key]++
		case seq < next[key]: // a duplicate of a message already seen
		default:
			for _, x := range recs {
				if x.key == key {
					t.Logf("%s off=%d prod=%d", x.value, x.offset, x.producer)
				}
			}
			t.Fatalf("key %s: %d arrived before %d", key, seq, next[key])
		}
	}
}

type kafkaRecord struct {
	key, value       string
	offset, producer int64
}

// TestFailoverSlot: FailoverSlot creates a failover slot on PostgreSQL
// 17+; on an older server EnsureSlot and Run refuse it with a
// *relay.ConfigError naming the version, and create nothing.
func TestFailoverSlot(t *testing.T) {
	e := setup(t)
	var version int
	require.NoError(t, e.db.Raw("SELECT current_setting('server_version_num')::int").Scan(&version).Error)
	r, err := pgwal.New(e.db.DB, e.plugin, e.pub, pgwal.Config{ReplicationDSN: dbtest.PostgresWALDSN(), Slot: strings.ToLower(dbtest.Name("fo_")),
		FailoverSlot: true, Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	slot := r.Config().Slot
	t.Cleanup(func() {
		_ = e.db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ?", slot).Error
		_ = e.db.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})
	err = r.EnsureSlot(context.Background())
	if version < 170000 {
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce)
		require.Equal(t, "FailoverSlot", ce.Field)
		require.Contains(t, err.Error(), "PostgreSQL 17")
		require.False(t, slotExists(e.db.DB, slot), "no slot created")
		require.ErrorAs(t, r.Run(context.Background()), &ce, "Run refuses it too")
		return
	}
	require.NoError(t, err)
	var failover bool
	require.NoError(t, e.db.Raw("SELECT failover FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&failover).Error)
	require.True(t, failover)
}
