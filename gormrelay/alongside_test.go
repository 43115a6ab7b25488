package gormrelay_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// gatedStore holds every delete (MarkPublished, MarkPublishedNext) until
// gate is closed, counting the calls that started.
type gatedStore struct {
	*gormrelay.Store
	gate     chan struct{}
	deleting atomic.Int64
}

func (g *gatedStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	g.deleting.Add(1)
	<-g.gate
	return g.Store.MarkPublished(ctx, id, l, msgs)
}

func (g *gatedStore) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	g.deleting.Add(1)
	<-g.gate
	return g.Store.MarkPublishedNext(ctx, id, l, msgs, limit)
}

// strictLikePub is a publisher that is told of its leases, as the strict
// mode's is.
type strictLikePub struct{ relay.Publisher }

func (strictLikePub) LeasesAcquired(context.Context, []relay.Lease) error { return nil }
func (strictLikePub) LeasesReleased(context.Context, []relay.Lease)       {}

// takenHints is relay.Hints that reports each bucket the relay took, and
// outbox.UnknownBucket for an unknown one.
type takenHints struct {
	*outbox.Notifier
	taken chan int
}

func (h takenHints) Take(dst []int) ([]int, bool) {
	out, unknown := h.Notifier.Take(dst)
	for _, b := range out[len(dst):] {
		h.taken <- b
	}
	if unknown {
		h.taken <- outbox.UnknownBucket
	}
	return out, unknown
}

// hinted hints bucket b and returns once the relay marked it: once it
// took a later hint, for an unknown bucket, the relay had applied b's (one
// loop takes and applies hints in turn). The unknown bucket's discovery
// finds nothing to queue: b is the only bucket with rows.
func (h takenHints) hinted(b int) error {
	for _, want := range []int{b, outbox.UnknownBucket} {
		if want == outbox.UnknownBucket {
			h.NotifyUnknown()
		} else {
			h.Notify([]int{want})
		}
	wait:
		for {
			select {
			case got := <-h.taken:
				if got == want {
					break wait
				}
			case <-time.After(deliverWithin):
				return fmt.Errorf("the relay did not take the hint of bucket %d", want)
			}
		}
	}
	return nil
}

// alongsideRun starts a relay on a store whose deletes wait for a gate,
// with one row in bucket 2 and a poll an hour away. The publish of that
// row commits a second row to the bucket and hints it before it returns.
// It reports when the second row's publish began, on a channel, and the
// gate to open.
func alongsideRun(t *testing.T, db *dbtest.DB, leaseAware bool) (b *storeBundle, rec *recorder, second <-chan struct{}, gs *gatedStore) {
	b = newStoreBundle(t, db, outbox.Config{})
	key := keyInBucket(t, 2, 8)
	b.insert(t, outbox.MessageRow{MessageID: "first", Key: []byte(key), Value: []byte("k/0")})
	gs = &gatedStore{Store: b.store, gate: make(chan struct{})}
	hints := takenHints{Notifier: outbox.NewNotifier(8), taken: make(chan int, 64)}
	secondC := make(chan struct{})
	rec = newRecorder()
	var pub relay.Publisher = rec.publisher("a", func(_ context.Context, msgs []relay.Message) (int, error) {
		switch msgs[0].MessageID {
		case "first":
			b.insert(t, outbox.MessageRow{MessageID: "second", Key: []byte(key), Value: []byte("k/1")})
			if err := hints.hinted(2); err != nil {
				return 0, err
			}
		case "second":
			close(secondC)
		}
		return len(msgs), nil
	})
	if leaseAware {
		pub = strictLikePub{pub}
	}
	cfg := fastConfig(t, "a")
	cfg.PollInterval = time.Hour // only the hint finds the second row
	cfg.LeaseDuration = 10 * time.Second
	cfg.LeaseRenewInterval = time.Second
	cfg.Hints = hints
	startRelay(t, gs, pub, cfg)
	t.Cleanup(func() { // before the relay stops
		select {
		case <-gs.gate:
		default:
			close(gs.gate)
		}
	})
	return b, rec, secondC, gs
}

// A row committed and hinted while its bucket's batch is being published
// is published while that batch's delete is still running: the delete is
// off the path to the next publish (BatchSkipper). Once the delete
// completes, both rows are gone and each was published once, in order.
func TestRelayDeletesAlongsideNextPublish(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b, rec, second, gs := alongsideRun(t, db, false)
		select {
		case <-second:
		case <-time.After(deliverWithin):
			t.Fatalf("the second row was not published while the first one's delete waited (deletes started: %d)", gs.deleting.Load())
		}
		require.EqualValues(t, 2, b.count(t), "rows left while the first delete waits")
		require.Eventually(t, func() bool { return gs.deleting.Load() == 1 }, deliverWithin, 5*time.Millisecond)
		close(gs.gate)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Zero(c, b.count(c), "rows left in the outbox table")
		}, deliverWithin, 5*time.Millisecond)
		got := rec.acked()
		require.Len(t, got, 2)
		assert.Equal(t, "first", got[0].MessageID)
		assert.Equal(t, "second", got[1].MessageID)
		rec.requireNoOverlap(t)
	})
}

// A LeaseAware publisher (the strict mode's) keeps each batch's delete
// before the bucket's next publish.
func TestRelayLeaseAwareDeletesBeforeNextPublish(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b, rec, second, gs := alongsideRun(t, db, true)
		require.Eventually(t, func() bool { return gs.deleting.Load() == 1 }, deliverWithin, 5*time.Millisecond)
		require.Never(t, func() bool {
			select {
			case <-second:
				return true
			default:
				return false
			}
		}, 300*time.Millisecond, 10*time.Millisecond, "the second row published before the first one's delete ended")
		close(gs.gate)
		select {
		case <-second:
		case <-time.After(deliverWithin):
			t.Fatal("the second row was not published after the delete")
		}
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Zero(c, b.count(c), "rows left in the outbox table")
		}, deliverWithin, 5*time.Millisecond)
		require.Len(t, rec.acked(), 2)
	})
}
