package pgnotify_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/pgnotifytest"
	"github.com/gorm-outbox/outbox/pgnotify"
)

// bundle is what each database test works with: a unique channel and
// application name, so tests run in parallel without hearing each other.
type bundle struct {
	channel string
	app     string
	admin   *pgx.Conn
}

func setup(t *testing.T) *bundle {
	t.Helper()
	dbtest.Require(t, dbtest.Postgres)
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, dbtest.PostgresDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	return &bundle{channel: dbtest.Name("ch_"), app: dbtest.Name("app_"), admin: admin}
}

// transport returns a transport on the bundle's channel; name tells the
// listener connections of several transports apart.
func (b *bundle) transport(t *testing.T, name string, edit ...func(*pgnotify.Config)) *pgnotify.Transport {
	t.Helper()
	return pgnotifytest.New(t, b.channel, b.app+"_"+name, edit...)
}

// listenerPIDs returns the backend pids of connections named app.
func (b *bundle) listenerPIDs(t require.TestingT, app string) []int32 {
	if h, ok := t.(interface{ Helper() }); ok {
		h.Helper()
	}
	rows, err := b.admin.Query(context.Background(),
		"SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY pid", app)
	require.NoError(t, err)
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	return pids
}

// listening is a running Listen call.
type listening struct {
	got    chan int
	cancel context.CancelFunc
	done   chan error
}

// listen runs tr.Listen until the test ends (or stop) and waits for the
// subscription: the UnknownBucket every new subscription delivers.
func listen(t *testing.T, tr *pgnotify.Transport) *listening {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &listening{got: make(chan int, 10000), cancel: cancel, done: make(chan error, 1)}
	go func() { l.done <- tr.Listen(ctx, func(b int) { l.got <- b }) }()
	t.Cleanup(func() { l.stop(t) })
	l.expect(t, outbox.UnknownBucket)
	return l
}

func (l *listening) stop(t *testing.T) {
	t.Helper()
	l.cancel()
	select {
	case err := <-l.done:
		require.ErrorIs(t, err, context.Canceled)
		l.done <- err // idempotent
	case <-time.After(5 * time.Second):
		t.Fatal("Listen did not return after cancellation")
	}
}

// expect waits for the next ids and checks them.
func (l *listening) expect(t *testing.T, want ...int) {
	t.Helper()
	var got []int
	deadline := time.After(5 * time.Second)
	for len(got) < len(want) {
		select {
		case b := <-l.got:
			got = append(got, b)
		case <-deadline:
			t.Fatalf("received %v, want %v", got, want)
		}
	}
	require.Equal(t, want, got)
}

func TestPublishListen(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, c := b.transport(t, "a"), b.transport(t, "c")
	la, lc := listen(t, a), listen(t, c)
	require.Empty(t, b.listenerPIDs(t, b.app+"_a"+pgnotify.PublishSuffix), "no NOTIFY connection before the first Publish")

	ctx := context.Background()
	require.NoError(t, a.Publish(ctx, []int{3, 1, 2, 3}))
	lc.expect(t, 1, 2, 3)
	require.NoError(t, a.Publish(ctx, []int{outbox.UnknownBucket, 5}))
	lc.expect(t, outbox.UnknownBucket, 5)
	require.NoError(t, a.Publish(ctx, nil), "nothing to send")

	// A hears its own NOTIFYs and skips them; the marker from c shows that
	// a's listener has seen everything published before it.
	require.NoError(t, c.Publish(ctx, []int{7}))
	la.expect(t, 7)
	require.Empty(t, la.got)
	require.Equal(t, uint64(2), a.Stats().EchoesDropped)
	require.Equal(t, uint64(2), a.Stats().Published)
	require.Equal(t, uint64(1), a.Stats().Received)
	require.Equal(t, uint64(2), c.Stats().Received)
	require.Equal(t, uint64(1), c.Stats().Subscriptions)
	require.Len(t, b.listenerPIDs(t, b.app+"_a"+pgnotify.PublishSuffix), 1)
}

func TestPublishAllBuckets(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, c := b.transport(t, "a"), b.transport(t, "c")
	lc := listen(t, c)
	all := make([]int, outbox.BucketCountMax)
	for i := range all {
		all[i] = i
	}
	require.NoError(t, a.Publish(context.Background(), append(slices.Clone(all), outbox.UnknownBucket)))
	lc.expect(t, append([]int{outbox.UnknownBucket}, all...)...)
}

