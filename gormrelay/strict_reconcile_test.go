package gormrelay_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/relay"
)

// deleteFails makes the delete of published rows fail: the relay's
// database goes away between the Kafka transaction's commit and the
// delete. With die set, the relay process is gone from then on (every
// store call fails: it can neither renew nor release its leases);
// without, only the deletes until healed fail.
type deleteFails struct {
	*crashStore
	die     bool
	healed  atomic.Bool
	refused atomic.Int64 // deletes refused
}

func (d *deleteFails) refuse() bool {
	if d.healed.Load() {
		return false
	}
	d.refused.Add(1)
	if d.die {
		d.dead.Store(true)
	}
	return true
}

func (d *deleteFails) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	if d.dead.Load() || d.refuse() {
		return errCrashed
	}
	return d.Store.MarkPublished(ctx, id, l, msgs)
}

func (d *deleteFails) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	if d.dead.Load() || d.refuse() {
		return nil, errCrashed
	}
	return d.Store.MarkPublishedNext(ctx, id, l, msgs, limit)
}

// strictPending starts a cluster and a topic, and fills a two-bucket
// outbox with ten messages for each of keys.
func strictPending(t *testing.T, db *dbtest.DB) (c *kafkatest.Cluster, topic string, b *storeBundle, keys []string) {
	t.Helper()
	c = kafkatest.Start(t)
	topic = c.Topic(t, 3)
	b = newStoreBundle(t, db, outbox.Config{BucketCount: 2})
	keys = keysN(6)
	b.insert(t, withTopic(topic, keyed(keys, 10))...)
	return c, topic, b, keys
}

// requireExactlyOnce checks that a read_committed consumer sees each key's
// values once each, in order.
func requireExactlyOnce(t *testing.T, c *kafkatest.Cluster, topic string, keys []string, perKey int) {
	t.Helper()
	got := committedValues(t, c, topic, kafkatest.ReadCommitted())
	for _, k := range keys {
		require.Equal(t, seqValues(k, perKey), got[k], "key %s: each value exactly once, in order", k)
	}
}

// A strict-mode relay commits its batches' Kafka transactions and dies
// before it deletes the rows. The relay that takes the buckets over learns
// from the progress marker the transactions committed which rows Kafka
// holds, deletes them, and publishes nothing again: a read_committed
// consumer sees every message exactly once.
func TestStrictTakeoverDeletesCommittedRows(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c, topic, b, keys := strictPending(t, db)
		prefix := strictPrefix(t)

		cfg := func(id string) relay.Config {
			cfg := fastConfig(t, id)
			cfg.BucketCount = 2
			cfg.BatchSize = 100 // one batch per bucket
			return cfg
		}
		dying := &deleteFails{crashStore: &crashStore{Store: b.store}, die: true}
		a, err := relay.New(dying, newStrictPublisher(t, c, prefix, 0), cfg("a"))
		require.NoError(t, err)
		require.NoError(t, a.Start(context.Background()))
		require.Eventually(t, func() bool { return dying.refused.Load() > 0 }, deliverWithin, 5*time.Millisecond,
			"relay a publishes and fails to delete")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, a.Stop(ctx)) // its release fails: the leases stay until they expire
		require.NotZero(t, b.count(t), "relay a deleted nothing")

		startRelay(t, b.store, newStrictPublisher(t, c, prefix, 0), cfg("b"))
		b.requireDrained(t)
		requireExactlyOnce(t, c, topic, keys, 10)
	})
}

// A strict-mode relay whose delete fails after the commit keeps its lease:
// before its next batch of the bucket it deletes what the last transaction
// committed, instead of publishing those rows again.
func TestStrictFailedDeleteNotRepublished(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c, topic, b, keys := strictPending(t, db)

		cfg := fastConfig(t, "a")
		cfg.BucketCount = 2
		cfg.BatchSize = 7 // several batches per bucket, read ahead with the delete
		flaky := &deleteFails{crashStore: &crashStore{Store: b.store}}
		startRelay(t, flaky, newStrictPublisher(t, c, strictPrefix(t), 0), cfg)
		require.Eventually(t, func() bool { return flaky.refused.Load() >= 3 }, deliverWithin, 5*time.Millisecond,
			"the relay publishes and fails to delete")
		flaky.healed.Store(true)
		b.requireDrained(t)
		requireExactlyOnce(t, c, topic, keys, 10)
	})
}

// Two outboxes that share a TransactionalIDPrefix (here two outbox tables
// of one database, whose row ids both start at 1) read each other's
// progress markers. A marker names ids the other outbox's table holds too,
// but other messages: the relay deletes none of them, and every message of
// both outboxes is published. (Before the marker carried the digest of its
// messages, the second outbox's rows were deleted unpublished.)
func TestStrictSharedPrefixLosesNothing(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c, topic, first, keys := strictPending(t, db)
		second := newStoreBundle(t, db, outbox.Config{BucketCount: 2, Tables: outbox.WithPrefix("other_")})
		otherTopic := c.Topic(t, 3)
		rows := keyed(keys, 10)
		for i := range rows {
			rows[i].MessageID = "other-" + rows[i].MessageID // message ids are unique (UUIDs), ids are not
		}
		second.insert(t, withTopic(otherTopic, rows)...)
		prefix := strictPrefix(t)
		cfg := func(id string) relay.Config {
			cfg := fastConfig(t, id)
			cfg.BucketCount = 2
			cfg.BatchSize = 100 // one batch per bucket: the marker names every row
			return cfg
		}

		a := startRelay(t, first.store, newStrictPublisher(t, c, prefix, 0), cfg("a"))
		first.requireDrained(t)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, a.Stop(ctx))

		startRelay(t, second.store, newStrictPublisher(t, c, prefix, 0), cfg("b"))
		second.requireDrained(t)
		requireExactlyOnce(t, c, topic, keys, 10)
		requireExactlyOnce(t, c, otherTopic, keys, 10)
	})
}
