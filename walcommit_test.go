package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/pgxtrace"
)

// walDB is a *gorm.DB on a fresh schema of the WAL server, through pgx's
// stdlib driver with its round trips counted.
type walDB struct {
	db    *gorm.DB
	sqlDB *sql.DB
	rt    *pgxtrace.RoundTrips
	dsn   string
}

// openWALCounted opens the schema of dbt again with a round-trip counting
// pgx pool, GORM config cfg (nil: defaults), and wraps the pool with wrap
// when it is not nil.
func openWALCounted(t *testing.T, dbt *dbtest.DB, cfg *gorm.Config, wrap func(*sql.DB) gorm.ConnPool, tune ...func(*pgx.ConnConfig)) *walDB {
	t.Helper()
	cc, err := pgx.ParseConfig(dbt.DSN)
	require.NoError(t, err)
	for _, f := range tune {
		f(cc)
	}
	rt := &pgxtrace.RoundTrips{}
	cc.Tracer = rt
	sqlDB := stdlib.OpenDB(*cc)
	t.Cleanup(func() { sqlDB.Close() })
	if cfg == nil {
		cfg = &gorm.Config{}
	}
	cfg.Logger = logger.Discard
	var conn gorm.ConnPool = sqlDB
	if wrap != nil {
		conn = wrap(sqlDB)
	}
	db, err := gorm.Open(postgres.New(postgres.Config{Conn: conn}), cfg)
	require.NoError(t, err)
	require.NoError(t, db.AutoMigrate(&Order{}))
	return &walDB{db: db, sqlDB: sqlDB, rt: rt, dsn: dbt.DSN}
}

// use registers a WAL mode plugin with orderRules and returns it.
func (w *walDB) use(t *testing.T, name string) *outbox.Plugin {
	t.Helper()
	p, err := outbox.NewPlugin(outbox.Config{Name: name, Mode: outbox.ModeWAL, Rules: orderRules()})
	require.NoError(t, err)
	require.NoError(t, w.db.Use(p))
	return p
}

// trips returns the round trips fn costs.
func (w *walDB) trips(t *testing.T, fn func() error) int64 {
	t.Helper()
	before := w.rt.Load()
	require.NoError(t, fn())
	return w.rt.Load() - before
}

// TestWALModeCommitCarriesTheMessages: in WAL mode on pgx, a rule's write
// and an Enqueue cost the round trips of the same transaction without the
// plugin (the messages travel with COMMIT), and arrive in order with
// their buckets, the commit hinting them.
func TestWALModeCommitCarriesTheMessages(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	none := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	wal := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	p := wal.use(t, dbtest.Name("o_"))
	prefix := p.Config().WALPrefix()
	ctx := context.Background()

	create := func(w *walDB, id uint64) func() error {
		return func() error { return w.db.WithContext(ctx).Create(&Order{ID: id, Status: "new"}).Error }
	}
	enqueue := func(w *walDB, id uint64, enq bool) func() error {
		return func() error {
			return w.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{ID: id, Status: "new"}).Error; err != nil {
					return err
				}
				if !enq {
					return nil
				}
				return outbox.Enqueue(tx, &outbox.Message{Topic: "audit", Key: key(id + 1000), Value: []byte("audit:" + strconv.FormatUint(id, 10))})
			})
		}
	}
	// Warm the driver's statement caches, whose first prepares are not
	// what is counted.
	for i := uint64(1); i <= 3; i++ {
		require.NoError(t, create(none, i)())
		require.NoError(t, create(wal, i)())
		require.NoError(t, enqueue(none, i+10, false)())
		require.NoError(t, enqueue(wal, i+10, true)())
	}
	p.Notifier().Take(nil)

	noneCreate := none.trips(t, create(none, 100))
	walCreate := wal.trips(t, create(wal, 100))
	require.Equal(t, int64(3), noneCreate, "BEGIN, INSERT, COMMIT")
	require.Equal(t, noneCreate, walCreate, "the rule's message costs no round trip")
	hints, _ := p.Notifier().Take(nil)
	require.Equal(t, []int{bucketOf(key(100))}, hints)

	noneEnq := none.trips(t, enqueue(none, 101, false))
	walEnq := wal.trips(t, enqueue(wal, 101, true))
	require.Equal(t, noneEnq, walEnq, "a rule's message and an Enqueue cost no round trip")
	hints, _ = p.Notifier().Take(nil)
	require.ElementsMatch(t, uniq(bucketOf(key(101)), bucketOf(key(1101))), hints)

	envs := decodeAll(t, slot.Messages(t, prefix))
	var got []string
	for _, e := range envs {
		got = append(got, string(e.Value))
		require.Equal(t, outbox.Bucket(e.Key, e.Partition, e.ID, outbox.BucketCountDefault), e.Bucket)
	}
	require.Equal(t, []string{
		"placed:1", "placed:11", "audit:11", "placed:2", "placed:12", "audit:12", "placed:3", "placed:13", "audit:13",
		"placed:100", "placed:101", "audit:101",
	}, got)
}

