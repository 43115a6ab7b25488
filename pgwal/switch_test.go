package pgwal_test

import (
	"context"
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
	name := e.plugin.Config().Name
	tableDB, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	t.Cleanup(func() {
		if sqlDB, err := tableDB.DB(); err == nil {
			_ = sqlDB.Close()
		}
	})
	tablePlugin, err := outbox.NewPlugin(outbox.Config{Name: name})
	require.NoError(t, err)
	require.NoError(t, tableDB.Use(tablePlugin))
	require.NoError(t, tablePlugin.AutoMigrate(ctx, tableDB))

	tablePub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: e.kafka.Brokers(), Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, tablePub.Start(ctx))
	t.Cleanup(func() { _ = tablePub.Stop(context.Background()) })
	startTableRelay := func(id string) *relay.Relay {
		rl, err := gormrelay.New(tableDB, tablePlugin, tablePub, gormrelay.WithRelayConfig(relay.Config{
			RelayID: id, BatchSize: 20, PollInterval: 50 * time.Millisecond, LeaseDuration: 2 * time.Second,
			LeaseRenewInterval: 200 * time.Millisecond, BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond,
			Logger: dbtest.Logger(t)}))
		require.NoError(t, err)
		require.NoError(t, rl.Start(ctx))
		return rl
	}

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

	last := make([]int64, keys)
	for k := range keys {
		last[k] = w.next[k].Load()
	}
	checkKeysDelivered(t, e, last)
	require.Eventually(t, func() bool {
		var n int64
		return e.db.Raw("SELECT count(*) FROM "+e.plugin.Config().Tables.Messages).Scan(&n).Error == nil && n == 0
	}, 30*time.Second, 20*time.Millisecond, "the messages table ends empty")
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
