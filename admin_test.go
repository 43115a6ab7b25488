package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func TestAdminBacklog(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{})
		admin := b.plugin.Admin(b.db)
		ctx := context.Background()

		empty, err := admin.Backlog(ctx)
		require.NoError(t, err)
		require.Zero(t, empty.Pending)
		require.Zero(t, empty.OldestAge())

		start := time.Now()
		ka, kb := keysInDistinctBuckets()
		require.NoError(t, b.db.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx,
				&outbox.Message{Topic: "t", Key: ka}, &outbox.Message{Topic: "t", Key: ka}, &outbox.Message{Topic: "t", Key: kb})
		}))
		bl, err := admin.Backlog(ctx)
		require.NoError(t, err)
		require.Equal(t, int64(3), bl.Pending)
		require.Len(t, bl.Buckets, 2)
		per := map[int]int64{}
		for _, bb := range bl.Buckets {
			per[bb.Bucket] = bb.Pending
		}
		require.Equal(t, map[int]int64{bucketOf(ka): 2, bucketOf(kb): 1}, per)
		require.WithinDuration(t, start, bl.Oldest, 2*time.Second)
		require.GreaterOrEqual(t, bl.OldestAge(), time.Duration(0))
	})
}