func uniq(vs ...int) []int {
	var out []int
	for _, v := range vs {
		dup := false
		for _, o := range out {
			dup = dup || o == v
		}
		if !dup {
			out = append(out, v)
		}
	}
	return out
}

func seqMessage(s string) *outbox.Message {
	return &outbox.Message{Topic: "seq", Key: []byte(s), Value: []byte(s)}
}

// values of the messages of prefix now in the slot.
func slotValues(t *testing.T, slot *dbtest.WALSlot, prefix string) []string {
	t.Helper()
	var out []string
	for _, e := range decodeAll(t, slot.Messages(t, prefix)) {
		out = append(out, string(e.Value))
	}
	return out
}

// TestWALModeHeldMessagesFollowSavepoints: a rolled-back transaction
// emits nothing; ROLLBACK TO SAVEPOINT drops exactly the messages held
// since the savepoint, RELEASE keeps them.
func TestWALModeHeldMessagesFollowSavepoints(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	p := w.use(t, dbtest.Name("o_"))
	prefix := p.Config().WALPrefix()
	enq := func(tx *gorm.DB, v string) { require.NoError(t, outbox.Enqueue(tx, seqMessage(v))) }

	errRollback := errors.New("roll back")
	require.ErrorIs(t, w.db.Transaction(func(tx *gorm.DB) error {
		enq(tx, "lost")
		return errRollback
	}), errRollback)

	require.NoError(t, w.db.Transaction(func(tx *gorm.DB) error {
		enq(tx, "a")
		require.NoError(t, tx.SavePoint("s1").Error)
		enq(tx, "b")
		require.NoError(t, tx.SavePoint("s2").Error)
		enq(tx, "c")
		require.NoError(t, tx.Exec("RELEASE SAVEPOINT s2").Error)
		enq(tx, "d")
		require.ErrorIs(t, tx.Transaction(func(tx *gorm.DB) error { // nested: a savepoint
			enq(tx, "nested-lost")
			return errRollback
		}), errRollback)
		require.NoError(t, tx.Transaction(func(tx *gorm.DB) error {
			enq(tx, "e")
			return nil
		}))
		return nil
	}))
	require.NoError(t, w.db.Transaction(func(tx *gorm.DB) error {
		enq(tx, "f")
		require.NoError(t, tx.SavePoint("s1").Error)
		enq(tx, "lost-1")
		require.NoError(t, tx.SavePoint("s2").Error)
		enq(tx, "lost-2")
		require.NoError(t, tx.Exec("RELEASE SAVEPOINT s2").Error)
		require.NoError(t, tx.RollbackTo("s1").Error)
		enq(tx, "g")
		require.NoError(t, tx.RollbackTo("s1").Error) // the savepoint survives ROLLBACK TO
		enq(tx, "h")
		return nil
	}))
	require.Equal(t, []string{"a", "b", "c", "d", "e", "f", "h"}, slotValues(t, slot, prefix))
}