// NOTIFY through the application's own pool instead of a connection of
// the transport's own.
func TestPublishDB(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db, err := sql.Open("pgx", dbtest.PostgresDSN())
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	// One session, so the check below reads the one the NOTIFY used.
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	var before string
	require.NoError(t, db.QueryRowContext(ctx, "SHOW synchronous_commit").Scan(&before))
	a := b.transport(t, "a", func(c *pgnotify.Config) { c.PublishDB = db })
	lc := listen(t, b.transport(t, "c"))
	require.NoError(t, a.Publish(ctx, []int{4}))
	lc.expect(t, 4)
	require.Empty(t, b.listenerPIDs(t, b.app+"_a"+pgnotify.PublishSuffix))
	// The asynchronous commit was the NOTIFY transaction's alone: the
	// application's session keeps its setting.
	var after string
	require.NoError(t, db.QueryRowContext(ctx, "SHOW synchronous_commit").Scan(&after))
	require.Equal(t, before, after)
}

// A notification from someone else on the channel that is not a hint is
// treated as "something committed": one unknown bucket.
func TestForeignPayload(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.transport(t, "c")
	lc := listen(t, c)
	_, err := b.admin.Exec(context.Background(), "SELECT pg_notify($1, 'hello')", b.channel)
	require.NoError(t, err)
	lc.expect(t, outbox.UnknownBucket)
	require.Equal(t, uint64(1), c.Stats().Malformed)
}

// The listener's connection is killed: it reconnects with backoff, says
// so with an unknown-bucket hint, and receives again.
func TestReconnectAfterTerminate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, c := b.transport(t, "a"), b.transport(t, "c")
	lc := listen(t, c)
	ctx := context.Background()

	for round := range 2 {
		pids := b.listenerPIDs(t, c.ApplicationName())
		require.Len(t, pids, 1)
		_, err := b.admin.Exec(ctx, "SELECT pg_terminate_backend($1)", pids[0])
		require.NoError(t, err)
		lc.expect(t, outbox.UnknownBucket) // resubscribed
		require.Equal(t, uint64(round+2), c.Stats().Subscriptions)
		newPIDs := b.listenerPIDs(t, c.ApplicationName())
		require.Len(t, newPIDs, 1)
		require.NotEqual(t, pids, newPIDs)

		require.NoError(t, a.Publish(ctx, []int{round}))
		lc.expect(t, round)
	}
}

// A publish connection that is killed is replaced by the pool: the
// failed NOTIFY is reported, the next one goes through.
func TestPublishAfterTerminate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, c := b.transport(t, "a"), b.transport(t, "c")
	lc := listen(t, c)
	ctx := context.Background()
	require.NoError(t, a.Publish(ctx, []int{1}))
	lc.expect(t, 1)
	pids := b.listenerPIDs(t, a.ApplicationName()+pgnotify.PublishSuffix)
	require.Len(t, pids, 1)
	_, err := b.admin.Exec(ctx, "SELECT pg_terminate_backend($1)", pids[0])
	require.NoError(t, err)
	// The pool may or may not notice the dead connection before using it.
	require.Eventually(t, func() bool { return a.Publish(ctx, []int{2}) == nil }, 5*time.Second, 10*time.Millisecond)
	lc.expect(t, 2)

	a.Close()
	require.Error(t, a.Publish(ctx, []int{3}))
	require.GreaterOrEqual(t, a.Stats().PublishFailures, uint64(1))
}

// Waiting longer than PingInterval pings the connection and keeps it.
func TestIdlePing(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.transport(t, "a")
	c := b.transport(t, "c", func(c *pgnotify.Config) { c.PingInterval = 20 * time.Millisecond })
	lc := listen(t, c)
	pids := b.listenerPIDs(t, c.ApplicationName())
	// Wait through several ping intervals, observed on the server (each
	// ping is a statement, "-- ping", that moves state_change) rather than
	// by sleeping.
	seen := map[time.Time]bool{}
	app := c.ApplicationName()
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		var at time.Time
		err := b.admin.QueryRow(context.Background(),
			"SELECT state_change FROM pg_stat_activity WHERE application_name = $1 AND query = '-- ping'", app).Scan(&at)
		if errors.Is(err, pgx.ErrNoRows) {
			ct.Errorf("no ping yet")
			return
		}
		require.NoError(ct, err)
		seen[at] = true
		assert.GreaterOrEqual(ct, len(seen), 3, "pings seen")
	}, 5*time.Second, 5*time.Millisecond)
	require.NoError(t, a.Publish(context.Background(), []int{9}))
	lc.expect(t, 9)
	require.Equal(t, pids, b.listenerPIDs(t, c.ApplicationName()), "same connection")
	require.Equal(t, uint64(1), c.Stats().Subscriptions)
}

