package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/metrics"
)

var _ inbox.Observer = (*metrics.InboxCollector)(nil)

func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
}

// Applied is the business table of the tests: one row per application of
// a message's effect, with no unique key, so that an effect applied
// twice shows as two rows instead of an error.
type Applied struct {
	ID        int64  `gorm:"primaryKey"`
	MessageID string `gorm:"type:varchar(64);index"`
	Worker    string `gorm:"type:varchar(32)"`
}

// bundle is one test's database with the outbox plugin, an inbox table of
// its own name and the business table.
type bundle struct {
	db    *dbtest.DB
	inbox *inbox.Inbox
	cfg   inbox.Config
}

func setup(t *testing.T, db *dbtest.DB, cfg inbox.Config) *bundle {
	t.Helper()
	ctx := context.Background()
	p, err := outbox.NewPlugin(outbox.Config{})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(ctx, db.DB))
	if cfg.Table == "" {
		cfg.Table = dbtest.Name("inbox_")
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	if cfg.RetryMin == 0 {
		cfg.RetryMin, cfg.RetryMax = 5*time.Millisecond, 50*time.Millisecond
	}
	ib, err := inbox.New(db.DB, cfg)
	require.NoError(t, err)
	require.NoError(t, ib.AutoMigrate(ctx))
	require.NoError(t, db.DB.AutoMigrate(&Applied{}))
	return &bundle{db: db, inbox: ib, cfg: ib.Config()}
}

// another opens a second connection pool on the same database, as a
// second consumer process would, with its own inbox on the same table.
func (b *bundle) another(t *testing.T) *inbox.Inbox {
	t.Helper()
	db, err := dbtest.OpenGorm(b.db.Dialect, b.db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlDB.Close() })
	p, err := outbox.NewPlugin(outbox.Config{})
	require.NoError(t, err)
	require.NoError(t, db.Use(p))
	ib, err := inbox.New(db, b.cfg)
	require.NoError(t, err)
	return ib
}

func record(id string, offset int64) inbox.Record {
	r := inbox.Record{Topic: "orders", Partition: 2, Offset: offset, Key: []byte("k"), Value: []byte("v")}
	if id != "" {
		r.Headers = []inbox.Header{{Key: []byte("other"), Value: []byte("x")}, {Key: []byte(inbox.MessageIDHeaderDefault), Value: []byte(id)}}
	}
	return r
}

// apply is a handler that writes one business row as worker.
func apply(worker string, calls *atomic.Int32) inbox.Handler {
	return func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
		calls.Add(1)
		id, _ := rec.Header(inbox.MessageIDHeaderDefault)
		return tx.Create(&Applied{MessageID: string(id), Worker: worker}).Error
	}
}

func (b *bundle) applied(t testing.TB, id string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.db.DB.Model(&Applied{}).Where("message_id = ?", id).Count(&n).Error)
	return n
}

func (b *bundle) recorded(t testing.TB) []inbox.Row {
	t.Helper()
	var rows []inbox.Row
	require.NoError(t, b.db.DB.Table(b.inbox.TableName()).Order("message_id").Find(&rows).Error)
	return rows
}