// TestWALModeFailedCommit: a COMMIT that fails (a deferred constraint)
// returns the server's error and emits nothing; a transaction in which a
// statement failed returns an error at Commit, with or without held
// messages; the connection goes back to the pool idle and usable.
func TestWALModeFailedCommit(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	w.sqlDB.SetMaxOpenConns(1) // every transaction reuses the connection
	p := w.use(t, dbtest.Name("o_"))
	prefix := p.Config().WALPrefix()
	require.NoError(t, w.db.Exec("SET application_name = 'kept'").Error)
	require.NoError(t, w.db.Exec("CREATE TABLE parent (id int PRIMARY KEY)").Error)
	require.NoError(t, w.db.Exec("CREATE TABLE child (id int PRIMARY KEY, parent int REFERENCES parent(id) DEFERRABLE INITIALLY DEFERRED)").Error)

	err := w.db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("INSERT INTO child VALUES (1, 42)").Error; err != nil {
			return err
		}
		return outbox.Enqueue(tx, seqMessage("deferred"))
	})
	var pe *pgconn.PgError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, "23503", pe.Code, "foreign key violation at COMMIT")
	hints, _ := p.Notifier().Take(nil)
	require.Empty(t, hints, "a failed commit hints nothing")

	for _, withMessage := range []bool{true, false} {
		tx := w.db.Begin()
		require.NoError(t, tx.Error)
		if withMessage {
			require.NoError(t, outbox.Enqueue(tx, seqMessage("aborted")))
		}
		require.Error(t, tx.Exec("SELECT 1/0").Error)
		err := tx.Commit().Error
		if withMessage {
			require.ErrorIs(t, err, outbox.ErrCommitFailed)
		} else {
			require.ErrorIs(t, err, pgx.ErrTxCommitRollback)
		}
		require.ErrorIs(t, tx.Rollback().Error, sql.ErrTxDone)
		require.Zero(t, w.sqlDB.Stats().InUse)
	}

	require.NoError(t, w.db.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, seqMessage("after")) }))
	var name string
	require.NoError(t, w.db.Raw("SHOW application_name").Scan(&name).Error)
	require.Equal(t, "kept", name, "the connection was rolled back and kept, not discarded")
	require.Equal(t, []string{"after"}, slotValues(t, slot, prefix))
}

// TestWALModeTransactionOptions: the isolation level and read-only
// option reach the server; an unsupported level fails as pgx's stdlib
// fails it.
func TestWALModeTransactionOptions(t *testing.T) {
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	w.use(t, dbtest.Name("o_"))
	for _, c := range []struct {
		level    sql.IsolationLevel
		readOnly bool
		want     string
	}{
		{sql.LevelDefault, false, "read committed"},
		{sql.LevelReadUncommitted, true, "read uncommitted"},
		{sql.LevelReadCommitted, false, "read committed"},
		{sql.LevelRepeatableRead, true, "repeatable read"},
		{sql.LevelSnapshot, false, "repeatable read"},
		{sql.LevelSerializable, true, "serializable"},
	} {
		var level, ro string
		require.NoError(t, w.db.Transaction(func(tx *gorm.DB) error {
			if err := tx.Raw("SHOW transaction_isolation").Scan(&level).Error; err != nil {
				return err
			}
			return tx.Raw("SHOW transaction_read_only").Scan(&ro).Error
		}, &sql.TxOptions{Isolation: c.level, ReadOnly: c.readOnly}), c.level.String())
		require.Equal(t, c.want, level, c.level.String())
		require.Equal(t, map[bool]string{true: "on", false: "off"}[c.readOnly], ro, c.level.String())
	}
	for _, level := range []sql.IsolationLevel{sql.LevelWriteCommitted, sql.LevelLinearizable} {
		_, want := w.sqlDB.BeginTx(context.Background(), &sql.TxOptions{Isolation: level})
		require.Error(t, want)
		err := w.db.Transaction(func(*gorm.DB) error { return nil }, &sql.TxOptions{Isolation: level})
		require.EqualError(t, err, want.Error())
	}
	require.Zero(t, w.sqlDB.Stats().InUse)
}

