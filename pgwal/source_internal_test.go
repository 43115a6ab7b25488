package pgwal

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// termStream is a stream of term 7 over 2 buckets whose queues hold the
// messages of three transactions (commits at 100, 200, 300), nothing read
// from a server: what the source does with its queues needs none.
func termStream(t *testing.T) *stream {
	t.Helper()
	r := &Reader{ocfg: outbox.Config{BucketCount: 2}, cfg: Config{LeaseDuration: time.Hour}, log: dbtest.Logger(t)}
	s := newStream(r, nil, 7, 50, time.Now())
	for i, commit := range []pglogrepl.LSN{100, 200, 300} {
		s.enqueue([]entry{{commit: commit, msg: relay.Message{ID: -int64(commit) - 1, Bucket: 0, Key: []byte("k"), Value: []byte{byte(i)}}}})
	}
	s.done = 400
	return s
}

// TestSourceTermGuard: a lease of a term other than the stream's, or of a
// stream that ended, marks nothing published, records and filters
// nothing, and leaves the position to confirm where it was; the stream's
// own lease takes the acknowledged prefix out and moves the position.
func TestSourceTermGuard(t *testing.T) {
	ctx := context.Background()
	s := termStream(t)
	src := source{s}
	require.Equal(t, pglogrepl.LSN(100), s.position(), "before the first message")
	head, err := src.NextBatch(ctx, 0, 2)
	require.NoError(t, err)
	require.Len(t, head, 2)

	stale := relay.Lease{Bucket: 0, Term: 6}
	require.ErrorIs(t, src.MarkPublished(ctx, "r", stale, head), relay.ErrLeaseLost)
	require.ErrorIs(t, src.RecordFailure(ctx, "r", stale, head[0], errors.New("x")), relay.ErrLeaseLost)
	_, err = policy{src}.FilterBatch(ctx, "r", stale, head)
	require.ErrorIs(t, err, relay.ErrLeaseLost)
	_, err = policy{src}.HandleFailure(ctx, relay.Failure{Lease: stale, Message: head[0], Err: relay.Permanent(errors.New("x"))})
	require.ErrorIs(t, err, relay.ErrLeaseLost)
	acq, err := src.AcquireLeases(ctx, relay.AcquireRequest{BucketCount: 2})
	require.NoError(t, err)
	require.Equal(t, []relay.Lease{{Bucket: 0, Term: 7}, {Bucket: 1, Term: 7}}, acq.Leases, "every bucket under the stream's term")
	require.Len(t, s.buckets[0].q, 3, "a stale term takes nothing out")
	require.Zero(t, s.buckets[0].q[0].attempts, "nor records a failure")
	require.Equal(t, pglogrepl.LSN(100), s.position(), "nor moves the position")

	cur := relay.Lease{Bucket: 0, Term: 7}
	require.NoError(t, src.MarkPublished(ctx, "r", cur, head[:1]))
	require.Equal(t, pglogrepl.LSN(200), s.position(), "past the published message only")
	require.Equal(t, uint64(1), s.r.published.Load())

	s.end()
	require.ErrorIs(t, src.MarkPublished(ctx, "r", cur, head[1:]), relay.ErrLeaseLost, "an ended stream holds no lease")
	require.Equal(t, pglogrepl.LSN(200), s.position())
	acq, err = src.AcquireLeases(ctx, relay.AcquireRequest{BucketCount: 2})
	require.NoError(t, err)
	require.Empty(t, acq.Leases, "a reader that stopped reading drains nothing")
	renewed, err := src.RenewLeases(ctx, "r", []relay.Lease{cur}, time.Second)
	require.NoError(t, err)
	require.Empty(t, renewed)
}

// TestSourceLeaseLapses: the buckets' leases end with the slot's lease
// when no renewal extended it, though the stream still reads.
func TestSourceLeaseLapses(t *testing.T) {
	s := termStream(t)
	s.heldUntil = time.Now().Add(-time.Millisecond)
	err := source{s}.MarkPublished(context.Background(), "r", relay.Lease{Bucket: 0, Term: 7}, []relay.Message{{ID: -101}})
	require.ErrorIs(t, err, relay.ErrLeaseLost)
	require.Len(t, s.buckets[0].q, 3)
	s.extend(time.Now())
	require.NoError(t, source{s}.MarkPublished(context.Background(), "r", relay.Lease{Bucket: 0, Term: 7}, []relay.Message{{ID: -101}}))
	require.Len(t, s.buckets[0].q, 2)
}

