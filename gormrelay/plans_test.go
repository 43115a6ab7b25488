package gormrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// PostgreSQL runs the store's statements as prepared statements, and after
// a few executions may plan one once for any parameter value (a generic
// plan). A statement whose generic plan scans the messages table in heap
// or primary-key order reads every row, deleted ones included, at each
// call. With every plan forced generic, a relay drains a backlog through
// its batches, acquisition and discovery, and the health probe reads the
// heads: none of it may scan the messages table, and the
// health probe reads through the (bucket, id) index, not the primary key.
func TestPostgresGenericPlansUseTheBucketIndex(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	cfg := outbox.Config{}.WithDefaults()
	table := cfg.Tables.MessagesTable()

	// Setup on its own connections, closed before the counters are read:
	// a backend reports its table statistics when it exits.
	setup := db.OpenApp(t, "setup", "")
	require.NoError(t, cfg.Tables.AutoMigrate(context.Background(), setup.DB))
	setupDB := *db
	setupDB.DB = setup.DB
	b := &storeBundle{db: &setupDB, cfg: cfg}
	rows := b.insert(t, keyed(keysN(64), 40)...)
	require.NoError(t, setup.Exec("ANALYZE "+setup.Statement.Quote(table)).Error)
	db.CloseApp(t, setup)

	before := db.Scans(t, table)
	generic := db.OpenApp(t, "generic", dbtest.GenericPlans)
	store, err := gormrelay.NewStore(generic.DB, cfg)
	require.NoError(t, err)
	rec := newRecorder()
	rc := fastConfig(t, "a")
	rc.BatchSize = 50
	rc.Parallelism = 2
	r := startRelay(t, store, rec.publisher("a", nil), rc)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Len(c, rec.ackedIDs(), len(rows))
	}, deliverWithin, 10*time.Millisecond)
	stopCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Stop(stopCtx))
	db.CloseApp(t, generic)
	drained := db.Scans(t, table)
	require.Equal(t, before.Seq, drained.Seq, "sequential scans of %s while draining", table)
	require.Greater(t, drained.Indexes, before.Indexes)

	// The health probe, on a table with rows pending again.
	setup = db.OpenApp(t, "setup", "")
	b.db.DB = setup.DB
	b.insert(t, keyed(keysN(64), 4)...)
	db.CloseApp(t, setup)
	before = db.Scans(t, table)
	generic = db.OpenApp(t, "generic", dbtest.GenericPlans)
	admin, err := gormrelay.NewAdmin(generic.DB, cfg)
	require.NoError(t, err)
	for range 3 {
		_, _, ok, err := admin.OldestPending(context.Background())
		require.NoError(t, err)
		require.True(t, ok)
	}
	db.CloseApp(t, generic)
	probed := db.Scans(t, table)
	require.Equal(t, before.Seq, probed.Seq, "sequential scans of %s by OldestPending", table)
	require.Equal(t, before.PrimaryKey, probed.PrimaryKey, "primary-key scans of %s by OldestPending", table)
	require.Greater(t, probed.Indexes, before.Indexes)
}