// TestWALModeContextEndsTheTransaction: when the context of the
// transaction ends before Commit, the transaction is rolled back and its
// connection discarded; Commit returns the context's error.
func TestWALModeContextEndsTheTransaction(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	p := w.use(t, dbtest.Name("o_"))
	prefix := p.Config().WALPrefix()
	ctx, cancel := context.WithCancel(context.Background())
	tx := w.db.WithContext(ctx).Begin()
	require.NoError(t, tx.Error)
	t.Cleanup(func() { tx.Rollback() }) // should the test fail, the schema can still be dropped
	require.NoError(t, tx.Create(&Order{ID: 1, Status: "new"}).Error)
	require.Equal(t, 1, w.sqlDB.Stats().InUse)
	cancel()
	require.Eventually(t, func() bool { return w.sqlDB.Stats().InUse == 0 }, 10*time.Second, 5*time.Millisecond,
		"the connection is released")
	require.ErrorIs(t, tx.Commit().Error, context.Canceled)
	require.ErrorIs(t, tx.Commit().Error, sql.ErrTxDone)
	require.ErrorIs(t, tx.Rollback().Error, sql.ErrTxDone)
	require.Zero(t, w.sqlDB.Stats().OpenConnections-w.sqlDB.Stats().Idle)
	var n int64
	require.NoError(t, w.db.Model(&Order{}).Count(&n).Error)
	require.Zero(t, n)
	require.Empty(t, slotValues(t, slot, prefix))
}

// TestWALModeContextRacesCommit: with the context ending while Commit
// runs, every transaction either committed (its row and its message both
// there) or did not (neither), a nil Commit means it did, and no
// connection is left in use.
func TestWALModeContextRacesCommit(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	w.sqlDB.SetMaxOpenConns(4)
	p := w.use(t, dbtest.Name("o_"))
	prefix := p.Config().WALPrefix()
	const n = 60
	committed := make([]bool, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			tx := w.db.WithContext(ctx).Begin()
			if tx.Error != nil {
				return
			}
			if err := tx.Create(&Order{ID: uint64(i + 1), Status: "new"}).Error; err != nil {
				tx.Rollback()
				return
			}
			if i%3 != 2 {
				go cancel()
			}
			committed[i] = tx.Commit().Error == nil
		})
	}
	wg.Wait()
	require.Eventually(t, func() bool { return w.sqlDB.Stats().InUse == 0 }, 10*time.Second, 5*time.Millisecond)
	var want []string
	var wantIDs []uint64
	for i, ok := range committed {
		if ok {
			wantIDs = append(wantIDs, uint64(i+1))
			want = append(want, "placed:"+strconv.Itoa(i+1))
		}
	}
	require.NotEmpty(t, wantIDs)
	// A Commit that returned nil committed; one cut by its context while
	// COMMIT ran may have committed or not, as with database/sql's Tx. Its
	// connection is closed on the client's side, but the server may still
	// be running the COMMIT, and its row and message appear together when
	// it ends: the rows and the slot's messages are read until they agree.
	var rowsAsMessages, inSlot []string
	deadline := time.Now().Add(time.Minute)
	for {
		var ids []uint64
		require.NoError(t, w.db.Model(&Order{}).Order("id").Pluck("id", &ids).Error)
		require.Subset(t, ids, wantIDs)
		rowsAsMessages = rowsAsMessages[:0]
		for _, id := range ids {
			rowsAsMessages = append(rowsAsMessages, "placed:"+strconv.FormatUint(id, 10))
		}
		inSlot = slotValues(t, slot, prefix)
		if sameElements(rowsAsMessages, inSlot) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.ElementsMatch(t, rowsAsMessages, inSlot, "a row committed with its message or not at all")
	require.Subset(t, rowsAsMessages, want)
}

// sameElements reports whether a and b hold the same strings, each as
// many times, in any order.
func sameElements(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	n := map[string]int{}
	for _, s := range a {
		n[s]++
	}
	for _, s := range b {
		if n[s]--; n[s] < 0 {
			return false
		}
	}
	return true
}