// Cancelling Listen while a callback runs: Listen returns only after the
// callback returned, and closes its connection.
func TestCancelWhileCallbackRuns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a, c := b.transport(t, "a"), b.transport(t, "c")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	subscribed := make(chan struct{})
	entered := make(chan int, 1)
	release := make(chan struct{})
	var mu sync.Mutex
	inCallback := false
	done := make(chan error, 1)
	go func() {
		done <- c.Listen(ctx, func(bucket int) {
			if bucket == outbox.UnknownBucket {
				close(subscribed)
				return
			}
			mu.Lock()
			inCallback = true
			mu.Unlock()
			entered <- bucket
			<-release
			mu.Lock()
			inCallback = false
			mu.Unlock()
		})
	}()
	<-subscribed
	require.NoError(t, a.Publish(context.Background(), []int{6, 7}))
	require.Equal(t, 6, <-entered)
	cancel()
	require.Never(t, func() bool { return len(done) > 0 }, 200*time.Millisecond, 10*time.Millisecond,
		"Listen returned while its callback was running")
	close(release)
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("Listen did not return")
	}
	mu.Lock()
	assert.False(t, inCallback)
	mu.Unlock()
	// The server ends the backend shortly after the client closed the
	// connection; on a busy machine that can take a while.
	app := c.ApplicationName()
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Empty(ct, b.listenerPIDs(ct, app), "listener connection closed")
	}, 30*time.Second, 10*time.Millisecond)
}

// A listener that cannot connect keeps retrying with backoff and stops
// promptly when cancelled; it never reports a subscription.
func TestListenUnreachable(t *testing.T) {
	t.Parallel()
	tr, err := pgnotify.New(pgnotify.Config{
		DSN:                 "host=127.0.0.1 port=1 user=postgres dbname=test connect_timeout=1",
		ReconnectBackoffMin: 5 * time.Millisecond,
		ReconnectBackoffMax: 20 * time.Millisecond,
		Logger:              dbtest.Logger(t),
	})
	require.NoError(t, err)
	defer tr.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var calls int
	go func() { done <- tr.Listen(ctx, func(int) { calls++ }) }()
	require.Never(t, func() bool { return len(done) > 0 }, 100*time.Millisecond, 5*time.Millisecond)
	cancel()
	select {
	case err := <-done:
		require.True(t, errors.Is(err, context.Canceled), "%v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("Listen did not return")
	}
	require.Zero(t, calls)
	require.Zero(t, tr.Stats().Subscriptions)
	require.Error(t, tr.Listen(context.Background(), nil))
}

// The transport's lifecycle: New starts nothing, Stop before Start and a
// second Stop are harmless, Stop closes the NOTIFY connection (Publish
// fails after it) and Stopped closes; a stopped transport does not start
// again.
func TestLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()

	never := b.transport(t, "never")
	require.NoError(t, never.Stop(ctx), "Stop before Start")
	require.Error(t, never.Publish(ctx, []int{1}), "stopped: its NOTIFY connection is closed")

	tr := b.transport(t, "life")
	require.NoError(t, tr.Start(ctx))
	require.NoError(t, tr.Start(ctx), "Start on a running transport")
	require.NoError(t, tr.Publish(ctx, []int{1}))
	select {
	case <-tr.Stopped():
		t.Fatal("Stopped closed while running")
	default:
	}
	require.NoError(t, tr.Stop(ctx))
	<-tr.Stopped()
	require.NoError(t, tr.Err())
	require.NoError(t, tr.Stop(ctx), "second Stop")
	require.Error(t, tr.Publish(ctx, []int{1}))
	require.Error(t, tr.Start(ctx), "a transport runs once")
}
