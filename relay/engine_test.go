package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// With Parallelism 2, two buckets are published at the same time; with 1,
// never.
func TestParallelDrain(t *testing.T) {
	t.Parallel()
	for _, par := range []int{1, 2} {
		t.Run(strconv.Itoa(par), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newFakeStore(8)
				for b := range 4 {
					s.add(b, 30)
				}
				var inFlight, peak atomic.Int32
				cfg := config("a")
				cfg.Parallelism = par
				r, err := relay.New(s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
					n := inFlight.Add(1)
					for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
					}
					time.Sleep(10 * time.Millisecond) // the sink's round trip, on the bubble's clock
					inFlight.Add(-1)
					return len(msgs), nil
				}), cfg)
				require.NoError(t, err)
				n, err := r.DrainOnce(t.Context())
				require.NoError(t, err)
				require.Equal(t, 120, n)
				require.Zero(t, s.pending())
				require.EqualValues(t, par, peak.Load())
			})
		})
	}
}

// hintedSetup returns a store of 8 buckets and a relay config "a" woken
// by hints only, whose publishes never time out.
func hintedSetup() (*fakeStore, *fakeHints, relay.Config) {
	hints := newFakeHints()
	cfg := config("a")
	cfg.Hints = hints
	cfg.PollInterval = time.Hour
	cfg.PublishTimeout = time.Hour
	return newFakeStore(8), hints, cfg
}

// A hint for one bucket is published while another bucket's publish is
// stuck: buckets no longer wait behind each other's batches. Nor does the
// lease maintenance: acquisitions go on during the hung publish, telling
// the store that bucket 0 is busy, and a bucket hinted after several of
// them is still published.
func TestHintNotBehindSlowBucket(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, cfg := hintedSetup()
		release := make(chan struct{})
		published := make(chan int, 10)
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if msgs[0].Bucket == 0 {
				<-release
			}
			published <- msgs[0].Bucket
			return len(msgs), nil
		}), cfg)
		synctest.Wait()
		s.add(0, 1)
		hints.notify(0)
		synctest.Wait() // bucket 0's publish is blocked
		s.add(1, 1)
		hints.notify(1)
		require.Equal(t, 1, <-published, "bucket 1 published while bucket 0 is in flight")

		before := s.count("acquire")
		time.Sleep(5 * cfg.LeaseRenewInterval) // the bubble's clock: five renewal periods pass
		synctest.Wait()
		require.GreaterOrEqual(t, s.count("acquire")-before, 4, "acquisitions go on during the hung publish")
		s.mu.Lock()
		require.Equal(t, 1, s.acquireBusy[len(s.acquireBusy)-1], "the store is told that bucket 0 is in flight")
		s.mu.Unlock()
		require.Equal(t, "a", s.owner(0), "bucket 0's lease is kept")
		s.add(1, 1)
		hints.notify(1)
		select {
		case b := <-published:
			require.Equal(t, 1, b)
		case <-time.After(time.Minute):
			t.Fatal("bucket 1 was not published after the acquisitions while bucket 0's publish hung")
		}
		close(release)
		require.Equal(t, 0, <-published)
		stop(t, r)
	})
}

// awarePub is a LeaseAware publisher whose publishes of bucket 0 wait for
// release. It records a problem whenever it is told of a bucket whose
// Publish is in flight, and what it was told.
type awarePub struct {
	release  chan struct{}
	fence    atomic.Int32 // publishes of bucket 1 still to fail as fenced
	mu       sync.Mutex
	inFlight map[int]bool
	problems []string
	released []int
	acquired []int
}

func (p *awarePub) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	b := msgs[0].Bucket
	p.mu.Lock()
	p.inFlight[b] = true
	p.mu.Unlock()
	if b == 0 {
		<-p.release
	}
	p.mu.Lock()
	delete(p.inFlight, b)
	p.mu.Unlock()
	if b == 1 && p.fence.Add(-1) >= 0 {
		return 0, relay.Fenced(errors.New("another producer took the bucket's identity"))
	}
	return len(msgs), nil
}

