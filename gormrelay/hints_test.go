package gormrelay_test

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/pgnotifytest"
	"github.com/gorm-outbox/outbox/pgnotify"
	"github.com/gorm-outbox/outbox/relay"
)

// ---------------------------------------------------------------------
// Two processes sharing a database: separate *gorm.DB, plugins, notifiers,
// relays and bridges.

// memHub is an in-memory broadcast medium; each memTransport on it is one
// process's transport. It follows the Transport contract: every listener
// gets every broadcast except its own, and a new subscription announces
// itself with UnknownBucket.
type memHub struct {
	mu        sync.Mutex
	listeners map[*memTransport][]chan memNote
	publishes atomic.Int64
}

type memNote struct {
	from    *memTransport
	buckets []int
}

type memTransport struct{ hub *memHub }

func newMemHub() *memHub { return &memHub{listeners: map[*memTransport][]chan memNote{}} }

func (h *memHub) transport() *memTransport { return &memTransport{hub: h} }

func (m *memTransport) Publish(ctx context.Context, buckets []int) error {
	note := memNote{from: m, buckets: slices.Clone(buckets)}
	m.hub.publishes.Add(1)
	m.hub.mu.Lock()
	defer m.hub.mu.Unlock()
	for _, chs := range m.hub.listeners {
		for _, ch := range chs {
			select {
			case ch <- note:
			default: // a slow listener loses hints, as NOTIFY can
			}
		}
	}
	return nil
}

func (m *memTransport) Listen(ctx context.Context, fn func(int)) error {
	ch := make(chan memNote, 64)
	m.hub.mu.Lock()
	m.hub.listeners[m] = append(m.hub.listeners[m], ch)
	m.hub.mu.Unlock()
	defer func() {
		m.hub.mu.Lock()
		m.hub.listeners[m] = slices.DeleteFunc(m.hub.listeners[m], func(c chan memNote) bool { return c == ch })
		m.hub.mu.Unlock()
	}()
	fn(outbox.UnknownBucket)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case note := <-ch:
			if note.from == m {
				continue
			}
			for _, b := range note.buckets {
				fn(b)
			}
		}
	}
}

// hintProcess is one application process: its own connection pool,
// plugin, relay and bridge over the shared database.
type hintProcess struct {
	name      string
	db        *gorm.DB
	plugin    *outbox.Plugin
	relay     *relay.Relay
	bridge    *outbox.HintBridge
	rec       *recorder
	delivered chan delivery
}

type delivery struct {
	value string
	at    time.Time
}

func startHintProcess(t *testing.T, db *dbtest.DB, name string, tr outbox.Transport, poll time.Duration) *hintProcess {
	t.Helper()
	gdb, err := dbtest.OpenGorm(db.Dialect, db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := gdb.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlDB.Close() })
	p, err := outbox.NewPlugin(outbox.Config{Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, gdb.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), gdb))
	store, err := gormrelay.NewStore(gdb, p.Config())
	require.NoError(t, err)

	hp := &hintProcess{name: name, db: gdb, plugin: p, rec: newRecorder(), delivered: make(chan delivery, 1000)}
	pub := hp.rec.publisher(name, func(_ context.Context, msgs []relay.Message) (int, error) {
		now := time.Now()
		for _, m := range msgs {
			hp.delivered <- delivery{value: string(m.Value), at: now}
		}
		return len(msgs), nil
	})
	cfg := fastConfig(t, name)
	cfg.PollInterval = poll
	cfg.LeaseDuration = 10 * time.Second
	cfg.LeaseRenewInterval = 500 * time.Millisecond
	cfg.Hints = p.Notifier()
	hp.relay = startRelay(t, store, pub, cfg)
	bridge, err := outbox.StartHintBridge(context.Background(), p.Notifier(), tr,
		outbox.HintBridgeConfig{BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, bridge.Stop(ctx))
	})
	hp.bridge = bridge
	return hp
}

// commit writes one message with key in a transaction and returns when
// the transaction began.
func (hp *hintProcess) commit(t *testing.T, key, value string) time.Time {
	t.Helper()
	began := time.Now()
	require.NoError(t, hp.db.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "events", Key: []byte(key), Value: []byte(value)})
	}))
	return began
}

// await waits for value to be published by hp and returns when.
func (hp *hintProcess) await(t *testing.T, value string, within time.Duration) time.Time {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case d := <-hp.delivered:
			if d.value == value {
				return d.at
			}
		case <-deadline:
			t.Fatalf("%s did not publish %q within %s", hp.name, value, within)
		}
	}
}

// converge waits until a and b own half of the 8 buckets each, and returns
// b's buckets.
func converge(t *testing.T, a, b *hintProcess) []int {
	t.Helper()
	require.Eventually(t, func() bool {
		return len(a.relay.Leases()) == 4 && len(b.relay.Leases()) == 4
	}, deliverWithin, 10*time.Millisecond, "fair share not reached")
	return leaseBuckets(b.relay.Leases())
}