// TestPublisherFencedIsAnOutage: a fenced publish reaches the engine as
// an outage (backoff, the bucket kept), not as a lost bucket lease.
func TestPublisherFencedIsAnOutage(t *testing.T) {
	p := publisherOnly{relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
		return 0, relay.Fenced(errors.New("producer fenced"))
	})}
	_, err := p.Publish(context.Background(), []relay.Message{{ID: -1}})
	require.True(t, relay.IsUnavailable(err), "%v", err)
	require.False(t, relay.IsFenced(err))
	require.NotErrorIs(t, err, relay.ErrLeaseLost)
	require.Contains(t, err.Error(), "producer fenced")
}

// TestSourceEnqueueTransaction: a transaction's messages reach their
// buckets in commit order, runs of one bucket or not, every bucket they
// fill is hinted once they are queued, and a batch carries the failed
// attempts recorded on its entries.
func TestSourceEnqueueTransaction(t *testing.T) {
	ctx := context.Background()
	r := &Reader{ocfg: outbox.Config{BucketCount: 3}, cfg: Config{LeaseDuration: time.Hour, MaxPending: 100}}
	s := newStream(r, nil, 7, 1, time.Now())
	src := source{s}
	var es []entry
	for i, b := range []int{0, 0, 2, 0, 2, 2, 0} {
		es = append(es, entry{commit: 10, msg: relay.Message{ID: -int64(i + 1), Bucket: b, Value: []byte{byte(i)}}})
	}
	s.enqueue(es)
	require.Equal(t, 7, s.pending)
	select {
	case <-s.hints.Ready():
	default:
		t.Fatal("no wake-up")
	}
	hinted, unknown := s.hints.Take(nil)
	require.False(t, unknown)
	require.Equal(t, []int{0, 2}, hinted)

	require.NoError(t, src.RecordFailure(ctx, "r", relay.Lease{Bucket: 2, Term: 7}, relay.Message{ID: -5}, errors.New("x")))
	ids := func(msgs []relay.Message) (out []int64) {
		for _, m := range msgs {
			out = append(out, m.ID)
		}
		return out
	}
	b0, err := src.NextBatch(ctx, 0, 10)
	require.NoError(t, err)
	require.Equal(t, []int64{-1, -2, -4, -7}, ids(b0))
	b1, err := src.NextBatch(ctx, 1, 10)
	require.NoError(t, err)
	require.NotNil(t, b1)
	require.Empty(t, b1)
	b2, err := src.NextBatch(ctx, 2, 2)
	require.NoError(t, err)
	require.Equal(t, []int64{-3, -5}, ids(b2))
	require.Equal(t, []int{0, 1}, []int{b2[0].Attempts, b2[1].Attempts})

	require.NoError(t, src.MarkPublished(ctx, "r", relay.Lease{Bucket: 2, Term: 7}, b2))
	require.Equal(t, 5, s.pending)
	require.Len(t, s.buckets[2].q, 1)
	require.Equal(t, uint64(2), r.published.Load())
}

// BenchmarkSourceCycle is the queue work of one message in a drain
// beside its decoding: a transaction of 512 messages over 8 buckets is
// queued, then every bucket's batch is read and marked published, as
// the engine does; one op is one message.
func BenchmarkSourceCycle(b *testing.B) {
	ctx := context.Background()
	const buckets, txn = 8, 512
	r := &Reader{ocfg: outbox.Config{BucketCount: buckets}, cfg: Config{LeaseDuration: time.Hour, MaxPending: 1 << 20}}
	s := newStream(r, nil, 7, 1, time.Now())
	src := source{s}
	es := make([]entry, txn)
	for i := range es {
		es[i] = entry{msg: relay.Message{Bucket: i % buckets, Key: []byte("k"), Value: make([]byte, 200)}}
	}
	b.ReportAllocs()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b.ResetTimer()
	for n, lsn := 0, int64(1); n < b.N; n += txn {
		for i := range es {
			es[i].msg.ID, es[i].commit = -lsn, pglogrepl.LSN(lsn)
			lsn++
		}
		s.enqueue(es)
		for bucket := range buckets {
			msgs, err := src.NextBatch(ctx, bucket, txn)
			if err != nil || len(msgs) != txn/buckets {
				b.Fatalf("bucket %d: %d messages, %v", bucket, len(msgs), err)
			}
			if err := src.MarkPublished(ctx, "r", relay.Lease{Bucket: bucket, Term: 7}, msgs); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	runtime.ReadMemStats(&after)
	// Allocations are per batch, fewer than one per message: per
	// transaction of txn messages.
	b.ReportMetric(float64(after.Mallocs-before.Mallocs)/float64(b.N)*txn, "allocs/txn")
}
