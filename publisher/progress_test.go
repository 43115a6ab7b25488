package publisher_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// withIDs numbers msgs from first, step apart.
func withIDs(msgs []relay.Message, first, step int64) []relay.Message {
	for i := range msgs {
		msgs[i].ID = first + int64(i)*step
	}
	return msgs
}

// The bucket's next owner learns from the progress marker exactly which
// rows the last committed transaction carried, whatever topic it went to;
// an aborted transaction leaves the marker as it was; a bucket never
// published has none.
func TestTransactionalReconcile(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topicA, topicB := c.Topic(t, 1), c.Topic(t, 2)
	prefix := txnPrefix(t)
	sameID := func(cfg *publisher.TransactionalConfig) { cfg.TransactionalIDPrefix = prefix }
	a := newTransactional(t, c, sameID)
	require.Equal(t, prefix+"progress-3", a.ProgressGroup(3))

	got, err := a.Reconcile(testCtx(t), relay.Lease{Bucket: 3, Term: 1})
	require.NoError(t, err)
	require.Zero(t, got, "first acquisition: nothing committed yet")

	acked, err := a.Publish(testCtx(t), inBucket(withIDs(publishertest.Messages(topicA, "a1", 4), 10, 8), 3))
	require.NoError(t, err)
	require.Equal(t, 4, acked)
	second := inBucket(withIDs(publishertest.Messages(topicB, "a2", 3), 50, 1_000_003), 3)
	acked, err = a.Publish(testCtx(t), second)
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	got, err = a.Reconcile(testCtx(t), relay.Lease{Bucket: 3, Term: 1})
	require.NoError(t, err)
	require.Equal(t, relay.Committed{IDs: []int64{50, 1_000_053, 2_000_056}, Digest: relay.MessagesDigest(second)}, got, "the producer remembers its last commit")
	// A batch that fails before its commit leaves the marker as it was.
	bad := inBucket(withIDs(publishertest.Messages(topicA, "bad", 2), 9_000_000, 1), 3)
	bad[1].Partition = ptr(int32(7)) // topicA has one partition
	acked, err = a.Publish(testCtx(t), bad)
	require.Error(t, err)
	require.Zero(t, acked)

	// Another relay takes bucket 3 over: its producer fences a's and reads
	// the marker a's last commit left, in topic B's entry.
	b := newTransactional(t, c, sameID)
	require.NoError(t, b.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 3, Term: 2}}))
	got, err = b.Reconcile(testCtx(t), relay.Lease{Bucket: 3, Term: 2})
	require.NoError(t, err)
	require.Equal(t, relay.Committed{IDs: []int64{50, 1_000_053, 2_000_056}, Digest: relay.MessagesDigest(second)}, got,
		"the marker carries the digest of the batch's message ids")

	// b's commits continue the sequence: a third owner reads b's.
	fromB := inBucket(withIDs(publishertest.Messages(topicA, "b1", 2), 70, 1), 3)
	acked, err = b.Publish(testCtx(t), fromB)
	require.NoError(t, err)
	require.Equal(t, 2, acked)
	third := newTransactional(t, c, sameID)
	got, err = third.Reconcile(testCtx(t), relay.Lease{Bucket: 3, Term: 3})
	require.NoError(t, err)
	require.Equal(t, relay.Committed{IDs: []int64{70, 71}, Digest: relay.MessagesDigest(fromB)}, got, "the newest entry wins, not the other topic's")

	want := append(ids(publishertest.Messages(topicA, "a1", 4)), ids(publishertest.Messages(topicA, "b1", 2))...)
	require.Equal(t, want, ids(readCommitted(t, c, topicA)))
}

// A batch of ascending row ids (the relay's) that do not fit
// MarkerMaxBytes is published whole: its marker records their span, which
// the bucket's next owner reads.
func TestTransactionalMarkerSpan(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	prefix := txnPrefix(t)
	small := func(cfg *publisher.TransactionalConfig) { cfg.MarkerMaxBytes, cfg.TransactionalIDPrefix = 64, prefix }
	tx := newTransactional(t, c, small)
	msgs := inBucket(withIDs(publishertest.Messages(topic, "span", 40), 1_000_000, 1_000_000), 0)
	acked, err := tx.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)
	want := relay.Committed{First: 1_000_000, Last: 40_000_000, Count: 40, Digest: relay.MessagesDigest(msgs)}
	got, err := tx.Reconcile(testCtx(t), relay.Lease{Bucket: 0, Term: 1})
	require.NoError(t, err)
	require.Equal(t, want, got, "the producer remembers its last commit")
	next := newTransactional(t, c, small)
	got, err = next.Reconcile(testCtx(t), relay.Lease{Bucket: 0, Term: 2})
	require.NoError(t, err)
	require.Equal(t, want, got, "the next owner reads the span")
	require.Equal(t, ids(msgs), ids(readCommitted(t, c, topic)))
}