// TestWALModePreparedStatements: with GORM's PrepareStmt, at Open and in
// a Session, the writes of a transaction run in it (a rollback undoes
// them) over many transactions that reuse the cached statements, and a
// statement not prepared through the outbox's pool is not run.
func TestWALModePreparedStatements(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	for _, at := range []string{"open", "session"} {
		t.Run(at, func(t *testing.T) {
			cfg := &gorm.Config{PrepareStmt: at == "open"}
			w := openWALCounted(t, dbtest.OpenWAL(t), cfg, nil)
			w.sqlDB.SetMaxOpenConns(2)
			p := w.use(t, dbtest.Name("o_"))
			db := w.db
			if at == "session" {
				db = db.Session(&gorm.Session{PrepareStmt: true})
			}
			var want []string
			errRollback := errors.New("roll back")
			for i := 1; i <= 30; i++ {
				err := db.Transaction(func(tx *gorm.DB) error {
					if err := tx.Create(&Order{ID: uint64(i), Status: "new"}).Error; err != nil {
						return err
					}
					if err := tx.Model(&Order{ID: uint64(i)}).Update("status", "paid").Error; err != nil {
						return err
					}
					var o Order
					if err := tx.First(&o, i).Error; err != nil {
						return err
					}
					if o.Status != "paid" {
						return fmt.Errorf("order %d reads %q in its transaction", i, o.Status)
					}
					if i%3 == 0 {
						return errRollback
					}
					return nil
				})
				if i%3 == 0 {
					require.ErrorIs(t, err, errRollback)
					continue
				}
				require.NoError(t, err)
				want = append(want, "placed:"+strconv.Itoa(i), "status:->paid")
			}
			var n int64
			require.NoError(t, db.Model(&Order{}).Count(&n).Error)
			require.Equal(t, int64(20), n, "the rolled-back transactions' writes are undone")
			got := slotValues(t, slot, p.Config().WALPrefix())
			require.Equal(t, want, got)

			// A statement from another pool is not run in the transaction.
			other, err := sql.Open("pgx", w.dsn)
			require.NoError(t, err)
			defer other.Close()
			stmt, err := other.Prepare("INSERT INTO orders (id, status, total) VALUES (999, 'x', 0)")
			require.NoError(t, err)
			defer stmt.Close()
			tx := w.db.Begin()
			require.NoError(t, tx.Error)
			_, err = tx.Statement.ConnPool.(gorm.Tx).StmtContext(context.Background(), stmt).Exec()
			require.ErrorIs(t, err, outbox.ErrStatementUnknown)
			require.NoError(t, tx.Rollback().Error)
			require.NoError(t, db.Model(&Order{}).Count(&n).Error)
			require.Equal(t, int64(20), n)
			require.Zero(t, w.sqlDB.Stats().InUse)
		})
	}
}

// TestWALModeLargeTransaction: a transaction holding more than one
// statement's worth of messages (by count and by bytes) sends them as it
// goes, and all arrive in order; a savepoint rolled back after such a
// send drops what followed it.
func TestWALModeLargeTransaction(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	p := w.use(t, dbtest.Name("o_"))
	count := &emitCounter{Interface: logger.Discard}
	big := make([]byte, 200<<10)
	var want []string
	require.NoError(t, w.db.Session(&gorm.Session{Logger: count}).Transaction(func(tx *gorm.DB) error {
		for i := range 1300 {
			v := strconv.Itoa(i)
			want = append(want, v)
			if err := outbox.Enqueue(tx, seqMessage(v)); err != nil {
				return err
			}
		}
		require.Equal(t, int64(1300-1300%(emitChunkForTest+1)), count.messages.Load(), "sent once over 500 held")
		require.NoError(t, tx.SavePoint("s").Error)
		require.Equal(t, int64(1300), count.messages.Load(), "sent with the SAVEPOINT")
		for i := range 30 { // 6 MB: over the statement bound
			m := seqMessage("dropped-" + strconv.Itoa(i))
			m.Headers = []outbox.Header{{Key: "pad", Value: big}}
			require.NoError(t, outbox.Enqueue(tx, m))
		}
		require.Greater(t, count.messages.Load(), int64(1300), "sent once over 4 MiB held")
		require.NoError(t, tx.RollbackTo("s").Error)
		for i := range 30 {
			v := "big-" + strconv.Itoa(i)
			want = append(want, v)
			m := seqMessage(v)
			m.Headers = []outbox.Header{{Key: "pad", Value: big}}
			if err := outbox.Enqueue(tx, m); err != nil {
				return err
			}
		}
		return nil
	}))
	require.Equal(t, want, slotValues(t, slot, p.Config().WALPrefix()))
}

