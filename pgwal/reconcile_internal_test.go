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

// replayReader is a reader of an outbox of 2 buckets.
func replayReader(t *testing.T) *Reader {
	return &Reader{ocfg: outbox.Config{BucketCount: 2}, cfg: Config{LeaseDuration: time.Hour, MaxPending: 100},
		log: dbtest.Logger(t), notOurs: map[recordKey]struct{}{}}
}

// replay feeds stream s, as its receiving goroutine does, the
// transactions committed from from on of this history: bucket 0 has
// messages at 90 and 95 (committed at 100), 190 (200), 290 and 295 (300)
// and 390 (400); bucket 1 one at 191 (200). It returns the error that
// ends the term, if any.
func replay(s *stream, from pglogrepl.LSN) error {
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
		s.done = txn.commit + 10
		if err := s.settle(); err != nil {
			return err
		}
	}
	return nil
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

// TestReplayHeldUntilDecided: the replayed messages of a bucket with a
// record are set aside, not queued, and the position to confirm stays
// before them, until the record's last message arrives; then they are
// skipped, what follows is queued, and the position moves on. Another
// bucket is not held.
func TestReplayHeldUntilDecided(t *testing.T) {
	ctx := context.Background()
	s := newStream(replayReader(t), nil, 7, 50, time.Now())
	src := source{s}
	s.holdReplays([]relay.Committed{record(300, 190, 290)}, 50, 1000)
	s.enqueue([]entry{{commit: 100, msg: walMsg(0, 90, 100)}, {commit: 100, msg: walMsg(0, 95, 100)}})
	s.done = 110
	require.NoError(t, s.settle())
	require.True(t, s.buckets[0].isHeld(), "the record's last message is not read yet")
	require.Empty(t, s.buckets[0].q, "set aside, not queued")
	require.Zero(t, s.pending, "set-aside messages take no room in MaxPending")
	require.Equal(t, pglogrepl.LSN(100), s.position(), "the slot keeps what was set aside")
	pending, err := src.PendingBuckets(ctx, []int{0, 1})
	require.NoError(t, err)
	require.Empty(t, pending)

	s.done = 50
	require.NoError(t, replay(s, 150))
	require.False(t, s.buckets[0].isHeld())
	require.Equal(t, []int64{-295, -390}, queueIDs(s.buckets[0]), "everything up to the record's last message is in Kafka")
	require.Equal(t, []int64{-191}, queueIDs(s.buckets[1]), "a bucket without a record is queued at once")
	require.Equal(t, uint64(4), s.r.reconciled.Load())
	require.Equal(t, 3, s.pending)
	require.Equal(t, pglogrepl.LSN(200), s.position(), "bucket 1's message at 200 is the oldest left")
}

// TestReplayDecisions: which replayed messages a record skips.
func TestReplayDecisions(t *testing.T) {
	foreign := record(300, 190, 290)
	foreign.Digest++ // the same ids, other messages
	wrongLast := record(300, 95, 190, 290)
	wrongLast.LastDigest++
	noPosition := record(300, 190, 290)
	noPosition.Position = 0
	all := []int64{-90, -95, -190, -290, -295, -390}
	for _, tc := range []struct {
		name    string
		from    pglogrepl.LSN
		rec     relay.Committed
		left    []int64
		skipped uint64
		notOurs bool // the term ends; the next one publishes everything
	}{
		{"whole batch", 50, record(300, 190, 290), []int64{-295, -390}, 4, false},
		{"batch at the head", 150, record(200, 190), []int64{-290, -295, -390}, 1, false},
		{"replay starts inside the batch", 150, record(300, 90, 95, 190, 290), []int64{-295, -390}, 2, false},
		{"inside the batch, last digest wrong", 150, wrongLast, nil, 0, true},
		{"foreign digest", 50, foreign, nil, 0, true},
		{"ids differ", 50, record(300, 95, 290), nil, 0, true},
		{"last message not replayed", 50, record(300, 190, 291), nil, 0, true},
		{"position passed with nothing set aside", 50, record(80, 85), all, 0, false},
		{"before the restart point", 150, record(100, 90, 95), []int64{-190, -290, -295, -390}, 0, false},
		{"beyond the WAL", 50, record(2000, 190, 290), all, 0, false},
		{"no position", 50, noPosition, all, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := replayReader(t)
			s := newStream(r, nil, 7, tc.from, time.Now())
			s.holdReplays([]relay.Committed{tc.rec}, tc.from, 1000)
			err := replay(s, tc.from)
			require.False(t, s.buckets[0].isHeld(), "decided")
			require.Zero(t, s.holding)
			require.Equal(t, tc.skipped, r.reconciled.Load())
			if !tc.notOurs {
				require.NoError(t, err)
				require.Equal(t, tc.left, queueIDs(s.buckets[0]))
				return
			}
			require.ErrorIs(t, err, errRecordNotOurs)
			require.Empty(t, s.buckets[0].q, "nothing of the bucket goes before what was set aside")
			first := pglogrepl.LSN(100) // the first message set aside
			if tc.from == 150 {
				first = 200
			}
			require.Equal(t, first, s.position(), "the slot keeps what was set aside")

			// The next term reads the set-aside messages again, and
			// publishes them: the record is remembered as not this
			// outbox's.
			s = newStream(r, nil, 8, tc.from, time.Now())
			s.holdReplays([]relay.Committed{tc.rec}, tc.from, 1000)
			require.Zero(t, s.holding)
			require.NoError(t, replay(s, tc.from))
			want := all
			if tc.from == 150 {
				want = all[2:]
			}
			require.Equal(t, want, queueIDs(s.buckets[0]))
		})
	}
}

// TestReplayBridgedRowsSkipNothing: a bridged row replayed before the
// record's last message cannot be verified before it is read: the record
// is not trusted, and the messages set aside are read again.
func TestReplayBridgedRowsSkipNothing(t *testing.T) {
	s := newStream(replayReader(t), nil, 7, 50, time.Now())
	s.holdReplays([]relay.Committed{record(300, 190, 290)}, 50, 1000)
	s.enqueue([]entry{{commit: 100, msg: walMsg(0, 90, 100)}})
	s.enqueue([]entry{{commit: 150, bridged: true, msg: relay.Message{ID: 12, Bucket: 0}}})
	require.False(t, s.buckets[0].isHeld())
	require.ErrorIs(t, s.settle(), errRecordNotOurs)
	require.Empty(t, s.buckets[0].q)
}
