package chaos_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// The WAL slot tests run a PostgreSQL cluster of their own, configured
// for what they test (wal_level = logical, a small max_slot_wal_keep_size)
// and restarted at will; like TestChaosWAL they run in CI or with
// OUTBOX_CHAOS_WAL=1, as root.

// walSlotEnv is one outbox in WAL mode on a cluster of the test's own,
// with a kfake cluster to publish to.
type walSlotEnv struct {
	c      *pgCluster
	d      *dbtest.DB
	plugin *outbox.Plugin
	kafka  *kafkatest.Cluster
	topic  string
	pub    *publisher.Kafka
	seq    int
}

func newWALSlotEnv(t *testing.T, conf ...string) *walSlotEnv {
	t.Helper()
	if os.Getenv(EnvWALChaos) != "1" && !dbtest.InCI() {
		t.Skipf("runs a PostgreSQL server of its own; set %s=1 (CI runs it)", EnvWALChaos)
	}
	e := &walSlotEnv{c: startPGCluster(t, append([]string{"wal_level = logical"}, conf...)...)}
	e.d = e.c.open(t)
	var err error
	e.plugin, err = outbox.NewPlugin(outbox.Config{Mode: outbox.ModeWAL, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, e.d.DB.Use(e.plugin))
	require.NoError(t, e.plugin.AutoMigrate(context.Background(), e.d.DB))
	// The slot is the subject, not the broker: an in-process one, also in
	// the Apache Kafka pass, whose brokers the chaos tests kill meanwhile.
	e.kafka = kafkatest.Start(t, kafkatest.InProcess())
	e.topic = e.kafka.Topic(t, 2)
	e.pub, err = publisher.NewKafka(publisher.KafkaConfig{Brokers: e.kafka.Brokers(), Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, e.pub.Start(context.Background()))
	t.Cleanup(func() { _ = e.pub.Stop(context.Background()) })
	return e
}

func (e *walSlotEnv) reader(t *testing.T, pub relay.Publisher) *pgwal.Reader {
	t.Helper()
	r, err := pgwal.New(e.d.DB, e.plugin, pub, pgwal.Config{
		ReplicationDSN: e.d.DSN, LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: dbtest.Logger(t),
	})
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(context.Background()))
	return r
}

// write commits n messages of one key, in transactions of up to 10,
// retrying a transaction a server restart broke.
func (e *walSlotEnv) write(t *testing.T, n int) {
	t.Helper()
	for done := 0; done < n; {
		k := min(10, n-done)
		msgs := make([]*outbox.Message, k)
		for i := range msgs {
			msgs[i] = &outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte(strconv.Itoa(e.seq + i))}
		}
		require.NoError(t, e.d.DB.Transaction(func(tx *gorm.DB) error { return e.plugin.Enqueue(tx, msgs...) }))
		e.seq += k
		done += k
	}
}

// delivered waits until Kafka holds every value written, and returns the
// record count (duplicates included).
func (e *walSlotEnv) delivered(t *testing.T) int {
	t.Helper()
	var recs []kafkatest.Record
	require.Eventually(t, func() bool {
		recs = e.kafka.ReadLog(t, e.topic, 30*time.Second)
		seen := map[string]bool{}
		for _, r := range recs {
			seen[string(r.Value)] = true
		}
		return len(seen) == e.seq
	}, 60*time.Second, 50*time.Millisecond)
	return len(recs)
}

