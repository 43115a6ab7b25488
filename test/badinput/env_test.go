package badinput_test

import (
	"context"
	"log/slog"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/relay"
)

// env is one case's outbox: its own tables (a random prefix) in the
// dialect's isolated database, a writer connection with the plugin, and a
// business table written in the same transactions as the messages.
type env struct {
	t       *testing.T
	base    *dbtest.DB
	dialect string
	cluster *kafkatest.Cluster
	db      *gorm.DB // the writers' connection, with the plugin
	plugin  *outbox.Plugin
	cfg     outbox.Config // with defaults
	items   string        // the business table, quoted
	nextID  int
}

// newEnv builds a case's outbox on base. migrate creates the outbox
// tables.
func newEnv(t *testing.T, base *dbtest.DB, cluster *kafkatest.Cluster, cfg outbox.Config, migrate bool) *env {
	t.Helper()
	prefix := dbtest.Name("b") + "_"
	if cfg.Tables == (outbox.Tables{}) {
		cfg.Tables = outbox.WithPrefix(prefix)
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	p, err := outbox.NewPlugin(cfg)
	require.NoError(t, err)
	e := &env{t: t, base: base, dialect: base.Dialect, cluster: cluster, plugin: p, cfg: p.Config()}
	e.db = e.open(nil)
	require.NoError(t, e.db.Use(p))
	if migrate {
		require.NoError(t, p.AutoMigrate(context.Background(), e.db))
	}
	e.items = e.db.Statement.Quote(prefix + "items")
	require.NoError(t, e.db.Exec("CREATE TABLE "+e.items+" (id INTEGER PRIMARY KEY, note VARCHAR(64))").Error)
	return e
}

// open returns another connection to the case's database, as another
// process would have, closed when the test ends.
func (e *env) open(cfg *gorm.Config) *gorm.DB {
	e.t.Helper()
	if cfg == nil {
		cfg = &gorm.Config{Logger: logger.Discard}
	}
	db, err := dbtest.OpenGorm(e.dialect, e.base.DSN, cfg)
	require.NoError(e.t, err)
	sqlDB, err := db.DB()
	require.NoError(e.t, err)
	e.t.Cleanup(func() { sqlDB.Close() })
	return db
}

// write runs one business transaction: a business row and msgs.
func (e *env) write(msgs ...*outbox.Message) error {
	e.nextID++
	id := e.nextID
	return e.db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Exec("INSERT INTO "+e.items+" (id, note) VALUES (?, ?)", id, "item").Error; err != nil {
			return err
		}
		return e.plugin.Enqueue(tx, msgs...)
	})
}

func (e *env) countOf(table string) int64 {
	e.t.Helper()
	var n int64
	require.NoError(e.t, e.db.Raw("SELECT COUNT(*) FROM "+table).Scan(&n).Error)
	return n
}

func (e *env) pending() int64 { return e.countOf(e.db.Statement.Quote(e.cfg.Tables.MessagesTable())) }
func (e *env) dead() int64    { return e.countOf(e.db.Statement.Quote(e.cfg.Tables.DeadLettersTable())) }
func (e *env) itemRows() int64 {
	return e.countOf(e.items)
}

// requireRolledBack checks that nothing of a refused transaction remains.
func (e *env) requireRolledBack(itemsBefore, pendingBefore int64) {
	e.t.Helper()
	require.Equal(e.t, itemsBefore, e.itemRows(), "the business row was rolled back")
	require.Equal(e.t, pendingBefore, e.pending(), "no outbox row was written")
}

// store returns a relay store on db (the writers' connection if nil) with
// the case's tables and the given bucket count (the case's if 0).
func (e *env) store(db *gorm.DB, buckets int) *gormrelay.Store {
	e.t.Helper()
	if db == nil {
		db = e.db
	}
	cfg := e.cfg
	if buckets > 0 {
		cfg.BucketCount = buckets
	}
	s, err := gormrelay.NewStore(db, cfg)
	require.NoError(e.t, err)
	return s
}