func (p *awarePub) told(what string, ls []relay.Lease, into *[]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range ls {
		if p.inFlight[l.Bucket] {
			p.problems = append(p.problems, fmt.Sprintf("%s bucket %d during its publish", what, l.Bucket))
		}
		*into = append(*into, l.Bucket)
	}
}

func (p *awarePub) LeasesAcquired(_ context.Context, ls []relay.Lease) error {
	p.told("acquired", ls, &p.acquired)
	return nil
}

func (p *awarePub) LeasesReleased(_ context.Context, ls []relay.Lease) {
	p.told("released", ls, &p.released)
}

// startHung starts relay "a" alone on 8 buckets with an awarePub, and
// returns once it holds them all and bucket 0's publish hangs.
func startHung(t *testing.T) (*fakeStore, *fakeHints, relay.Config, *awarePub, *relay.Relay) {
	s, hints, cfg := hintedSetup()
	pub := &awarePub{release: make(chan struct{}), inFlight: map[int]bool{}}
	a := start(t, s, pub, cfg)
	synctest.Wait()
	require.Len(t, a.Leases(), 8)
	s.add(0, 1)
	hints.notify(0)
	synctest.Wait() // bucket 0's publish is blocked
	return s, hints, cfg, pub, a
}

// While bucket 0's publish hangs, a second relay joins: the first one
// gives up its surplus buckets at once but keeps bucket 0, and its
// LeaseAware publisher is never told of a bucket during that bucket's
// publish.
func TestSurplusReleasedBesideSlowBucket(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, _, cfg, pub, a := startHung(t)

		b := start(t, s, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil }), config("b"))
		time.Sleep(3 * cfg.LeaseRenewInterval) // the bubble's clock
		synctest.Wait()
		var held []int
		for _, l := range a.Leases() {
			held = append(held, l.Bucket)
		}
		require.Len(t, held, 4, "a keeps its fair share")
		require.Contains(t, held, 0, "a keeps the bucket in flight")
		require.Len(t, b.Leases(), 4, "b took the others while a's publish hangs")
		pub.mu.Lock()
		require.Len(t, pub.released, 4)
		require.NotContains(t, pub.released, 0)
		pub.mu.Unlock()

		close(pub.release)
		synctest.Wait()
		stop(t, b)
		stop(t, a)
		pub.mu.Lock()
		defer pub.mu.Unlock()
		require.Empty(t, pub.problems)
		require.ElementsMatch(t, pub.acquired, pub.released, "every announced lease is announced released at the end")
	})
}

// A lease taken away during its bucket's hung publish is announced
// released only once that publish ended, and then at once, not at the next
// acquisition.
func TestLostLeaseAnnouncedAfterItsBatch(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, _, cfg, pub, a := startHung(t)

		s.mu.Lock()
		s.leases[0].owner, s.leases[0].term = "other", s.leases[0].term+1 // taken over
		s.mu.Unlock()
		time.Sleep(2 * cfg.LeaseRenewInterval) // the bubble's clock: acquisitions see it
		synctest.Wait()
		for _, l := range a.Leases() {
			require.NotEqual(t, 0, l.Bucket, "the relay no longer holds bucket 0")
		}
		pub.mu.Lock()
		require.NotContains(t, pub.released, 0, "not announced during its publish")
		pub.mu.Unlock()

		close(pub.release)
		synctest.Wait() // no time passes: no acquisition is due
		pub.mu.Lock()
		require.Contains(t, pub.released, 0, "announced as soon as its publish ended")
		require.Empty(t, pub.problems)
		pub.mu.Unlock()
		stop(t, a)
	})
}

// A fenced publish drops the bucket although the store still holds it
// for the relay: the next acquisition finds it again under the same term,
// and the bucket is drained, whatever the order in which its release and
// acquisition reached the publisher.
func TestFencedBucketHeldAgainIsDrained(t *testing.T) {
	t.Parallel()
	for round := range 20 {
		t.Run(strconv.Itoa(round), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s, hints, cfg, pub, a := startHung(t)
				pub.fence.Store(1)
				s.add(1, 3)
				hints.notify(1)
				require.EventuallyWithT(t, func(c *assert.CollectT) {
					s.mu.Lock()
					defer s.mu.Unlock()
					assert.Empty(c, s.msgs[1])
				}, 10*cfg.LeaseRenewInterval, cfg.LeaseRenewInterval/10, "bucket 1 drained after the fence")
				pub.mu.Lock()
				require.Empty(t, pub.problems)
				pub.mu.Unlock()
				close(pub.release)
				stop(t, a)
			})
		})
	}
}

