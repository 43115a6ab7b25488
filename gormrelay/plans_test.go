package gormrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// PostgreSQL runs the store's statements as prepared statements, and after
// a few executions may plan one once for any parameter value (a generic
// plan). A statement whose generic plan scans the messages table in heap
// or primary-key order reads every row, deleted ones included, at each
// call. With every plan forced generic, a relay drains a backlog through
// solo and set batches, acquisition and discovery, and the health probe
// reads the heads: none of it may scan the messages table, and the
// health probe reads through the (bucket, id) index, not the primary key.
func TestPostgresGenericPlansUseTheBucketIndex(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	cfg := outbox.Config{}.WithDefaults()
	table := cfg.Tables.MessagesTable()

	// Setup on its own connections, closed before the counters are read:
	// a backend reports its table statistics when it exits.
	setup := openApp(t, db.DSN, "outbox-plans-setup")
	require.NoError(t, cfg.Tables.AutoMigrate(context.Background(), setup))
	b := &storeBundle{db: &dbtest.DB{DB: setup, Dialect: db.Dialect, DSN: db.DSN, Namespace: db.Namespace}, cfg: cfg}
	rows := b.insert(t, keyed(keysN(64), 40)...)
	require.NoError(t, setup.Exec("ANALYZE "+setup.Statement.Quote(table)).Error)
	closeApp(t, db, setup, "outbox-plans-setup")

	before := scanCounts(t, db, table)
	generic := openApp(t, db.DSN+" plan_cache_mode=force_generic_plan", "outbox-plans-generic")
	store, err := gormrelay.NewStore(generic, cfg)
	require.NoError(t, err)
	rec := newRecorder()
	rc := fastConfig(t, "a")
	rc.BatchSize = 50
	rc.Parallelism = 2
	rc.MaxBatchBuckets = 8
	r := startRelay(t, store, rec.publisher("a", nil), rc)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Len(c, rec.ackedIDs(), len(rows))
	}, deliverWithin, 10*time.Millisecond)
	stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Stop(stopCtx))
	closeApp(t, db, generic, "outbox-plans-generic")
	drained := scanCounts(t, db, table)
	require.Equal(t, before.seq, drained.seq, "sequential scans of %s while draining", table)
	require.Greater(t, drained.bucketIndex, before.bucketIndex)

	// The health probe, on a table with rows pending again.
	setup = openApp(t, db.DSN, "outbox-plans-setup")
	b.db.DB = setup
	b.insert(t, keyed(keysN(64), 4)...)
	closeApp(t, db, setup, "outbox-plans-setup")
	before = scanCounts(t, db, table)
	generic = openApp(t, db.DSN+" plan_cache_mode=force_generic_plan", "outbox-plans-generic")
	admin, err := gormrelay.NewAdmin(generic, cfg)
	require.NoError(t, err)
	for range 3 {
		_, _, ok, err := admin.OldestPending(context.Background())
		require.NoError(t, err)
		require.True(t, ok)
	}
	closeApp(t, db, generic, "outbox-plans-generic")
	probed := scanCounts(t, db, table)
	require.Equal(t, before.seq, probed.seq, "sequential scans of %s by OldestPending", table)
	require.Equal(t, before.primaryKey, probed.primaryKey, "primary-key scans of %s by OldestPending", table)
	require.Greater(t, probed.bucketIndex, before.bucketIndex)
}

// openApp opens a GORM connection pool to dsn whose backends carry name as
// their application_name.
func openApp(t *testing.T, dsn, name string) *gorm.DB {
	t.Helper()
	g, err := dbtest.OpenGorm(dbtest.Postgres, dsn+" application_name="+name, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := g.DB()
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	return g
}

// closeApp closes g's pool and waits until its backends, named name, are
// gone, so that their statistics are reported.
func closeApp(t *testing.T, db *dbtest.DB, g *gorm.DB, name string) {
	t.Helper()
	sqlDB, err := g.DB()
	require.NoError(t, err)
	require.NoError(t, sqlDB.Close())
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		var n int64
		assert.NoError(c, db.Raw("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = ?", name).Scan(&n).Error)
		assert.Zero(c, n)
	}, deliverWithin, 10*time.Millisecond)
}

// scans are the statistics counters of the scans of a messages table.
type scans struct {
	seq         int64 // sequential scans of the table
	primaryKey  int64 // scans of its primary key
	bucketIndex int64 // scans of its other indexes: the (bucket, id) one
}

// scanCounts reads table's scan counters in db's schema.
func scanCounts(t *testing.T, db *dbtest.DB, table string) scans {
	t.Helper()
	var s scans
	require.NoError(t, db.Raw("SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = ? AND relname = ?",
		db.Namespace, table).Row().Scan(&s.seq))
	require.NoError(t, db.Raw(`SELECT
		COALESCE(SUM(s.idx_scan) FILTER (WHERE i.indisprimary), 0),
		COALESCE(SUM(s.idx_scan) FILTER (WHERE NOT i.indisprimary), 0)
		FROM pg_stat_user_indexes s JOIN pg_index i ON i.indexrelid = s.indexrelid
		WHERE s.schemaname = ? AND s.relname = ?`, db.Namespace, table).Row().Scan(&s.primaryKey, &s.bucketIndex))
	return s
}