// A recorded id is skipped: the handler runs for the first delivery only,
// and the inbox row says where the record was read.
func TestProcessSkipsRecordedID(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		m, err := metrics.NewInbox(metrics.InboxConfig{})
		require.NoError(t, err)
		b := setup(t, db, inbox.Config{Observer: m})
		ctx := context.Background()
		var calls atomic.Int32
		before := time.Now().UnixMilli()
		res, err := b.inbox.Process(ctx, record("m-1", 7), apply("a", &calls))
		require.NoError(t, err)
		require.Equal(t, inbox.Result{MessageID: "m-1", Outcome: inbox.Processed}, res)

		for offset := int64(7); offset < 10; offset++ { // redeliveries, at any offset
			res, err = b.inbox.Process(ctx, record("m-1", offset), apply("a", &calls))
			require.NoError(t, err)
			require.Equal(t, inbox.Result{MessageID: "m-1", Outcome: inbox.Duplicate}, res)
		}
		require.EqualValues(t, 1, calls.Load(), "the handler of a duplicate is not called")
		require.EqualValues(t, 1, b.applied(t, "m-1"))
		rows := b.recorded(t)
		require.Len(t, rows, 1)
		require.Equal(t, "m-1", rows[0].MessageID)
		require.Equal(t, "orders", rows[0].Topic)
		require.EqualValues(t, 2, rows[0].Partition)
		require.EqualValues(t, 7, rows[0].Offset)
		require.GreaterOrEqual(t, rows[0].ProcessedAtMs, before)
		require.Equal(t, 1.0, counterValue(t, m, metrics.NameInboxProcessed, ""))
		require.Equal(t, 3.0, counterValue(t, m, metrics.NameInboxDuplicates, ""))
	})
}

// A handler error rolls back the handler's writes and the id; the next
// delivery runs the handler again and commits both.
func TestProcessHandlerErrorRollsBack(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		m, err := metrics.NewInbox(metrics.InboxConfig{Inbox: "orders"})
		require.NoError(t, err)
		b := setup(t, db, inbox.Config{Observer: m})
		ctx := context.Background()
		boom := errors.New("boom")
		var calls atomic.Int32
		failing := func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
			if err := apply("a", &calls)(ctx, tx, rec); err != nil {
				return err
			}
			// The handler also publishes: the event rolls back with the rest.
			if err := outbox.EnqueueJSON(tx, "reactions", nil, map[string]string{"to": "m-1"}); err != nil {
				return err
			}
			return boom
		}
		res, err := b.inbox.Process(ctx, record("m-1", 1), failing)
		var he *inbox.HandlerError
		require.ErrorAs(t, err, &he)
		require.ErrorIs(t, err, boom)
		require.Equal(t, "m-1", he.MessageID)
		require.Zero(t, res.Outcome)
		require.Zero(t, b.applied(t, "m-1"), "the handler's write rolled back")
		require.Empty(t, b.recorded(t), "the id rolled back")
		var events int64
		require.NoError(t, db.DB.Table(outbox.MessagesTableDefault).Count(&events).Error)
		require.Zero(t, events, "the handler's event rolled back")
		require.Equal(t, 1.0, counterValue(t, m, metrics.NameInboxFailures, metrics.KindHandler))

		res, err = b.inbox.Process(ctx, record("m-1", 1), func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
			if err := apply("a", &calls)(ctx, tx, rec); err != nil {
				return err
			}
			return outbox.EnqueueJSON(tx, "reactions", nil, map[string]string{"to": "m-1"})
		})
		require.NoError(t, err)
		require.Equal(t, inbox.Processed, res.Outcome)
		require.EqualValues(t, 1, b.applied(t, "m-1"))
		require.Len(t, b.recorded(t), 1)
		require.NoError(t, db.DB.Table(outbox.MessagesTableDefault).Count(&events).Error)
		require.EqualValues(t, 1, events, "consume and publish committed together")
	})
}

// Handle retries a failing handler with backoff until it succeeds: the
// effect is applied once.
func TestHandleRetriesUntilApplied(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := setup(t, db, inbox.Config{})
		var calls, failures atomic.Int32
		res, err := b.inbox.Handle(context.Background(), record("m-1", 1), func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
			if err := apply("a", &calls)(ctx, tx, rec); err != nil {
				return err
			}
			if failures.Add(1) <= 3 {
				return errors.New("transient")
			}
			return nil
		})
		require.NoError(t, err)
		require.Equal(t, inbox.Processed, res.Outcome)
		require.EqualValues(t, 4, calls.Load())
		require.EqualValues(t, 1, b.applied(t, "m-1"))

		// A cancelled context ends the retries with its cause.
		ctx, cancel := context.WithCancelCause(context.Background())
		stop := errors.New("shutting down")
		_, err = b.inbox.Handle(ctx, record("m-2", 2), func(context.Context, *gorm.DB, inbox.Record) error {
			cancel(stop)
			return errors.New("fails")
		})
		require.ErrorIs(t, err, stop)
		require.Zero(t, b.applied(t, "m-2"))
	})
}