// A batch whose row ids are not ascending and do not fit MarkerMaxBytes
// is published up to the last id that fits; Publish returns that prefix
// with a Truncated error, and nothing after it is visible.
func TestTransactionalMarkerTruncates(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	tx := newTransactional(t, c, func(cfg *publisher.TransactionalConfig) { cfg.MarkerMaxBytes = 64 })
	// 64 base64 characters hold 48 bytes: the version byte and digest,
	// then ids a million apart, descending, at three bytes each.
	msgs := inBucket(withIDs(publishertest.Messages(topic, "cut", 40), 40_000_000, -1_000_000), 0)
	acked, err := tx.Publish(testCtx(t), msgs)
	require.True(t, relay.IsTruncated(err), "%v", err)
	require.Greater(t, acked, 0)
	require.Less(t, acked, len(msgs))
	got, err := tx.Reconcile(testCtx(t), relay.Lease{Bucket: 0, Term: 1})
	require.NoError(t, err)
	require.Len(t, got.IDs, acked)
	require.Equal(t, msgs[acked-1].ID, got.IDs[len(got.IDs)-1])
	require.Equal(t, relay.MessagesDigest(msgs[:acked]), got.Digest, "the digest covers the prefix published")
	require.Equal(t, ids(msgs[:acked]), ids(readCommitted(t, c, topic)))

	_, err = publisher.NewTransactional(publisher.TransactionalConfig{Brokers: c.Brokers(), TransactionalIDPrefix: "p", MarkerMaxBytes: 10})
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "TransactionalConfig.MarkerMaxBytes", ce.Field)
}

func ptr[T any](v T) *T { return &v }

// A batch of positioned messages (WAL mode) records its last message's
// position and digest; when the batch is truncated, those of the last
// message published. The next owner reads them back from the marker; a
// batch without positions (table mode) records none.
func TestTransactionalMarkerRecordsPosition(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	prefix := txnPrefix(t)
	sameID := func(cfg *publisher.TransactionalConfig) { cfg.TransactionalIDPrefix = prefix; cfg.MarkerMaxBytes = 64 }
	a := newTransactional(t, c, sameID)
	msgs := inBucket(withIDs(publishertest.Messages(topic, "wal", 40), -1_000_000_000, -1_000_000), 1)
	for i := range msgs {
		msgs[i].Position = uint64(5_000_000_000 + i/3*1000) // three messages per transaction
	}
	acked, err := a.Publish(testCtx(t), msgs)
	require.True(t, relay.IsTruncated(err), "%v", err)
	require.Positive(t, acked)
	last := msgs[acked-1]
	want := relay.Committed{Digest: relay.MessagesDigest(msgs[:acked]),
		Position: last.Position, LastDigest: relay.MessagesDigest([]relay.Message{last})}
	want.IDs = make([]int64, acked)
	for i := range want.IDs {
		want.IDs[i] = msgs[i].ID
	}
	b := newTransactional(t, c, sameID)
	require.NoError(t, b.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 1, Term: 2}}))
	got, err := b.Reconcile(testCtx(t), relay.Lease{Bucket: 1, Term: 2})
	require.NoError(t, err)
	require.Equal(t, want, got)

	plain := inBucket(withIDs(publishertest.Messages(topic, "table", 2), 10, 1), 1)
	acked, err = b.Publish(testCtx(t), plain)
	require.NoError(t, err)
	require.Equal(t, 2, acked)
	third := newTransactional(t, c, sameID)
	got, err = third.Reconcile(testCtx(t), relay.Lease{Bucket: 1, Term: 3})
	require.NoError(t, err)
	require.Equal(t, relay.Committed{IDs: []int64{10, 11}, Digest: relay.MessagesDigest(plain)}, got)
}
