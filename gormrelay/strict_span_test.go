package gormrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// spanMarkerBytes is a MarkerMaxBytes that lists no more than about 35
// ids: a batch of spanRows is recorded as its span.
const spanMarkerBytes = 64

// spanGap is the id left free inside the batch's span.
const spanFirst, spanGap, spanRows = 1000, 1030, 60

// strictSpanPending fills a one-bucket outbox with ten messages for each
// of six keys, ids spanFirst onwards but spanGap, and returns a
// strict-mode publisher factory whose markers hold a batch of them only
// as a span.
func strictSpanPending(t *testing.T, db *dbtest.DB) (*kafkatest.Cluster, string, *storeBundle, []string, func() *publisher.Transactional) {
	t.Helper()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)
	b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
	keys := keysN(6)
	rows := withTopic(topic, keyed(keys, 10))
	require.Len(t, rows, spanRows)
	for i := range rows {
		rows[i].ID = spanFirst + int64(i)
		if rows[i].ID >= spanGap {
			rows[i].ID++
		}
	}
	b.insert(t, rows...)
	prefix := strictPrefix(t)
	pub := func() *publisher.Transactional {
		return publishertest.StartTransactional(t, publisher.TransactionalConfig{
			Brokers:               c.Brokers(),
			TransactionalIDPrefix: prefix,
			Configure:             strictSaramaConfig,
			MarkerMaxBytes:        spanMarkerBytes,
			Logger:                dbtest.Logger(t),
		})
	}
	return c, topic, b, keys, pub
}

// spanConfig reads the whole outbox in one batch.
func spanConfig(t *testing.T, id string) relay.Config {
	cfg := fastConfig(t, id)
	cfg.BucketCount = 1
	cfg.BatchSize = 100
	return cfg
}

// crashAfterCommit runs relay a until it has committed its first batch
// and failed to delete it, then stops it, its store gone: the bucket's
// lease stays until it expires.
func crashAfterCommit(t *testing.T, b *storeBundle, pub relay.Publisher) {
	t.Helper()
	dying := &deleteFails{crashStore: &crashStore{Store: b.store}, die: true}
	a, err := relay.New(dying, pub, spanConfig(t, "a"))
	require.NoError(t, err)
	require.NoError(t, a.Start(context.Background()))
	require.Eventually(t, func() bool { return dying.refused.Load() > 0 }, deliverWithin, 5*time.Millisecond,
		"relay a publishes and fails to delete")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, a.Stop(ctx))
}

// A batch whose ids do not fit the progress marker is committed whole, its
// marker recording the span of its ids. Relay a dies after the commit,
// before its delete; relay b finds exactly the batch's rows in the span,
// deletes them and publishes nothing again: every message exactly once.
func TestStrictTakeoverDeletesCommittedSpan(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c, topic, b, keys, pub := strictSpanPending(t, db)
		crashAfterCommit(t, b, pub())
		require.Equal(t, spanRows, len(c.ReadLog(t, topic, 15*time.Second, kafkatest.ReadCommitted())),
			"one transaction carried the whole batch")
		require.EqualValues(t, spanRows, b.count(t), "relay a deleted nothing")

		startRelay(t, b.store, pub(), spanConfig(t, "b"))
		b.requireDrained(t)
		requireExactlyOnce(t, c, topic, keys, 10)
	})
}

// A row committed late by a slower transaction, with an id inside the
// span of a batch committed but not deleted, is not that batch's: relay b
// finds one row more in the span than the marker counts and deletes
// nothing. It publishes the late row, and the batch again: a duplicate,
// never a loss.
func TestStrictSpanLateRowDeletesNothing(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c, topic, b, keys, pub := strictSpanPending(t, db)
		crashAfterCommit(t, b, pub())
		b.insert(t, withTopic(topic, []outbox.MessageRow{{ID: spanGap, MessageID: "late-0", Key: []byte("late"), Value: []byte("late/0")}})...)

		startRelay(t, b.store, pub(), spanConfig(t, "b"))
		b.requireDrained(t)
		got := committedValues(t, c, topic, kafkatest.ReadCommitted())
		require.Equal(t, []string{"late/0"}, got["late"], "the late row is published")
		for _, k := range keys {
			require.Equal(t, append(seqValues(k, 10), seqValues(k, 10)...), got[k],
				"key %s: the batch published again, in order, since the span held a row it did not carry", k)
		}
	})
}