// fillWAL writes and switches past several WAL segments and checkpoints,
// so that the server removes the segments a slot behind
// max_slot_wal_keep_size needs.
func (e *walSlotEnv) fillWAL(t *testing.T, slot string) {
	t.Helper()
	require.NoError(t, e.d.DB.Exec("CREATE TABLE IF NOT EXISTS wal_filler (v text)").Error)
	require.Eventually(t, func() bool {
		for range 3 {
			require.NoError(t, e.d.DB.Exec("INSERT INTO wal_filler SELECT repeat('x', 100) FROM generate_series(1, 1000)").Error)
			require.NoError(t, e.d.DB.Exec("SELECT pg_switch_wal()").Error)
		}
		require.NoError(t, e.d.DB.Exec("CHECKPOINT").Error)
		var status string
		require.NoError(t, e.d.DB.Raw("SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&status).Error)
		return status == "lost"
	}, 60*time.Second, 10*time.Millisecond, "the server invalidates the slot")
}

func runUntilReturn(t *testing.T, r *pgwal.Reader) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	err := r.Run(ctx)
	require.NoError(t, ctx.Err(), "Run returned by itself")
	return err
}

func requireInvalidated(t *testing.T, err error, slot string) {
	t.Helper()
	var lost *pgwal.SlotLostError
	require.ErrorAs(t, err, &lost)
	require.ErrorIs(t, err, pgwal.ErrSlotLost)
	require.Equal(t, slot, lost.Slot)
	require.NotZero(t, lost.Confirmed, "the error names the last position the readers confirmed")
	require.Contains(t, err.Error(), "invalidated")
	require.Contains(t, err.Error(), "max_slot_wal_keep_size")
	require.Contains(t, err.Error(), "outboxctl --mode wal --wal-slot "+slot+" wal slot drop --force", "the error says what to do, for this slot")
}

// TestWALSlotInvalidatedWhileStopped: the reader stops, more WAL than
// max_slot_wal_keep_size is written and checkpointed, and the server
// invalidates the slot. The next Run returns a *SlotLostError naming the
// invalidation and the last confirmed position, and EnsureSlot refuses
// the slot too: the reader never reads past the lost WAL.
func TestWALSlotInvalidatedWhileStopped(t *testing.T) {
	t.Parallel()
	e := newWALSlotEnv(t, "max_slot_wal_keep_size = 1MB")
	r := e.reader(t, e.pub)
	slot := r.Config().Slot
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	e.write(t, 20)
	require.Equal(t, 20, e.delivered(t))
	require.Eventually(t, func() bool { return r.Stats().Confirmed > 0 }, 30*time.Second, 20*time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	e.write(t, 20) // in the WAL the slot loses
	e.fillWAL(t, slot)

	requireInvalidated(t, runUntilReturn(t, r), slot)
	requireInvalidated(t, r.EnsureSlot(context.Background()), slot)
	require.Equal(t, uint64(20), r.Stats().Received, "nothing read after the invalidation")
}

// TestWALSlotInvalidatedWhileReading: the publisher is down, so the
// reader's confirmed position stays behind while the writers go on; the
// server invalidates the slot at a checkpoint and ends the walsender.
// Run returns a *SlotLostError: the messages decoded but not published
// are not published from a slot that lost WAL after them.
func TestWALSlotInvalidatedWhileReading(t *testing.T) {
	t.Parallel()
	e := newWALSlotEnv(t, "max_slot_wal_keep_size = 1MB")
	var (
		mu   sync.Mutex
		down bool
	)
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		mu.Lock()
		d := down
		mu.Unlock()
		if d {
			return 0, relay.Unavailable(errors.New("broker down"))
		}
		return e.pub.Publish(ctx, msgs)
	})
	r := e.reader(t, pub)
	slot := r.Config().Slot
	done := make(chan error, 1)
	go func() { done <- runUntilReturn(t, r) }()
	e.write(t, 10)
	require.Equal(t, 10, e.delivered(t))
	require.Eventually(t, func() bool { return r.Stats().Confirmed > 0 }, 30*time.Second, 20*time.Millisecond)
	mu.Lock()
	down = true
	mu.Unlock()
	e.write(t, 10)
	require.Eventually(t, func() bool { return r.Stats().Received == 20 }, 30*time.Second, 20*time.Millisecond)
	e.fillWAL(t, slot)
	var err error
	require.Eventually(t, func() bool {
		select {
		case err = <-done:
			return true
		default:
			return false
		}
	}, 90*time.Second, 20*time.Millisecond, "Run returns once the slot is invalidated")
	requireInvalidated(t, err, slot)
	require.Equal(t, uint64(10), r.Stats().Published, "nothing published after the outage began")
}

// TestWALImmediateRestartReplaysNothing: an immediate shutdown (a crash)
// loses the slot's confirmed position since the last checkpoint: the
// server restores an older one. The reader starts from the position its
// lease row recorded instead, so what it published and confirmed before
// the crash is not published again.
func TestWALImmediateRestartReplaysNothing(t *testing.T) {
	t.Parallel()
	e := newWALSlotEnv(t)
	r := e.reader(t, e.pub)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	e.write(t, 200)
	require.Equal(t, 200, e.delivered(t))
	end := currentWALLSN(t, e)
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && st.Confirmed >= end
	}, 30*time.Second, 20*time.Millisecond, "the slot confirmed everything before the crash")
	cancel()
	require.NoError(t, <-done)

	require.NoError(t, e.c.restart("immediate"))
	var st pgwal.SlotStatus
	require.Eventually(t, func() bool {
		var err error
		st, err = r.SlotStatus(context.Background())
		return err == nil
	}, 60*time.Second, 50*time.Millisecond)
	require.Less(t, st.Confirmed, end, "the crash took the slot's confirmed position back to the last checkpoint")

	ctx, cancel = context.WithCancel(context.Background())
	go func() { done <- r.Run(ctx) }()
	e.write(t, 50)
	require.Equal(t, 250, e.delivered(t), "nothing published twice")
	cancel()
	require.NoError(t, <-done)
}

