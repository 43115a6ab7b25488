package pgwal_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// TestBucketCountMismatchRecovery is the procedure of docs/wal-mode.md, A
// BucketCount mismatch: writers with a larger BucketCount (16) than the
// readers' (8) stop the reader with a *relay.MisconfigurationError and
// nothing is confirmed past their messages; once the writers use 8
// again, a reader with BucketCount 16 publishes the slot up to a mark
// (WALMark, PublishedThrough), and readers with 8 go on from there. Each
// key's messages are delivered, in order.
func TestBucketCountMismatchRecovery(t *testing.T) {
	e := setup(t)
	r8 := e.reader(t, e.pub, "r8")

	// The writers with the larger count: another connection whose plugin
	// has BucketCount 16, on the same outbox.
	db16, err := dbtest.OpenGorm(dbtest.Postgres, e.db.DSN, &gorm.Config{})
	require.NoError(t, err)
	t.Cleanup(func() {
		if sqlDB, err := db16.DB(); err == nil {
			_ = sqlDB.Close()
		}
	})
	p16, err := outbox.NewPlugin(outbox.Config{Name: e.plugin.Config().Name, Mode: outbox.ModeWAL, BucketCount: 16})
	require.NoError(t, err)
	require.NoError(t, db16.Use(p16))
	e16 := *e
	e16.db = &dbtest.DB{DB: db16, Dialect: dbtest.Postgres, DSN: e.db.DSN, Namespace: e.db.Namespace}
	const keys = 16 // some of them in buckets 8..15
	stop := run(r8)
	e.write(t, keys, 0, 2)
	e.checkDelivered(t, keys, 2)
	e16.write(t, keys, 2, 4)
	<-r8.Stopped()
	err = r8.Err()
	require.True(t, relay.IsMisconfiguration(err), "%v", err)
	require.ErrorContains(t, err, "a writer uses a larger BucketCount")
	require.ErrorIs(t, stop(), err, "Run returned the error before its context ended")

	// 1. the writers use 8 again; 2. mark the WAL.
	mark, err := r8.WALMark(context.Background())
	require.NoError(t, err)
	// 3. one reader with the larger count publishes up to the mark.
	r16, err := pgwal.New(db16, p16, e.pub, ownedConfig(t, "r16"))
	require.NoError(t, err)
	stop = run(r16)
	require.Eventually(t, func() bool {
		ok, err := r16.PublishedThrough(context.Background(), mark)
		return err == nil && ok
	}, 60*time.Second, 50*time.Millisecond)
	require.NoError(t, stop())
	e.checkDelivered(t, keys, 4)

	// 4. readers with 8 go on from the mark.
	stop = run(e.reader(t, e.pub, "r8-again"))
	e.write(t, keys, 4, 6)
	e.checkDelivered(t, keys, 6)
	require.NoError(t, stop())
}