// After a full batch the relay deletes it and reads the next one in one
// store call (BatchAdvancer): one NextBatch for a backlog of five batches.
func TestAdvancerUsed(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 50)
		log := drainOnce(t, advancingStore{s}, 50)
		require.Zero(t, s.pending())
		require.Equal(t, 1, s.count("batch"))
		require.Equal(t, 5, s.count("advance"), "each full batch deleted with the next read")
		require.Zero(t, s.count("mark"), "the last read came back empty: nothing left to delete separately")
		require.Equal(t, seqValues(2, 0, 50), log.values())
	})
}

// drainOnce drains s's n messages with DrainOnce and returns what was
// published.
func drainOnce(t *testing.T, s relay.Store, n int) *pubLog {
	t.Helper()
	log := &pubLog{}
	r, err := relay.New(s, log.publisher(nil), config("a"))
	require.NoError(t, err)
	got, err := r.DrainOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, n, got)
	return log
}

// Full batches keep their delete and the next read back to back
// (BatchAdvancer) with a BatchSkipper too: the drain is unchanged.
func TestSkipperNotForFullBatches(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 50)
		log := drainOnce(t, skippingStore{advancingStore{s}}, 50)
		require.Zero(t, s.pending())
		require.Equal(t, 1, s.count("batch"))
		require.Equal(t, 5, s.count("advance"), "each full batch deleted with the next read")
		require.Zero(t, s.count("except"))
		require.Equal(t, seqValues(2, 0, 50), log.values())
	})
}

// hintDuring starts a relay on a skipping store with injected failures
// fail (nil: none), commits 3/0, and while its publish waits commits n
// more rows to bucket 3 and hints them; then it lets the publish return
// and waits until the relay is idle.
func hintDuring(t *testing.T, n int, fail func(op string) error) (*fakeStore, *pubLog, relay.Config, *relay.Relay) {
	base, hints, cfg := hintedSetup()
	base.fail = fail
	release := make(chan struct{})
	log := &pubLog{}
	r := start(t, skippingStore{advancingStore{base}}, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
		if string(msgs[0].Value) == "3/0" {
			<-release
		}
		return len(msgs), nil
	}), cfg)
	synctest.Wait()
	base.add(3, 1)
	hints.notify(3)
	synctest.Wait() // 3/0 in flight
	base.add(3, n)
	hints.notify(3)
	synctest.Wait() // the hint is taken while 3/0 is in flight
	close(release)
	synctest.Wait()
	return base, log, cfg, r
}

// A bucket hinted while its batch (not full) is in flight has its next
// batch read without that batch's rows as soon as the publish returns,
// and published while the batch is deleted: one read per batch, and the
// hint, covered by that read, does not read the bucket once more.
func TestSkipperAfterHint(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, log, _, r := hintDuring(t, 1, nil)
		require.Zero(t, s.pending())
		require.Equal(t, seqValues(3, 0, 2), log.values())
		require.Equal(t, 1, s.count("batch"), "3/0 read afresh")
		require.Equal(t, 1, s.count("except"), "3/1 read without 3/0, after its publish")
		require.Equal(t, 2, s.count("mark"))
		stop(t, r)
	})
}

// A delete that fails while the next batch is published ends the
// bucket's turn: that batch is not deleted, and both are published again,
// in order, after the backoff.
func TestSkipperDeleteFailure(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		failed := false
		s, log, cfg, r := hintDuring(t, 2, func(op string) error {
			if op == "mark" && !failed {
				failed = true
				return errors.New("connection reset")
			}
			return nil
		})
		// 3/1-3/2 published, 3/0's delete failed.
		require.Equal(t, 3, s.pending())
		time.Sleep(cfg.BackoffMax) // the bubble's clock: the backoff passes
		synctest.Wait()
		require.Zero(t, s.pending())
		// The first delete failed: both batches again.
		require.Equal(t, append(seqValues(3, 0, 3), seqValues(3, 0, 3)...), log.values())
		stop(t, r)
	})
}