func currentWALLSN(t *testing.T, e *walSlotEnv) pglogrepl.LSN {
	t.Helper()
	var s string
	require.NoError(t, e.d.DB.Raw("SELECT pg_current_wal_lsn()::text").Scan(&s).Error)
	lsn, err := pglogrepl.ParseLSN(s)
	require.NoError(t, err)
	return lsn
}

// TestWALReaderResumesWhenServerAnswers: the server is down long enough
// for the reader's backoff to reach BackoffMax; once the server accepts
// connections again the reader reads at once instead of sleeping out its
// backoff. Ordering, from timestamps taken in this run: the first message
// written after the restart is published before the earliest moment the
// backoff after the last failed attempt would have let the reader try
// again (half the capped backoff: its jitter's lower bound).
func TestWALReaderResumesWhenServerAnswers(t *testing.T) {
	t.Parallel()
	e := newWALSlotEnv(t)
	const backoffMin, backoffMax = 50 * time.Millisecond, 10 * time.Second
	log, failed := dbtest.WatchLog(t, "pgwal: reading the slot failed, retrying")
	r, err := pgwal.New(e.d.DB, e.plugin, e.pub, pgwal.Config{
		ReplicationDSN: e.d.DSN, LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BackoffMin: backoffMin, BackoffMax: backoffMax, Logger: log,
	})
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(context.Background()))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	e.write(t, 10)
	require.Equal(t, 10, e.delivered(t))

	stopped := time.Now()
	require.NoError(t, e.c.stop("immediate"))
	// The backoff after the n-th consecutive failure is capped at
	// backoffMin doubled n-1 times, at most backoffMax, and is at least
	// half its cap.
	floor := func(n int) time.Duration {
		d := backoffMin
		for i := 1; i < n && d < backoffMax; i++ {
			d *= 2
		}
		return min(d, backoffMax) / 2
	}
	var last slog.Record
	n := 0
	for floor(n) < backoffMax/2 {
		select {
		case last = <-failed:
			v, _ := dbtest.Attr(last, "attempt")
			n = int(v.Int64())
		case <-time.After(2 * time.Minute):
			t.Fatalf("no failed attempt logged for 2 minutes while the server was down (last: %d)", n)
		}
	}
	require.NoError(t, e.c.start())
	ready := time.Now()
	msg := &outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte(strconv.Itoa(e.seq))}
	require.Eventually(t, func() bool {
		// The first statements after the restart may meet connections the
		// crash ended.
		return e.d.DB.Transaction(func(tx *gorm.DB) error { return e.plugin.Enqueue(tx, msg) }) == nil
	}, 30*time.Second, 5*time.Millisecond)
	e.seq++
	written := time.Now()
	require.Eventually(t, func() bool { return r.Stats().Published >= 11 }, 2*time.Minute, time.Millisecond)
	published := time.Now()
	wouldRetry := last.Time.Add(floor(n))
	t.Logf("resume: server down %s, attempt %d failed %s before it accepted connections again; written %s and published %s after that; the plain backoff would have retried %s after it at the earliest",
		last.Time.Sub(stopped).Round(time.Millisecond), n, ready.Sub(last.Time).Round(time.Millisecond),
		written.Sub(ready).Round(time.Millisecond), published.Sub(ready).Round(time.Millisecond), wouldRetry.Sub(ready).Round(time.Millisecond))
	require.True(t, published.Before(wouldRetry),
		"the reader published the message written after the restart (%s after the server answered) before its plain backoff (at least %s after attempt %d) would have ended (%s after the server answered)",
		published.Sub(ready), floor(n), n, wouldRetry.Sub(ready))
	e.delivered(t) // every message, the first ten again if the crash took their confirmation
	cancel()
	require.NoError(t, <-done)
}