// A commit in A to a bucket B owns wakes B through the transport, long
// before B's poll; on every dialect, over the in-memory transport.
func TestHintBridgeWakesRemoteRelay(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const poll = 30 * time.Second
		hub := newMemHub()
		a := startHintProcess(t, db, "a", hub.transport(), poll)
		b := startHintProcess(t, db, "b", hub.transport(), poll)
		owned := converge(t, a, b)
		before := hub.publishes.Load()
		for i, bucket := range owned {
			value := fmt.Sprintf("v/%d", i)
			began := a.commit(t, keyInBucket(t, bucket, 8), value)
			at := b.await(t, value, 5*time.Second)
			t.Logf("bucket %d: commit in a to publish by b: %s", bucket, at.Sub(began))
		}
		require.Equal(t, int64(len(owned)), hub.publishes.Load()-before, "one send per commit, nothing rebroadcast")
		require.Empty(t, a.rec.acked())
		b.rec.requireNoOverlap(t)
	})
}

// ---------------------------------------------------------------------
// The same over PostgreSQL LISTEN/NOTIFY.

type pgPair struct {
	db         *dbtest.DB
	channel    string
	a, b       *hintProcess
	ta, tb     *pgnotify.Transport
	appA, appB string
}

// startPGPair starts two processes whose transports share nothing but the
// database. editB adjusts B's transport.
func startPGPair(t *testing.T, pollB time.Duration, editB ...func(*pgnotify.Config)) *pgPair {
	t.Helper()
	db := dbtest.Open(t, dbtest.Postgres)
	p := &pgPair{db: db, channel: dbtest.Name("hints_"), appA: dbtest.Name("a_"), appB: dbtest.Name("b_")}
	p.ta = pgnotifytest.New(t, p.channel, p.appA)
	p.tb = pgnotifytest.New(t, p.channel, p.appB, editB...)
	p.a = startHintProcess(t, db, "a", p.ta, 30*time.Second)
	p.b = startHintProcess(t, db, "b", p.tb, pollB)
	require.Eventually(t, func() bool {
		return p.ta.Stats().Subscriptions == 1 && p.tb.Stats().Subscriptions == 1
	}, deliverWithin, 5*time.Millisecond, "listeners not subscribed")
	return p
}

func (p *pgPair) backendPIDs(t require.TestingT, app string) []int32 {
	helper(t)
	var pids []int32
	require.NoError(t, p.db.DB.Raw("SELECT pid FROM pg_stat_activity WHERE application_name = ? ORDER BY pid", app).Scan(&pids).Error)
	return pids
}

// killListener terminates B's listener connection and waits until the
// server has removed it.
func (p *pgPair) killListener(t *testing.T) {
	t.Helper()
	pids := p.backendPIDs(t, p.appB)
	require.Len(t, pids, 1)
	require.NoError(t, p.db.DB.Exec("SELECT pg_terminate_backend(?)", pids[0]).Error)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, !slices.Contains(p.backendPIDs(c, p.appB), pids[0])) },
		5*time.Second, 5*time.Millisecond)
}

// watchChannel counts the NOTIFYs on channel, as a third listener.
func watchChannel(t *testing.T, channel string) *atomic.Int64 {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := pgx.Connect(ctx, dbtest.PostgresDSN())
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "LISTEN "+channel)
	require.NoError(t, err)
	var count atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := conn.WaitForNotification(ctx); err != nil {
				return
			}
			count.Add(1)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = conn.Close(context.Background())
	})
	return &count
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	i := int(float64(len(sorted))*p+0.999999) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// The acceptance test: 50 commits in A, each to a bucket B owns;
// B's poll interval is 10s, so every fast delivery is the hint's doing.
func TestPGNotifyCrossProcessLatency(t *testing.T) {
	t.Parallel()
	// The poll interval is far longer than the test: every delivery below
	// came through a hint, whatever the machine's load.
	const poll = time.Hour
	const deliver = time.Minute
	p := startPGPair(t, poll)
	owned := converge(t, p.a, p.b)
	notifies := watchChannel(t, p.channel)
	sentA := p.ta.Stats().Published

	const commits = 50
	lat := make([]time.Duration, 0, commits)
	for i := range commits {
		bucket := owned[i%len(owned)]
		value := fmt.Sprintf("lat/%d", i)
		began := p.a.commit(t, keyInBucket(t, bucket, 8), value)
		lat = append(lat, p.b.await(t, value, deliver).Sub(began))
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	p50, p99 := percentile(lat, 0.50), percentile(lat, 0.99)
	t.Logf("commit in A -> publish by B over LISTEN/NOTIFY, %d commits, PollInterval %s: p50 %s, p99 %s, min %s, max %s",
		commits, poll, p50, p99, lat[0], lat[len(lat)-1])

	// One NOTIFY per commit (each commit waited for the previous
	// delivery, so nothing coalesced), none from B: B received 50 hints
	// and sent none on.
	require.Eventually(t, func() bool {
		return notifies.Load() == commits && p.ta.Stats().Published-sentA == commits
	}, deliverWithin, 5*time.Millisecond)
	require.Zero(t, p.tb.Stats().Published)
	require.Empty(t, p.a.rec.acked(), "A owns none of these buckets")
	// The recorder logs a call once the publish returned, just after the
	// delivery await saw.
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, p.b.rec.acked(), commits) }, deliverWithin, 5*time.Millisecond)
}