// relayConfig is a relay configuration with short timings. Its lease is
// long enough that a busy machine's slow queries do not let a relay's own
// leases lapse mid-drain (DrainOnce would then report its own buckets as
// held by others).
func (e *env) relayConfig(id string) relay.Config {
	return relay.Config{
		RelayID:            id,
		BucketCount:        e.cfg.BucketCount,
		BatchSize:          50,
		PollInterval:       50 * time.Millisecond,
		LeaseDuration:      2 * time.Second,
		LeaseRenewInterval: 500 * time.Millisecond,
		BackoffMin:         10 * time.Millisecond,
		BackoffMax:         100 * time.Millisecond,
		Logger:             testLogger(e.t),
	}
}

// startErr builds a relay and returns what Start returned; a relay that
// started is stopped when the test ends.
func (e *env) startErr(store relay.Store, pub relay.Publisher, cfg relay.Config) (*relay.Relay, error) {
	e.t.Helper()
	r, err := relay.New(store, pub, cfg)
	require.NoError(e.t, err)
	if err := r.Start(context.Background()); err != nil {
		return r, err
	}
	e.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
	return r, nil
}

// startRelay starts a relay that the test stops when it ends.
func (e *env) startRelay(store relay.Store, pub relay.Publisher, cfg relay.Config) *relay.Relay {
	e.t.Helper()
	r, err := relay.New(store, pub, cfg)
	require.NoError(e.t, err)
	require.NoError(e.t, r.Start(context.Background()))
	e.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Stop(ctx)
	})
	return r
}

// waitPending waits until the messages table holds n rows.
func (e *env) waitPending(n int64, within time.Duration) {
	e.t.Helper()
	require.Eventually(e.t, func() bool { return e.pending() == n }, within, 20*time.Millisecond,
		"pending rows never reached %d", n)
}

// sink is an in-process publisher that records what it acknowledged.
type sink struct {
	mu    sync.Mutex
	acked []relay.Message
	calls int
	hook  func(ctx context.Context, call int, msgs []relay.Message) (int, error)
}

func (s *sink) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	s.mu.Lock()
	s.calls++
	call := s.calls
	hook := s.hook
	s.mu.Unlock()
	n, err := len(msgs), error(nil)
	if hook != nil {
		n, err = hook(ctx, call, msgs)
	}
	s.mu.Lock()
	s.acked = append(s.acked, msgs[:max(0, min(n, len(msgs)))]...)
	s.mu.Unlock()
	return n, err
}

func (s *sink) ids() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]int{}
	for _, m := range s.acked {
		out[m.MessageID]++
	}
	return out
}

// msg builds a message to the topic.
func msg(topic, key, value string) *outbox.Message {
	return &outbox.Message{Topic: topic, Key: []byte(key), Value: []byte(value)}
}

// testLogger discards logs unless OUTBOX_TEST_LOG is set.
func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
}

// sqlRecorder is a GORM logger that records every statement GORM runs.
type sqlRecorder struct {
	mu    sync.Mutex
	stmts []string
}

func (r *sqlRecorder) LogMode(logger.LogLevel) logger.Interface { return r }
func (r *sqlRecorder) Info(context.Context, string, ...any)     {}
func (r *sqlRecorder) Warn(context.Context, string, ...any)     {}
func (r *sqlRecorder) Error(context.Context, string, ...any)    {}
func (r *sqlRecorder) Trace(_ context.Context, _ time.Time, fc func() (string, int64), _ error) {
	sql, _ := fc()
	r.mu.Lock()
	r.stmts = append(r.stmts, sql)
	r.mu.Unlock()
}

func (r *sqlRecorder) reset() {
	r.mu.Lock()
	r.stmts = nil
	r.mu.Unlock()
}

func (r *sqlRecorder) statements() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.stmts)
}

// gormSilent is a GORM logger that discards everything.
func gormSilent() logger.Interface { return logger.Discard }