// slowDiscovery is a fakeStore whose PendingBuckets waits for gate once
// it said so on entered.
type slowDiscovery struct {
	*fakeStore
	entered chan struct{}
	gate    chan struct{}
}

func (s slowDiscovery) PendingBuckets(ctx context.Context, bs []int) ([]int, error) {
	s.entered <- struct{}{}
	<-s.gate
	return s.fakeStore.PendingBuckets(ctx, bs)
}

// The relay takes hints while a discovery is still waiting for the
// store: a hinted bucket does not wait behind it. The discovery's
// findings are drained once it returns.
func TestHintNotBehindDiscovery(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		base, hints, cfg := hintedSetup()
		s := slowDiscovery{fakeStore: base, entered: make(chan struct{}, 8), gate: make(chan struct{})}
		base.add(5, 1) // found by discovery only
		published := make(chan string, 8)
		r := start(t, s, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
			for _, m := range msgs {
				published <- string(m.Value)
			}
			return len(msgs), nil
		}), cfg)
		<-s.entered // the first discovery, after the leases were gained
		base.add(1, 1)
		hints.notify(1)
		select {
		case v := <-published:
			require.Equal(t, "1/0", v)
		case <-time.After(time.Minute): // the bubble's clock
			close(s.gate)
			t.Fatal("the hinted bucket waited behind the discovery")
		}
		close(s.gate)
		require.Equal(t, "5/0", <-published, "the discovery's bucket is drained when it returns")
		synctest.Wait()
		require.Zero(t, base.pending())
		stop(t, r)
	})
}

// A discovery asks the store only about buckets that are neither in
// flight nor queued. The bucket in flight is read again after its batch,
// as a probe that found its rows would have it: a row committed during
// its batch, with no hint, is published without another discovery.
func TestDiscoveryProbesIdleBucketsOnly(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, cfg := hintedSetup()
		cfg.Parallelism = 1
		release := make(chan struct{})
		var log pubLog
		inner := log.publisher(nil)
		r := start(t, s, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if msgs[0].Bucket == 0 {
				<-release
			}
			return inner.Publish(ctx, msgs)
		}), cfg)
		synctest.Wait()
		require.Len(t, r.Leases(), 8)
		s.add(0, 1)
		hints.notify(0)
		synctest.Wait() // bucket 0's publish is blocked
		s.add(0, 1)     // committed during bucket 0's batch, no hint
		s.add(1, 1)
		hints.notify(1)
		synctest.Wait() // bucket 1 waits for the one drainer
		s.add(2, 1)     // found by discovery only
		hints.mu.Lock()
		hints.unknown = true
		hints.mu.Unlock()
		hints.notify()
		synctest.Wait()
		s.mu.Lock()
		probed := s.probes[len(s.probes)-1]
		s.mu.Unlock()
		require.Equal(t, []int{2, 3, 4, 5, 6, 7}, probed, "the bucket in flight and the queued one are not probed")

		discoveries := s.count("pending")
		close(release)
		synctest.Wait()
		require.Zero(t, s.pending(), "the row committed during bucket 0's batch is published")
		require.Equal(t, discoveries, s.count("pending"), "without another discovery")
		require.Equal(t, 4, log.n())
		stop(t, r)
	})
}

// The relay takes BucketCount from a store that knows it, and refuses a
// Config value that disagrees.
func TestBucketCountFromStore(t *testing.T) {
	t.Parallel()
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
	s := advancingStore{newFakeStore(16)}
	cfg := config("a")
	cfg.BucketCount = 0
	r, err := relay.New(s, pub, cfg)
	require.NoError(t, err)
	synctest.Test(t, func(t *testing.T) {
		s.add(15, 1)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 1, n, "bucket 15 exists: the relay uses the store's 16 buckets")
	})
	cfg.BucketCount = 16
	_, err = relay.New(s, pub, cfg)
	require.NoError(t, err)
	cfg.BucketCount = 8
	_, err = relay.New(s, pub, cfg)
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "BucketCount", ce.Field)
	require.Contains(t, err.Error(), "configured with 16")
	var me *relay.MisconfigurationError
	require.ErrorAs(t, err, &me, "the ConfigError wraps CheckBucketCount's error")
}

