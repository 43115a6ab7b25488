package pgwal_test

// The reader publishes through the relay engine (pgwal/source.go): these
// tests check what the engine brings to WAL mode.

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// TestEngineHintsPublishWithoutPoll: a message is published as soon as
// the stream decoded it. The engine's poll (PollInterval, the reader's
// StandbyInterval) is an hour here, so only the stream's hints can wake
// it within the test.
func TestEngineHintsPublishWithoutPoll(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a", func(c *pgwal.Config) {
		c.LeaseDuration, c.StandbyInterval, c.ConfirmInterval = 4*time.Hour, time.Hour, 100*time.Millisecond
	})
	stop := runInTest(t, r)
	require.Eventually(t, func() bool { return r.Stats().Confirmed > 0 }, 30*time.Second, 10*time.Millisecond, "the reader reads")
	for round := range 3 {
		// Each round waits for the previous one: the engine is idle, and
		// found its buckets empty, when the next message commits.
		e.write(t, 1, round, round+1)
		require.Eventually(t, func() bool { return r.Stats().Published == uint64(round+1) }, 30*time.Second, 5*time.Millisecond,
			"message %d published without waiting for the poll", round)
	}
	e.checkDelivered(t, 1, 3)
	require.NoError(t, stop())
}

// TestEngineBucketsInParallel: batches of different buckets are in flight
// at once (the publisher lets none finish before two buckets publish
// together), and every key keeps its order.
func TestEngineBucketsInParallel(t *testing.T) {
	e := setup(t)
	bc := e.plugin.Config().BucketCount
	const keys, n = 8, 30
	buckets := map[int]bool{}
	for k := range keys {
		buckets[outbox.Bucket([]byte("k"+strconv.Itoa(k)), nil, "", bc)] = true
	}
	require.GreaterOrEqual(t, len(buckets), 2, "the keys fall into several buckets")

	var (
		mu       sync.Mutex
		inFlight = map[int]int{}
		together = make(chan struct{})
		once     sync.Once
		maxSeen  atomic.Int32
	)
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		b := msgs[0].Bucket
		mu.Lock()
		inFlight[b]++
		if inFlight[b] > 1 {
			mu.Unlock()
			return 0, errors.New("two batches of one bucket in flight")
		}
		if len(inFlight) >= 2 {
			maxSeen.Store(max(maxSeen.Load(), int32(len(inFlight))))
			once.Do(func() { close(together) })
		}
		mu.Unlock()
		defer func() {
			mu.Lock()
			if inFlight[b]--; inFlight[b] == 0 {
				delete(inFlight, b)
			}
			mu.Unlock()
		}()
		select {
		case <-together:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
		return e.pub.Publish(ctx, msgs)
	})
	r := e.reader(t, pub, "a")
	stop := runInTest(t, r)
	e.write(t, keys, 0, n)
	e.checkDelivered(t, keys, n)
	require.GreaterOrEqual(t, maxSeen.Load(), int32(2), "buckets published in parallel")
	require.NoError(t, stop())
}

// runInTest runs r like run, and stops it when the test ends if the test
// did not: a failed test does not leave the reader holding its slot.
func runInTest(t *testing.T, r *pgwal.Reader) (stop func() error) {
	var (
		once sync.Once
		err  error
	)
	s := run(r)
	stop = func() error {
		once.Do(func() { err = s() })
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// recorder is a relay.Observer that counts what WAL mode reports.
type recorder struct {
	relay.NopObserver
	mu                     sync.Mutex
	acked, parked          int
	deadFailed, publishErr int
	owned                  int
}

func (o *recorder) Published(e relay.PublishEvent) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.acked += e.Acked
	if e.Failed() {
		o.publishErr++
	}
}

func (o *recorder) MessagesDeadLettered(n int, parked bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if parked {
		o.parked += n
	} else {
		o.deadFailed += n
	}
}

func (o *recorder) OwnedBuckets(n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.owned = max(o.owned, n)
}

func (o *recorder) snapshot() recorder {
	o.mu.Lock()
	defer o.mu.Unlock()
	return recorder{acked: o.acked, parked: o.parked, deadFailed: o.deadFailed, publishErr: o.publishErr, owned: o.owned}
}