// A record without a usable id is refused with a typed error and runs
// nothing; AllowMissingID processes it without deduplication.
func TestProcessMissingID(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := setup(t, db, inbox.Config{})
		ctx := context.Background()
		var calls atomic.Int32
		long := record(string(make([]byte, inbox.MessageIDMaxLen+1)), 3)
		for name, rec := range map[string]inbox.Record{"missing": record("", 3), "empty": record("", 3), "too long": long} {
			if name == "empty" {
				rec.Headers = []inbox.Header{{Key: []byte(inbox.MessageIDHeaderDefault)}}
			}
			_, err := b.inbox.Process(ctx, rec, apply("a", &calls))
			var me *inbox.MessageIDError
			require.ErrorAs(t, err, &me, name)
			require.ErrorIs(t, err, inbox.ErrNoMessageID)
			require.Equal(t, inbox.MessageIDError{Topic: "orders", Partition: 2, Offset: 3, Header: inbox.MessageIDHeaderDefault, Reason: me.Reason}, *me)
			require.Contains(t, err.Error(), "AllowMissingID")
			_, err = b.inbox.Handle(ctx, rec, apply("a", &calls))
			require.ErrorIs(t, err, inbox.ErrNoMessageID, "Handle does not retry it")
		}
		require.Zero(t, calls.Load())

		lax, err := inbox.New(db.DB, inbox.Config{Table: b.cfg.Table, AllowMissingID: true})
		require.NoError(t, err)
		for range 2 {
			res, err := lax.Process(ctx, record("", 4), apply("a", &calls))
			require.NoError(t, err)
			require.Equal(t, inbox.Result{Outcome: inbox.Unrecorded}, res)
		}
		require.EqualValues(t, 2, calls.Load(), "no deduplication without an id")
		require.EqualValues(t, 2, b.applied(t, ""))
		require.Empty(t, b.recorded(t))
	})
}

// lockWaiters counts the sessions waiting on a row lock in a statement
// on table (PostgreSQL) or in the test's database (MySQL).
func lockWaiters(t testing.TB, db *dbtest.DB, table string) int64 {
	var n int64
	var err error
	switch db.Dialect {
	case dbtest.Postgres:
		err = db.DB.Raw("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE ?", "%"+table+"%").Scan(&n).Error
	case dbtest.MySQL:
		// By the waiting session's database: trx_query is not always
		// filled in for a statement that waits. Callers poll no faster
		// than every 100 ms, or InnoDB serves its cached list unrefreshed.
		err = db.DB.Raw(`SELECT COUNT(*) FROM information_schema.INNODB_TRX t
			JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
			WHERE t.trx_state = 'LOCK WAIT' AND p.DB = ?`, db.Namespace).Scan(&n).Error
	}
	assert.NoError(t, err)
	return n
}

