package gormrelay_test

import (
	"context"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

var rowsEstimate = regexp.MustCompile(`rows=(\d+)`)

// analyzedEmpty empties the messages table, analyzes it empty (no rows,
// the pages left) and writes a backlog of n rows to bucket, unknown to
// the statistics.
func analyzedEmpty(t *testing.T, b *storeBundle, bucket, n int, prefix string) {
	t.Helper()
	table := b.db.Statement.Quote(b.cfg.Tables.MessagesTable())
	require.NoError(t, b.db.Exec("DELETE FROM "+table).Error)
	require.NoError(t, b.db.Exec("ANALYZE "+table).Error)
	b.insert(t, keyed([]string{prefixedKeyInBucket(t, prefix, bucket, b.cfg.BucketCount)}, n)...)
}

// An outbox table analyzed while empty, with the pages of a drained
// backlog left: the planner takes a new backlog for one row per bucket
// and plans a batch read as a scan of the bucket's whole backlog and a
// sort. The first full batch makes the store check the estimate and
// analyze the table, after which reads walk the (bucket, id) index. On
// the store's clock, set by the test, the estimate is checked once a
// second at most and the table analyzed once a minute at most. With
// statistics that know the backlog, the store analyzes nothing.
func TestStoreAnalyzesATableTakenForEmpty(t *testing.T) {
	t.Parallel()
	for _, stale := range []bool{true, false} {
		name := "fresh"
		if stale {
			name = "stale"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := dbtest.Open(t, dbtest.Postgres)
			var logs dbtest.LogBuffer
			b := newStoreBundle(t, db, outbox.Config{
				Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
			})
			table := db.Statement.Quote(b.cfg.Tables.MessagesTable())
			bucket := 3
			b.insert(t, keyed([]string{prefixedKeyInBucket(t, "drained", bucket, b.cfg.BucketCount)}, 3000)...)
			analyzedEmpty(t, b, bucket, 3000, "backlog")
			if !stale {
				require.NoError(t, db.Exec("ANALYZE "+table).Error)
			}
			plan := func() string {
				var lines []string
				require.NoError(t, db.Raw("EXPLAIN SELECT * FROM "+table+
					" WHERE bucket >= ? AND bucket <= ? ORDER BY bucket, id LIMIT 500", bucket, bucket).Scan(&lines).Error)
				return strings.Join(lines, "\n")
			}
			estimate := func() int {
				var lines []string
				require.NoError(t, db.Raw("EXPLAIN SELECT 1 FROM "+table+" WHERE bucket >= ? AND bucket <= ?", bucket, bucket).Scan(&lines).Error)
				m := rowsEstimate.FindStringSubmatch(lines[0])
				require.NotNil(t, m, lines[0])
				n, err := strconv.Atoi(m[1])
				require.NoError(t, err)
				return n
			}
			if stale {
				// On a table this small the planner still walks the index
				// for one estimated row; with 500,000 rows it may sort
				// (BENCHMARKS.md, "An outbox analyzed empty").
				require.Less(t, estimate(), 500, "the statistics say the table is empty")
			}

			ctx := context.Background()
			start := time.Now()
			gormrelay.SetEstimateClock(b.store, func() time.Time { return start })
			msgs, err := b.store.NextBatch(ctx, bucket, 500)
			require.NoError(t, err)
			require.Len(t, msgs, 500)
			require.Equal(t, 1, gormrelay.EstimateChecks(b.store))
			if !stale {
				require.Zero(t, gormrelay.Analyzed(b.store))
				require.NotContains(t, logs.String(), "analyzed")
				return
			}
			require.Equal(t, 1, gormrelay.Analyzed(b.store))
			require.GreaterOrEqual(t, estimate(), 1500, "the statistics know the backlog")
			require.NotContains(t, plan(), "Sort")
			require.Contains(t, plan(), "Index Scan using")
			require.Contains(t, logs.String(), "the relay analyzed it")

			// Stale again (the table analyzed empty once more): half a
			// second after the first, no check; after a second, a check
			// but no ANALYZE; after a minute, an ANALYZE.
			analyzedEmpty(t, b, bucket, 3000, "again")
			require.Less(t, estimate(), 500)
			for _, step := range []struct {
				after            time.Duration
				checks, analyses int
			}{
				{500 * time.Millisecond, 1, 1},
				{2 * time.Second, 2, 1},
				{61 * time.Second, 3, 2},
			} {
				gormrelay.SetEstimateClock(b.store, func() time.Time { return start.Add(step.after) })
				msgs, err = b.store.NextBatch(ctx, bucket, 500)
				require.NoError(t, err)
				require.Len(t, msgs, 500)
				require.Equal(t, step.checks, gormrelay.EstimateChecks(b.store), "checks %s after the first", step.after)
				require.Equal(t, step.analyses, gormrelay.Analyzed(b.store), "analyses %s after the first", step.after)
			}
		})
	}
}

// ANALYZE by a user that does not own the table only warns in PostgreSQL
// and changes nothing. A relay connected as such a user finds the
// estimate still stale after its ANALYZE, warns once, and its reads go
// on.
func TestStoreWarnsWhenItCannotAnalyze(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	b := newStoreBundle(t, db, outbox.Config{})
	role := dbtest.Name("outbox_relay_")
	for _, q := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA " + db.Namespace + " TO " + role,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA " + db.Namespace + " TO " + role,
	} {
		require.NoError(t, db.Exec(q).Error)
	}
	t.Cleanup(func() {
		_ = db.Exec("DROP OWNED BY " + role).Error
		_ = db.Exec("DROP ROLE " + role).Error
	})
	relayDB, err := dbtest.OpenGorm(dbtest.Postgres, db.DSN+" user="+role, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	t.Cleanup(func() {
		if sqlDB, err := relayDB.DB(); err == nil {
			_ = sqlDB.Close()
		}
	})
	var logs dbtest.LogBuffer
	store, err := gormrelay.NewStore(relayDB, outbox.Config{
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	require.NoError(t, err)

	bucket := 5
	b.insert(t, keyed([]string{prefixedKeyInBucket(t, "drained", bucket, b.cfg.BucketCount)}, 1000)...)
	analyzedEmpty(t, b, bucket, 1000, "backlog")

	msgs, err := store.NextBatch(context.Background(), bucket, 200)
	require.NoError(t, err)
	require.Len(t, msgs, 200)
	require.Equal(t, 1, gormrelay.Analyzed(store))
	require.Contains(t, logs.String(), "level=WARN")
	require.Contains(t, logs.String(), "did not mend it")
	require.NotContains(t, logs.String(), "the relay analyzed it")
}
