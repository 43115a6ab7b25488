package relay_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// remove deletes the message id from its bucket, as a dead-letter handler
// would.
func (s *fakeStore) remove(bucket int, id int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs[bucket] = slices.DeleteFunc(s.msgs[bucket], func(m relay.Message) bool { return m.ID == id })
}

// eventLog records the relay's publish events.
type eventLog struct {
	relay.NopObserver
	mu     sync.Mutex
	events []relay.PublishEvent
}

func (o *eventLog) Published(e relay.PublishEvent) {
	o.mu.Lock()
	o.events = append(o.events, e)
	o.mu.Unlock()
}

// An outage is not a poison message: failures the publisher marks
// unavailable back off without being recorded against the message or
// handed to the failure policy, however many there are, and the bucket
// is delivered in order once the sink is back.
func TestUnavailableIsNotCounted(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(4, 5)
		var log pubLog
		var handled []relay.Failure
		cfg := config("a")
		cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
			handled = append(handled, f)
			return relay.FailureRetry, nil // would dead-letter: must never be asked
		})
		outage := 50
		r := start(t, s, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
			if outage > 0 {
				outage--
				return 0, relay.Unavailable(errors.New("dial tcp: connection refused"))
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)

		require.Empty(t, handled, "the failure policy never sees an outage")
		require.Zero(t, s.count("record"), "no attempt recorded against the message")
		require.Equal(t, 51, log.n())
		last := log.call(log.n() - 1)
		require.Len(t, last, 5, "the whole bucket, from its first message, after the outage")
		require.Equal(t, "4/0", string(last[0].Value))
	})
}

// A batch the sink rejected as a whole is split until the culprit is
// alone: the messages before it are delivered, and only the culprit meets
// the failure policy.
func TestBatchRejectedIsSplit(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 9)
		culprit := "2/5"
		var log pubLog
		var handled []relay.Failure
		cfg := config("a")
		cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
			handled = append(handled, f)
			if !relay.IsPermanent(f.Err) {
				return relay.FailureBackoff, nil
			}
			s.remove(f.Lease.Bucket, f.Message.ID)
			return relay.FailureRetry, nil
		})
		r := start(t, s, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
			for _, m := range msgs {
				if string(m.Value) == culprit {
					// The broker refuses the request: every record of it.
					return 0, relay.Permanent(relay.BatchRejected(errors.New("MESSAGE_TOO_LARGE")))
				}
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)

		require.Len(t, handled, 1, "only the culprit meets the failure policy")
		require.Equal(t, culprit, string(handled[0].Message.Value))
		var delivered []string
		for i := range log.n() {
			c := log.call(i)
			if !slices.ContainsFunc(c, func(m relay.Message) bool { return string(m.Value) == culprit }) {
				for _, m := range c {
					delivered = append(delivered, string(m.Value))
				}
			}
		}
		require.Equal(t, []string{"2/0", "2/1", "2/2", "2/3", "2/4", "2/6", "2/7", "2/8"}, delivered, "everything else, in order")
	})
}

// A publish that outlasts PublishTimeout is cancelled, reported as a
// failure wrapping ErrPublishTimeout, and retried after backoff without
// counting against the messages.
func TestPublishTimeout(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(1, 3)
		var log pubLog
		obs := &eventLog{}
		var handled int
		cfg := config("a")
		cfg.PublishTimeout = 5 * time.Second
		cfg.Observer = obs
		cfg.FailureHandler = relay.FailureHandlerFunc(func(context.Context, relay.Failure) (relay.FailureAction, error) {
			handled++
			return relay.FailureBackoff, nil
		})
		hung := true
		r := start(t, s, log.publisher(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if hung {
				hung = false
				<-ctx.Done() // a producer that never answers
				return 0, ctx.Err()
			}
			return len(msgs), nil
		}), cfg)
		for s.pending() > 0 {
			time.Sleep(10 * time.Millisecond)
		}
		stop(t, r)

		require.Zero(t, handled)
		require.Zero(t, s.count("record"))
		require.Equal(t, 2, log.n())
		require.GreaterOrEqual(t, log.time(1).Sub(log.time(0)), cfg.PublishTimeout)
		obs.mu.Lock()
		defer obs.mu.Unlock()
		require.ErrorIs(t, obs.events[0].Err, relay.ErrPublishTimeout)
		require.True(t, relay.IsUnavailable(obs.events[0].Err))
		require.False(t, obs.events[0].Cancelled)
		require.NoError(t, obs.events[1].Err)
	})
}

// DrainOnce says which buckets with pending messages it could not own,
// instead of returning a silent partial count.
func TestDrainOnceReportsUnownedBuckets(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		for b := range 8 {
			s.add(b, 2)
		}
		s.allowed = func(_ string, b int) bool { return b != 3 && b != 6 } // held elsewhere
		r, err := relay.New(s, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil }), config("a"))
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.Equal(t, 12, n)
		require.ErrorIs(t, err, relay.ErrNotOwned)
		var no *relay.NotOwnedError
		require.ErrorAs(t, err, &no)
		require.Equal(t, []int{3, 6}, no.Buckets)
		require.Equal(t, 4, s.pending())
	})
}

// A lease that lapses in the middle of DrainOnce (a slow store) is
// acquired again, and the drain completes.
func TestDrainOnceReacquiresLostLease(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(2, 30)
		cfg := config("a")
		renewals := 0
		s.renew = func(held []relay.Lease) []relay.Lease {
			renewals++
			if renewals == 1 {
				return nil // the first renewal during the publish finds the lease gone
			}
			return held
		}
		slow := true
		var log pubLog
		r, err := relay.New(s, log.publisher(func(ctx context.Context, msgs []relay.Message) (int, error) {
			if slow {
				slow = false
				<-ctx.Done() // cancelled when the lease is lost
				return 0, ctx.Err()
			}
			return len(msgs), nil
		}), cfg)
		require.NoError(t, err)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 30, n)
		require.Zero(t, s.pending())
		require.Equal(t, 1, renewals)
		require.Equal(t, 4, log.n(), "the lost batch, then the three batches after re-acquiring")
	})
}