// Two consumers (two connection pools) deliver one id at the same time:
// the second's INSERT waits on the primary key while the first is inside
// its handler. When the first commits, the second reports a duplicate and
// its handler never runs; when the first rolls back, the second applies
// the record. Either way the effect is committed exactly once.
func TestConcurrentDeliveriesApplyOnce(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := setup(t, db, inbox.Config{})
		second := b.another(t)
		ctx := context.Background()

		for _, firstFails := range []bool{false, true} {
			id := fmt.Sprintf("race-%v", firstFails)
			var calls atomic.Int32
			inside := make(chan struct{})
			release := make(chan struct{})
			type outcome struct {
				res inbox.Result
				err error
			}
			firstDone := make(chan outcome, 1)
			go func() {
				res, err := b.inbox.Process(ctx, record(id, 1), func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
					if err := apply("first", &calls)(ctx, tx, rec); err != nil {
						return err
					}
					close(inside)
					<-release
					if firstFails {
						return errors.New("first handler fails")
					}
					return nil
				})
				firstDone <- outcome{res, err}
			}()
			<-inside
			secondDone := make(chan outcome, 1)
			go func() {
				res, err := second.Process(ctx, record(id, 1), apply("second", &calls))
				secondDone <- outcome{res, err}
			}()
			if db.Dialect != dbtest.SQLite {
				// The second delivery is blocked on the key, not yet decided.
				// Polled every 250 ms: InnoDB refreshes the cache behind
				// INNODB_TRX only when it was not read for 100 ms, so a
				// faster poll keeps reading a stale list.
				assert.EventuallyWithT(t, func(c *assert.CollectT) {
					assert.EqualValues(c, 1, lockWaiters(t, db, b.cfg.Table))
				}, 40*time.Second, 250*time.Millisecond)
			}
			close(release)
			first, sec := <-firstDone, <-secondDone
			if firstFails {
				require.Error(t, first.err)
				require.NoError(t, sec.err)
				require.Equal(t, inbox.Processed, sec.res.Outcome, "the waiting delivery takes over")
				require.EqualValues(t, 2, calls.Load())
			} else {
				require.NoError(t, first.err)
				require.Equal(t, inbox.Processed, first.res.Outcome)
				require.NoError(t, sec.err)
				require.Equal(t, inbox.Duplicate, sec.res.Outcome, "the loser reports a duplicate")
				require.EqualValues(t, 1, calls.Load(), "the loser's handler never ran")
			}
			require.EqualValues(t, 1, b.applied(t, id), "applied exactly once")
		}

		// Many ids, each delivered by both consumers at once.
		const n = 30
		var wg sync.WaitGroup
		var calls atomic.Int32
		outcomes := make([][2]inbox.Outcome, n)
		for i := range n {
			for j, ib := range []*inbox.Inbox{b.inbox, second} {
				wg.Go(func() {
					res, err := ib.Handle(ctx, record(fmt.Sprintf("many-%d", i), int64(i)), apply(fmt.Sprint(j), &calls))
					assert.NoError(t, err)
					outcomes[i][j] = res.Outcome
				})
			}
		}
		wg.Wait()
		for i := range n {
			id := fmt.Sprintf("many-%d", i)
			require.ElementsMatch(t, []inbox.Outcome{inbox.Processed, inbox.Duplicate}, outcomes[i][:], id)
			require.EqualValues(t, 1, b.applied(t, id), id)
		}
	})
}

// Purge deletes the ids older than the retention, batch by batch, and
// keeps the others.
func TestPurge(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		m, err := metrics.NewInbox(metrics.InboxConfig{})
		require.NoError(t, err)
		b := setup(t, db, inbox.Config{Retention: time.Hour, PurgeBatch: 3, Observer: m})
		ctx := context.Background()
		old := time.Now().Add(-2 * time.Hour).UnixMilli()
		var rows []inbox.Row
		for i := range 10 {
			at := old
			if i%2 == 0 {
				at = time.Now().UnixMilli()
			}
			rows = append(rows, inbox.Row{MessageID: fmt.Sprintf("id-%02d", i), Topic: "t", Offset: int64(i), ProcessedAtMs: at})
		}
		require.NoError(t, db.DB.Table(b.inbox.TableName()).Create(&rows).Error)
		n, err := b.inbox.Purge(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 5, n)
		left := b.recorded(t)
		require.Len(t, left, 5)
		for _, r := range left {
			require.Greater(t, r.ProcessedAtMs, old)
		}
		require.Equal(t, 5.0, counterValue(t, m, metrics.NameInboxPurged, ""))
		n, err = b.inbox.Purge(ctx)
		require.NoError(t, err)
		require.Zero(t, n)

		// A purged id is processed again: the documented trade-off.
		var calls atomic.Int32
		res, err := b.inbox.Process(ctx, record("id-01", 1), apply("a", &calls))
		require.NoError(t, err)
		require.Equal(t, inbox.Processed, res.Outcome)

		// Negative retention keeps everything.
		keep, err := inbox.New(db.DB, inbox.Config{Table: b.cfg.Table, Retention: -1})
		require.NoError(t, err)
		require.NoError(t, db.DB.Table(b.inbox.TableName()).Where("message_id = ?", "id-00").Update("processed_at_ms", old).Error)
		n, err = keep.Purge(ctx)
		require.NoError(t, err)
		require.Zero(t, n)

		// RunPurge purges at once and returns when ctx ends.
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); b.inbox.RunPurge(runCtx) }()
		assert.EventuallyWithT(t, func(c *assert.CollectT) {
			var n int64
			assert.NoError(c, db.DB.Table(b.inbox.TableName()).Where("message_id = ?", "id-00").Count(&n).Error)
			assert.Zero(c, n)
		}, time.Minute, 10*time.Millisecond)
		cancel()
		<-done
	})
}

