package pgwal

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// TestLeaseTableCurrent: the one-query check of the lease table agrees
// with what AutoMigrate creates, so a reader's start skips AutoMigrate
// for a current table; a missing table, a missing column or a column of
// another type is not current, and migrate repairs it.
func TestLeaseTableCurrent(t *testing.T) {
	ctx := context.Background()
	db := dbtest.Open(t, dbtest.Postgres)
	l := &leases{db: db.DB, table: "wal_leases_check", slot: "s", me: "r", dur: time.Minute}

	ok, err := l.current(ctx)
	require.NoError(t, err)
	require.False(t, ok, "no table")
	require.NoError(t, l.migrate(ctx))
	ok, err = l.current(ctx)
	require.NoError(t, err)
	require.True(t, ok, "the table AutoMigrate created")

	for _, change := range []string{
		"ALTER TABLE wal_leases_check DROP COLUMN lag_bucket",
		"ALTER TABLE wal_leases_check ALTER COLUMN owner TYPE varchar(64)",
	} {
		require.NoError(t, db.Exec(change).Error)
		ok, err = l.current(ctx)
		require.NoError(t, err)
		require.False(t, ok, change)
		require.NoError(t, l.migrate(ctx), change)
		ok, err = l.current(ctx)
		require.NoError(t, err)
		require.True(t, ok, "migrate repaired: "+change)
	}

	// AutoMigrate leaves a column's nullability as it is: such a table
	// is never current and every start runs AutoMigrate, as it did
	// before the check.
	require.NoError(t, db.Exec("ALTER TABLE wal_leases_check ALTER COLUMN term DROP NOT NULL").Error)
	ok, err = l.current(ctx)
	require.NoError(t, err)
	require.False(t, ok, "term nullable")
	require.NoError(t, l.migrate(ctx))
	require.NoError(t, db.Exec("ALTER TABLE wal_leases_check ALTER COLUMN term SET NOT NULL").Error)

	// A schema-qualified name is found in its schema.
	q := &leases{db: db.DB, table: db.Namespace + ".wal_leases_check"}
	ok, err = q.current(ctx)
	require.NoError(t, err)
	require.True(t, ok)
}

// BenchmarkLeaseMigrate is a reader's start on a current lease table:
// the one-query check (current) against AutoMigrate (automigrate), which
// main ran on every start, on the WAL mode server.
func BenchmarkLeaseMigrate(b *testing.B) {
	ctx := context.Background()
	db := dbtest.OpenWAL(b)
	l := &leases{db: db.DB, table: "wal_leases_bench", slot: "s", me: "r", dur: time.Minute}
	require.NoError(b, l.migrate(ctx))
	b.Run("current", func(b *testing.B) {
		for range b.N {
			require.NoError(b, l.migrate(ctx))
		}
	})
	b.Run("automigrate", func(b *testing.B) {
		for range b.N {
			require.NoError(b, db.DB.WithContext(ctx).Table(l.table).AutoMigrate(&SlotLease{}))
		}
	})
}
