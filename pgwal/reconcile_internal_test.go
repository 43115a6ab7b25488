package pgwal

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// replayStream is a term's stream over 2 buckets whose bucket 0 replays
// the transactions committed at 100 (messages at 90 and 95), 200 (190),
// 300 (290, 295) and 400 (390), those after from; bucket 1 holds one
// message of the transaction at 200. The stream has read up to done.
func replayStream(t *testing.T, from, done pglogrepl.LSN) *stream {
	t.Helper()
	r := &Reader{ocfg: outbox.Config{BucketCount: 2}, cfg: Config{LeaseDuration: time.Hour, MaxPending: 100}, log: dbtest.Logger(t)}
	s := newStream(r, nil, 7, from, time.Now())
	for _, txn := range []struct {
		commit pglogrepl.LSN
		msgs   []int64
	}{{100, []int64{90, 95}}, {200, []int64{190}}, {300, []int64{290, 295}}, {400, []int64{390}}} {
		if txn.commit < from {
			continue
		}
		var es []entry
		for _, lsn := range txn.msgs {
			es = append(es, entry{commit: txn.commit, msg: walMsg(0, lsn, txn.commit)})
		}
		if txn.commit == 200 {
			es = append(es, entry{commit: 200, msg: walMsg(1, 191, 200)})
		}
		s.enqueue(es)
	}
	s.done = done
	return s
}

// walMsg is the message a stream decodes at lsn in bucket, of a
// transaction committed at commit.
func walMsg(bucket int, lsn int64, commit pglogrepl.LSN) relay.Message {
	return relay.Message{ID: -lsn, MessageID: fmt.Sprintf("m-%d", lsn), Bucket: bucket, Key: []byte("k"), Position: uint64(commit)}
}

// record is Kafka's record of a batch of bucket 0 made of the messages at
// lsns, the last of a transaction committed at commit.
func record(commit pglogrepl.LSN, lsns ...int64) relay.Committed {
	msgs := make([]relay.Message, len(lsns))
	ids := make([]int64, len(lsns))
	for i, lsn := range lsns {
		msgs[i], ids[i] = walMsg(0, lsn, 0), -lsn
	}
	return relay.Committed{IDs: ids, Digest: relay.MessagesDigest(msgs), Position: uint64(commit), LastDigest: relay.MessagesDigest(msgs[len(msgs)-1:])}
}

func queueIDs(q *bucketQ) (ids []int64) {
	for _, e := range q.q {
		ids = append(ids, e.msg.ID)
	}
	return ids
}

// TestReplayHeldUntilDecided: a bucket with a record is published from
// nowhere until the replay passes the record's position; then the
// replayed messages up to the record's last message leave the queue (the
// batch's and the earlier ones), the position to confirm moves past
// them, and the bucket is hinted. Another bucket is not held.
func TestReplayHeldUntilDecided(t *testing.T) {
	ctx := context.Background()
	s := replayStream(t, 50, 250)
	src := source{s}
	_, _ = s.hints.Take(nil)
	s.holdReplays([]relay.Committed{record(300, 190, 290)}, 50, 1000)
	require.True(t, s.buckets[0].isHeld(), "the transaction at 300 is not read yet")
	msgs, err := src.NextBatch(ctx, 0, 10)
	require.NoError(t, err)
	require.Empty(t, msgs, "nothing of a held bucket is published")
	pending, err := src.PendingBuckets(ctx, []int{0, 1})
	require.NoError(t, err)
	require.Equal(t, []int{1}, pending)
	msgs, err = src.NextBatch(ctx, 1, 10)
	require.NoError(t, err)
	require.Len(t, msgs, 1, "a bucket without a record is published at once")

	s.done = 500
	s.settle()
	require.False(t, s.buckets[0].isHeld())
	require.Equal(t, []int64{-295, -390}, queueIDs(s.buckets[0]), "everything up to the record's last message is in Kafka")
	require.Equal(t, uint64(4), s.r.reconciled.Load())
	require.Equal(t, 3, s.pending, "dropped messages leave the queues as published ones")
	hinted, _ := s.hints.Take(nil)
	require.Contains(t, hinted, 0)
	require.Equal(t, pglogrepl.LSN(200), s.position(), "bucket 1's message at 200 is the oldest left")
}