// emitChunkForTest is the most messages one emitting statement writes.
const emitChunkForTest = 500

// otherPool is a connection pool that is not a *sql.DB.
type otherPool struct{ *sql.DB }

// TestWALModeFallbacks: where the transaction is not the plugin's pgx
// transaction (a pool that is not a *sql.DB, db.Connection), each write
// emits its messages right away in its *sql.Tx, one round trip more, with
// the same outcome.
func TestWALModeFallbacks(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	for _, c := range []struct {
		name string
		wrap func(*sql.DB) gorm.ConnPool
		run  func(db *gorm.DB, fn func(*gorm.DB) error) error
	}{
		{"pool-not-sql.DB", func(db *sql.DB) gorm.ConnPool { return otherPool{db} }, func(db *gorm.DB, fn func(*gorm.DB) error) error { return fn(db) }},
		{"connection", nil, func(db *gorm.DB, fn func(*gorm.DB) error) error { return db.Connection(fn) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := openWALCounted(t, dbtest.OpenWAL(t), nil, c.wrap)
			p := w.use(t, dbtest.Name("o_"))
			var trips []int64
			require.NoError(t, c.run(w.db, func(db *gorm.DB) error {
				for i := uint64(1); i <= 4; i++ {
					trips = append(trips, w.trips(t, func() error { return db.Session(&gorm.Session{}).Create(&Order{ID: i, Status: "new"}).Error }))
				}
				require.Error(t, db.Transaction(func(tx *gorm.DB) error {
					require.NoError(t, outbox.Enqueue(tx, seqMessage("lost")))
					return errors.New("roll back")
				}))
				return nil
			}))
			require.Equal(t, int64(4), trips[3], "BEGIN, INSERT, the emitting SELECT, COMMIT")
			require.Equal(t, []string{"placed:1", "placed:2", "placed:3", "placed:4"}, slotValues(t, slot, p.Config().WALPrefix()))
		})
	}
}

// TestWALModeSeveralPlugins: two WAL mode outboxes on one *gorm.DB hold
// their messages in the one transaction, each under its prefix, each
// hinting its own notifier; a SAVEPOINT sends what is held before it,
// COMMIT carries the rest of both.
func TestWALModeSeveralPlugins(t *testing.T) {
	slot, slotB := dbtest.NewWALSlot(t), dbtest.NewWALSlot(t) // reading one prefix consumes the slot
	none := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil)
	a := w.use(t, dbtest.Name("a_"))
	b := w.use(t, dbtest.Name("b_"))
	pa, err := outbox.Lookup(w.db, a.Config().Name)
	require.NoError(t, err)
	pb, err := outbox.Lookup(w.db, b.Config().Name)
	require.NoError(t, err)
	write := func(db *gorm.DB, id uint64, enq bool) func() error {
		return func() error {
			return db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{ID: id, Status: "new"}).Error; err != nil {
					return err
				}
				if enq {
					if err := pa.Enqueue(tx, seqMessage("a"+strconv.FormatUint(id, 10))); err != nil {
						return err
					}
				}
				require.Error(t, tx.Transaction(func(tx *gorm.DB) error {
					if enq {
						require.NoError(t, pb.Enqueue(tx, seqMessage("lost")))
						require.NoError(t, pa.Enqueue(tx, seqMessage("lost")))
					}
					return errors.New("roll back")
				}))
				if !enq {
					return nil
				}
				return pb.Enqueue(tx, seqMessage("b"+strconv.FormatUint(id, 10)))
			})
		}
	}
	require.NoError(t, write(none.db, 1, false)())
	require.NoError(t, write(w.db, 1, true)())
	a.Notifier().Take(nil)
	b.Notifier().Take(nil)
	// The rule's message and pa's are sent before the SAVEPOINT, one round
	// trip; the rest go with COMMIT.
	require.Equal(t, none.trips(t, write(none.db, 2, false))+1, w.trips(t, write(w.db, 2, true)))
	ha, _ := a.Notifier().Take(nil)
	hb, _ := b.Notifier().Take(nil)
	require.ElementsMatch(t, uniq(bucketOf(key(2)), bucketOf([]byte("a2"))), ha)
	require.ElementsMatch(t, uniq(bucketOf(key(2)), bucketOf([]byte("b2"))), hb)
	require.Equal(t, []string{"placed:1", "a1", "placed:2", "a2"}, slotValues(t, slot, a.Config().WALPrefix()))
	require.Equal(t, []string{"placed:1", "b1", "placed:2", "b2"}, slotValues(t, slotB, b.Config().WALPrefix()))
}