// Self-echoes and received hints are never sent again: one commit, one
// NOTIFY, however long we watch.
func TestPGNotifyNoRebroadcast(t *testing.T) {
	t.Parallel()
	p := startPGPair(t, 10*time.Second)
	owned := converge(t, p.a, p.b)
	notifies := watchChannel(t, p.channel)

	p.a.commit(t, keyInBucket(t, owned[0], 8), "once")
	p.b.await(t, "once", 5*time.Second)
	require.Eventually(t, func() bool { return p.ta.Stats().EchoesDropped == 1 }, deliverWithin, 5*time.Millisecond,
		"A hears its own NOTIFY and drops it")
	require.Never(t, func() bool { return notifies.Load() > 1 }, 500*time.Millisecond, 10*time.Millisecond)
	require.Equal(t, int64(1), notifies.Load())
	require.Equal(t, uint64(1), p.a.bridge.Stats().Sent, "the Never above gave its Publish time to return")
	require.Zero(t, p.b.bridge.Stats().Sent, "B received and sent nothing")
	require.GreaterOrEqual(t, p.b.bridge.Stats().Received, uint64(1))
}

// Duplicate and unrelated hints change nothing: every message is published
// once, in order, by its owner.
func TestPGNotifyDuplicateHints(t *testing.T) {
	t.Parallel()
	p := startPGPair(t, 10*time.Second)
	owned := converge(t, p.a, p.b)
	key := keyInBucket(t, owned[0], 8)
	ctx := context.Background()

	var wg sync.WaitGroup
	wg.Go(func() {
		for range 30 {
			_ = p.ta.Publish(ctx, []int{owned[0], owned[0], owned[1], outbox.UnknownBucket})
		}
	})
	var values []string
	for i := range 10 {
		v := fmt.Sprintf("%s/%d", key, i)
		values = append(values, v)
		p.a.commit(t, key, v)
	}
	wg.Wait()
	for _, v := range values {
		p.b.await(t, v, 5*time.Second)
	}
	// The recorder logs a call when it returns, just after the hook
	// reported the delivery.
	var got []string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		got = got[:0]
		for _, m := range p.b.rec.acked() {
			got = append(got, string(m.Value))
		}
		assert.Len(c, got, len(values))
	}, deliverWithin, 10*time.Millisecond)
	require.Equal(t, values, got, "each once, in order")
	p.b.rec.requireNoOverlap(t)
}

// B's listener connection is killed. A commit made while it is down is
// found at once when it reconnects (the new subscription asks for a
// discovery); afterwards hints flow again.
func TestPGNotifyListenerKilledReconnects(t *testing.T) {
	t.Parallel()
	// The poll interval is far longer than the test: a delivery can only
	// come from the reconnection's discovery or a hint.
	const poll = time.Hour
	const deliver = time.Minute
	p := startPGPair(t, poll)
	owned := converge(t, p.a, p.b)
	key := keyInBucket(t, owned[0], 8)

	p.killListener(t)
	began := p.a.commit(t, key, "gap")
	gap := p.b.await(t, "gap", deliver).Sub(began)
	require.Eventually(t, func() bool { return p.tb.Stats().Subscriptions == 2 }, deliverWithin, 5*time.Millisecond)
	require.Len(t, p.backendPIDs(t, p.appB), 1, "one listener connection again")

	began = p.a.commit(t, key, "after")
	after := p.b.await(t, "after", deliver).Sub(began)
	t.Logf("commit while B's listener was down: published after %s; after reconnecting: %s (PollInterval %s)", gap, after, poll)
	require.Zero(t, p.b.bridge.Stats().ListenRestarts, "pgnotify reconnected by itself")
}

// While B's listener stays down, polling still delivers.
func TestPGNotifyPollingCoversOutage(t *testing.T) {
	t.Parallel()
	const poll = time.Second
	p := startPGPair(t, poll, func(c *pgnotify.Config) {
		c.ReconnectBackoffMin = time.Minute // stays down for the test
		c.ReconnectBackoffMax = time.Minute
	})
	owned := converge(t, p.a, p.b)

	p.killListener(t)
	began := p.a.commit(t, keyInBucket(t, owned[0], 8), "polled")
	at := p.b.await(t, "polled", 5*poll)
	t.Logf("commit while B's listener was down: published by polling after %s (PollInterval %s)", at.Sub(began), poll)
	require.Equal(t, uint64(1), p.tb.Stats().Subscriptions, "still not reconnected")
	require.Empty(t, p.backendPIDs(t, p.appB))
	// Cleanup stops B's bridge during the listener's one-minute backoff:
	// that must not wait for it.
}