// TestReplayDecisions: which replayed messages a record drops.
func TestReplayDecisions(t *testing.T) {
	foreign := record(300, 190, 290)
	foreign.Digest++ // the same ids, other messages
	wrongLast := record(300, 95, 190, 290)
	wrongLast.LastDigest++
	noPosition := record(300, 190, 290)
	noPosition.Position = 0
	for _, tc := range []struct {
		name string
		from pglogrepl.LSN
		rec  relay.Committed
		left []int64
	}{
		{"whole batch", 50, record(300, 190, 290), []int64{-295, -390}},
		{"batch at the head", 150, record(200, 190), []int64{-290, -295, -390}},
		{"replay starts inside the batch", 150, record(300, 90, 95, 190, 290), []int64{-295, -390}},
		{"inside the batch, last digest wrong", 150, wrongLast, []int64{-190, -290, -295, -390}},
		{"foreign digest", 50, foreign, []int64{-90, -95, -190, -290, -295, -390}},
		{"ids differ", 50, record(300, 95, 290), []int64{-90, -95, -190, -290, -295, -390}},
		{"last message not replayed", 50, record(300, 190, 291), []int64{-90, -95, -190, -290, -295, -390}},
		{"before the restart point", 150, record(100, 90, 95), []int64{-190, -290, -295, -390}},
		{"beyond the WAL", 50, record(2000, 190, 290), []int64{-90, -95, -190, -290, -295, -390}},
		{"no position", 50, noPosition, []int64{-90, -95, -190, -290, -295, -390}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := replayStream(t, tc.from, 1000)
			s.holdReplays([]relay.Committed{tc.rec}, tc.from, 1000)
			require.False(t, s.buckets[0].isHeld(), "decided")
			require.Zero(t, s.holding)
			require.Equal(t, tc.left, queueIDs(s.buckets[0]))
		})
	}
}

// TestReplayBridgedRowsDropNothing: bridged rows up to the record's last
// message cannot be verified before they are read: nothing is dropped.
func TestReplayBridgedRowsDropNothing(t *testing.T) {
	s := replayStream(t, 50, 1000)
	s.buckets[0].q[2].bridged = true
	s.holdReplays([]relay.Committed{record(300, 190, 290)}, 50, 1000)
	require.False(t, s.buckets[0].isHeld())
	require.Len(t, s.buckets[0].q, 6)
}

// TestReplayHeldOutgrowsMaxPending: when held replays fill the queues
// (MaxPending) before their records' positions, the longest is released
// undecided, in full, rather than stall the stream; the others stay held.
func TestReplayHeldOutgrowsMaxPending(t *testing.T) {
	s := replayStream(t, 50, 250)
	s.r.cfg.MaxPending = 8
	other := relay.Committed{IDs: []int64{-999}, Position: 900}
	s.holdReplays([]relay.Committed{record(300, 190, 290), other}, 50, 1000)
	require.True(t, s.buckets[0].isHeld())
	require.True(t, s.buckets[1].isHeld())
	require.Equal(t, 7, s.heldEntries())
	s.enqueue([]entry{{commit: 240, msg: walMsg(0, 239, 240)}})
	require.Equal(t, s.heldEntries(), s.r.cfg.MaxPending)
	s.giveUp()
	require.False(t, s.buckets[0].isHeld(), "the longest replay is released")
	require.Len(t, s.buckets[0].q, 7, "nothing dropped")
	require.True(t, s.buckets[1].isHeld(), "the other stays held")
	require.Equal(t, 1, s.holding)
}