// TestWALModePreparedStatementsRoundTrips: with GORM's PrepareStmt, a
// write in WAL mode costs the round trips of the same write without the
// plugin: each statement is prepared on the transaction's connection and
// closed at its end, as database/sql's Tx does.
func TestWALModePreparedStatementsRoundTrips(t *testing.T) {
	none := openWALCounted(t, dbtest.OpenWAL(t), &gorm.Config{PrepareStmt: true}, nil)
	wal := openWALCounted(t, dbtest.OpenWAL(t), &gorm.Config{PrepareStmt: true}, nil)
	wal.use(t, dbtest.Name("o_"))
	for _, w := range []*walDB{none, wal} {
		w.sqlDB.SetMaxOpenConns(1)
	}
	write := func(w *walDB, id uint64) func() error {
		return func() error {
			return w.db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{ID: id, Status: "new"}).Error; err != nil {
					return err
				}
				return tx.Model(&Order{ID: id}).Update("status", "paid").Error
			})
		}
	}
	for i := uint64(1); i <= 3; i++ {
		require.NoError(t, write(none, i)())
		require.NoError(t, write(wal, i)())
	}
	n, w := none.trips(t, write(none, 10)), wal.trips(t, write(wal, 10))
	t.Logf("round trips of a PrepareStmt transaction of two writes: no plugin %d, WAL mode %d", n, w)
	require.Equal(t, n, w)
}

// TestWALModeQueryExecModes: the held messages and COMMIT's pipeline work
// in each of pgx's query execution modes (simple protocol for PgBouncer,
// no statement cache): messages arrive in order, a savepoint rolled back
// drops its own, a failed statement fails Commit.
func TestWALModeQueryExecModes(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeCacheDescribe} {
		t.Run(mode.String(), func(t *testing.T) {
			w := openWALCounted(t, dbtest.OpenWAL(t), nil, nil, func(cc *pgx.ConnConfig) { cc.DefaultQueryExecMode = mode })
			p := w.use(t, dbtest.Name("o_"))
			require.NoError(t, w.db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{ID: 1, Status: "new"}).Error; err != nil {
					return err
				}
				require.Error(t, tx.Transaction(func(tx *gorm.DB) error {
					require.NoError(t, outbox.Enqueue(tx, seqMessage("lost")))
					return errors.New("roll back")
				}))
				return outbox.Enqueue(tx, seqMessage("a"), seqMessage("b"))
			}))
			tx := w.db.Begin()
			require.NoError(t, outbox.Enqueue(tx, seqMessage("aborted")))
			require.Error(t, tx.Exec("SELECT 1/0").Error)
			require.ErrorIs(t, tx.Commit().Error, outbox.ErrCommitFailed)
			require.Equal(t, []string{"placed:1", "a", "b"}, slotValues(t, slot, p.Config().WALPrefix()))
			require.Zero(t, w.sqlDB.Stats().InUse)
		})
	}
}
