package pgwal

import (
	"context"
	"errors"
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