// On PostgreSQL a purge reads the expired ids through the processed_at_ms
// index and deletes them through the primary key, also under the plan
// the server makes for any parameter value: it never scans the table.
func TestPostgresPurgeUsesIndexes(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	// Setup on its own pool, closed before the counters are read.
	setupApp := db.OpenApp(t, "setup", "")
	setupDB := *db
	setupDB.DB = setupApp.DB
	b := setup(t, &setupDB, inbox.Config{Retention: time.Hour})
	old, now := time.Now().Add(-2*time.Hour).UnixMilli(), time.Now().UnixMilli()
	var rows []inbox.Row
	for i := range 2500 {
		at := old + int64(i)
		if i%5 == 0 {
			at = now
		}
		rows = append(rows, inbox.Row{MessageID: fmt.Sprintf("id-%05d", i), Topic: "t", Offset: int64(i), ProcessedAtMs: at})
	}
	require.NoError(t, setupDB.DB.Table(b.inbox.TableName()).CreateInBatches(&rows, 500).Error)
	require.NoError(t, setupDB.DB.Exec("ANALYZE "+b.inbox.TableName()).Error)
	db.CloseApp(t, setupApp)

	table := b.cfg.Table
	before := db.Scans(t, table)
	generic := db.OpenApp(t, "generic", dbtest.GenericPlans)
	ib, err := inbox.New(generic.DB, inbox.Config{Table: table, Retention: time.Hour, PurgeBatch: 500})
	require.NoError(t, err)
	n, err := ib.Purge(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 2000, n)
	db.CloseApp(t, generic)
	after := db.Scans(t, table)
	require.Equal(t, before.Seq, after.Seq, "sequential scans of %s by Purge", table)
	require.Greater(t, after.Indexes, before.Indexes, "the processed_at_ms index was used")

	var left []int64
	require.NoError(t, db.DB.Table(table).Pluck("processed_at_ms", &left).Error)
	require.Len(t, left, 500)
	for _, at := range left {
		require.Equal(t, now, at)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	for _, cfg := range []inbox.Config{
		{Table: "bad-name"},
		{Table: "ok", Schema: "x;drop"},
		{PurgeBatch: -1},
		{PurgeInterval: -time.Second},
		{RetryMin: time.Second, RetryMax: time.Millisecond},
	} {
		_, err := inbox.New(db.DB, cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig, "%+v", cfg)
	}
	_, err := inbox.New(nil, inbox.Config{})
	require.Error(t, err)
	require.ErrorIs(t, inbox.AutoMigrate(context.Background(), db.DB, "a b", ""), outbox.ErrInvalidConfig)
	cfg := inbox.Config{}.WithDefaults()
	require.Equal(t, inbox.TableDefault, cfg.Table)
	require.Equal(t, inbox.TableDefault, cfg.Name)
	require.Equal(t, "x-outbox-message-id", cfg.MessageIDHeader)
	require.Equal(t, inbox.RetentionDefault, cfg.Retention)
}
