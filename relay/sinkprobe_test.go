package relay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// probedSink is a publisher that can be probed (relay.SinkProber). While
// down, its publishes fail with fail and its probes fail; probeDown makes
// only the probes fail. It records when each publish and probe came.
type probedSink struct {
	mu        sync.Mutex
	down      bool
	fail      error // the publish error while down
	probesOK  bool  // probes answer even while down (a failure the probe does not see)
	probes    []time.Time
	publishes []time.Time
	published int
}

func (p *probedSink) Publish(_ context.Context, msgs []relay.Message) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.publishes = append(p.publishes, time.Now())
	if p.down {
		return 0, p.fail
	}
	p.published += len(msgs)
	return len(msgs), nil
}

func (p *probedSink) ProbeSink(context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.probes = append(p.probes, time.Now())
	if p.down && !p.probesOK {
		return errors.New("dial tcp 127.0.0.1:9092: connect: connection refused")
	}
	return nil
}

func (p *probedSink) set(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
}

func (p *probedSink) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.published
}

var errBrokerDown = relay.Unavailable(errors.New("kafka: client has run out of available brokers to talk to"))

// A relay whose publishes fail because the sink is unavailable probes the
// sink at most every ProbeIntervalMin, though BackoffMin is shorter, and
// publishes again at the first probe that answers, not at the end of the
// bucket's backoff (seconds by then).
func TestSinkProbeEndsTheBackoffWhenTheSinkAnswers(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		pub := &probedSink{fail: errBrokerDown}
		r := start(t, s, pub, probeConfig())
		synctest.Wait()
		require.Len(t, r.Leases(), 8)

		down := time.Now()
		pub.set(true)
		s.add(1, 3)
		const outage = 10 * time.Second
		time.Sleep(outage)
		probes := since(&pub.mu, &pub.probes, down)
		require.NotEmpty(t, probes)
		require.LessOrEqual(t, len(probes), int(outage/relay.ProbeIntervalMin)+1, "probes at least ProbeIntervalMin apart")
		for i := 1; i < len(probes); i++ {
			require.GreaterOrEqual(t, probes[i].Sub(probes[i-1]), relay.ProbeIntervalMin)
		}
		require.Equal(t, 3, s.pending(), "nothing published during the outage")
		// By now bucket 1 backs off for seconds (10ms doubled up to 4s).

		back := time.Now()
		pub.set(false)
		time.Sleep(relay.ProbeIntervalMin)
		synctest.Wait()
		require.NotEmpty(t, since(&pub.mu, &pub.publishes, back), "published within a probe interval of the sink answering")
		require.Equal(t, 3, pub.count())
		require.Zero(t, s.pending())
		stop(t, r)
	})
}

// publishesAtBackoffMax runs a relay whose publisher fails for good from
// the start, waits until bucket 1's backoff reached BackoffMax (10ms
// doubled to 4s within about 5s of failures), and returns the publishes
// and probes of the next window.
func publishesAtBackoffMax(t *testing.T, pub *probedSink, window time.Duration) (publishes, probes []time.Time) {
	s := newFakeStore(8)
	r := start(t, s, pub, probeConfig())
	synctest.Wait()
	pub.set(true)
	s.add(1, 1)
	time.Sleep(10 * time.Second)
	from := time.Now()
	time.Sleep(window)
	publishes = since(&pub.mu, &pub.publishes, from)
	probes = since(&pub.mu, &pub.probes, from)
	pub.set(false)
	stop(t, r)
	return publishes, probes
}

// A publish that fails as unavailable while the probe answers (a failure
// the probe cannot see: a partition without a leader on a broker that is
// up) keeps its plain backoff: once the backoff reached BackoffMax,
// publishes come at least BackoffMax/2 apart (one early retry allowed),
// not every probe interval.
func TestSinkProbeAnsweringKeepsTheBackoffOfAFailureItDoesNotSee(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const window = 10 * time.Second
		publishes, probes := publishesAtBackoffMax(t, &probedSink{fail: errBrokerDown, probesOK: true}, window)
		require.NotEmpty(t, publishes)
		require.LessOrEqual(t, len(publishes), int(window/(probeConfig().BackoffMax/2))+2,
			"publishes at least BackoffMax/2 apart, bar one early retry: %v", publishes)
		require.NotEmpty(t, probes, "the sink was probed meanwhile")
	})
}

// A publish failure that is not about the sink's availability (a message
// refused for good) is never probed for: the bucket sleeps its backoff
// out.
func TestSinkProbeIgnoresFailuresAboutTheMessage(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const window = 10 * time.Second
		pub := &probedSink{fail: relay.Permanent(errors.New("record too large"))}
		publishes, _ := publishesAtBackoffMax(t, pub, window)
		require.NotEmpty(t, publishes)
		require.LessOrEqual(t, len(publishes), int(window/(probeConfig().BackoffMax/2))+1,
			"publishes at least BackoffMax/2 apart: %v", publishes)
		pub.mu.Lock()
		defer pub.mu.Unlock()
		require.Empty(t, pub.probes, "no probe for a failure about the message")
	})
}

// A sink that goes down again after an early retry is retried early
// again once a probe failed and the next one answers: the rule that
// keeps a failure the probe cannot see at its plain backoff does not
// outlive the next probe failure.
func TestSinkProbeSecondOutage(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		pub := &probedSink{fail: errBrokerDown}
		r := start(t, s, pub, probeConfig())
		synctest.Wait()

		for round := range 2 {
			pub.set(true)
			s.add(1, 1)
			time.Sleep(10 * time.Second)
			back := time.Now()
			pub.set(false)
			time.Sleep(relay.ProbeIntervalMin)
			synctest.Wait()
			require.NotEmpty(t, since(&pub.mu, &pub.publishes, back), "round %d: published within a probe interval of the sink answering", round)
			require.Zero(t, s.pending(), "round %d", round)
		}
		stop(t, r)
	})
}