// CheckBucketCount accepts only the outbox's own BucketCount.
func TestCheckBucketCount(t *testing.T) {
	t.Parallel()
	require.NoError(t, relay.CheckBucketCount(8, 8, "the outbox"))
	err := relay.CheckBucketCount(16, 8, "the outbox (table outbox_messages)")
	var me *relay.MisconfigurationError
	require.ErrorAs(t, err, &me)
	require.Equal(t, "BucketCount", me.Setting)
	require.ErrorIs(t, err, relay.ErrMisconfigured)
	require.Contains(t, err.Error(), "the relay uses 16 buckets but the outbox (table outbox_messages) is configured with 8")
}

// Several relays with several drainers each share one outbox while
// writers keep adding, relays join and leave: no bucket ever has two
// batches in flight (in one relay or across relays), every bucket is
// published in order, and everything is delivered.
func TestRelaysRace(t *testing.T) {
	t.Parallel()
	const buckets = 16
	s := newFakeStore(buckets)
	var (
		mu       sync.Mutex
		busy     = map[int]string{}
		last     = map[int]int64{} // bucket -> largest id published
		seen     = map[int64]bool{}
		problems []string
	)
	pub := func(id string) relay.Publisher {
		return relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
			// A batch is one bucket's, the only one in flight for it.
			b := msgs[0].Bucket
			mu.Lock()
			for _, m := range msgs[1:] {
				if m.Bucket != b {
					problems = append(problems, fmt.Sprintf("bucket %d: a batch holds a message of bucket %d", b, m.Bucket))
				}
			}
			if other, ok := busy[b]; ok {
				problems = append(problems, fmt.Sprintf("bucket %d: %s publishes while %s does", b, id, other))
			}
			busy[b] = id
			mu.Unlock()
			time.Sleep(time.Millisecond + time.Duration(len(msgs))*20*time.Microsecond)
			mu.Lock()
			delete(busy, b)
			for _, m := range msgs {
				// Ids grow with submission: within a bucket each message
				// is published after the earlier ones (a repeat of an
				// earlier one is a duplicate, not a reorder).
				if m.ID <= last[b] && !seen[m.ID] {
					problems = append(problems, fmt.Sprintf("bucket %d: message %d published after %d", b, m.ID, last[b]))
				}
				seen[m.ID] = true
				last[b] = max(last[b], m.ID)
			}
			mu.Unlock()
			return len(msgs), nil
		})
	}
	cfgFor := func(id string) relay.Config {
		cfg := config(id)
		cfg.BucketCount = buckets
		cfg.PollInterval = time.Millisecond
		cfg.LeaseDuration = 2 * time.Second
		cfg.LeaseRenewInterval = 20 * time.Millisecond
		cfg.BackoffMin = time.Millisecond
		cfg.BackoffMax = 10 * time.Millisecond
		return cfg
	}
	var stores []relay.Store
	stores = append(stores, s, advancingStore{s}, basicStore{s})
	stopWriting := make(chan struct{})
	var writers sync.WaitGroup
	writers.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stopWriting:
				return
			case <-time.After(time.Millisecond):
			}
			s.add(i%buckets, 1+i%7)
		}
	})
	parallelism := []int{1, 2, 7}
	var relays []*relay.Relay
	for i := range 3 {
		id := fmt.Sprintf("r%d", i)
		cfg := cfgFor(id)
		cfg.Parallelism = parallelism[i]
		relays = append(relays, start(t, stores[i], pub(id), cfg))
	}
	// Relays join and leave while the writers write.
	for round := range 6 {
		time.Sleep(100 * time.Millisecond)
		i := round % 3
		stop(t, relays[i])
		id := fmt.Sprintf("r%d-%d", i, round)
		cfg := cfgFor(id)
		cfg.Parallelism = parallelism[i]
		relays[i] = start(t, stores[i], pub(id), cfg)
	}
	close(stopWriting)
	writers.Wait()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, s.pending()) }, time.Minute, 10*time.Millisecond)
	for _, r := range relays {
		stop(t, r)
	}
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, problems)
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Len(t, seen, int(s.nextID), "every message delivered")
}
