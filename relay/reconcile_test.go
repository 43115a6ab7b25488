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

// sinkLedger is a publisher that remembers, like the strict-mode Kafka
// publisher's progress marker, the ids of the last batch it committed, and
// names them to the relay (relay.Reconciler). failAfterCommit makes the
// batch whose first id it names commit and then report a failure, once,
// as a publish cancelled after its commit does.
type sinkLedger struct {
	mu              sync.Mutex
	last            []int64
	committed       []int64 // every id committed, in order
	reconciles      int
	failAfterCommit int64
}

func (l *sinkLedger) Publish(_ context.Context, msgs []relay.Message) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last = l.last[:0:0]
	for _, m := range msgs {
		l.last = append(l.last, m.ID)
	}
	l.committed = append(l.committed, l.last...)
	if msgs[0].ID == l.failAfterCommit {
		l.failAfterCommit = 0 // once
		return 0, errors.New("committed, but the acknowledgement was lost")
	}
	return len(msgs), nil
}

func (l *sinkLedger) Reconcile(_ context.Context, _ relay.Lease) ([]int64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reconciles++
	return slices.Clone(l.last), nil
}

// drainAll runs a relay until s is empty, stops it, and returns the
// failures its handler met (each backed off).
func drainAll(t *testing.T, s *fakeStore, pub relay.Publisher, cfg relay.Config) []relay.Failure {
	t.Helper()
	var failures []relay.Failure
	cfg.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
		failures = append(failures, f)
		return relay.FailureBackoff, nil
	})
	r := start(t, s, pub, cfg)
	for s.pending() > 0 {
		time.Sleep(10 * time.Millisecond)
	}
	stop(t, r)
	return failures
}

// A Reconciler's ids are deleted before the bucket's first batch, and
// again before the batch after one that ended in doubt; a batch that
// succeeded needs none. Every message reaches the sink once.
func TestReconcileDeletesWhatTheSinkHolds(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(4, 7) // ids 1..7
		// A previous owner committed ids 1 and 2 and died before deleting.
		sink := &sinkLedger{last: []int64{1, 2}, failAfterCommit: 3}
		cfg := config("a")
		cfg.BatchSize = 2
		failures := drainAll(t, s, sink, cfg)

		require.Equal(t, []int64{3, 4, 5, 6, 7}, sink.committed, "ids 1 and 2 not again, 3 and 4 once")
		require.Equal(t, 2, sink.reconciles, "before the first batch, and after the one that ended in doubt")
		require.Len(t, failures, 1, "the lost acknowledgement is a failure like any other")
	})
}

// A publisher that takes a prefix on purpose (relay.Truncated) has the
// prefix deleted and the rest published at once, with no failure counted
// and no backoff.
func TestTruncatedPublishesTheRest(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s := newFakeStore(8)
		s.add(4, 7)
		var log pubLog
		failures := drainAll(t, s, log.publisher(func(_ context.Context, msgs []relay.Message) (int, error) {
			if len(msgs) > 3 {
				return 3, relay.Truncated(errors.New("three fit"))
			}
			return len(msgs), nil
		}), config("a"))

		require.Equal(t, 3, log.n())
		var sizes []int
		var firsts []string
		for i := range log.n() {
			sizes = append(sizes, len(log.call(i)))
			firsts = append(firsts, string(log.call(i)[0].Value))
		}
		require.Equal(t, []int{7, 4, 1}, sizes)
		require.Equal(t, []string{"4/0", "4/3", "4/6"}, firsts, "each batch starts after the prefix taken")
		require.Equal(t, log.time(0), log.time(2), "no backoff between the batches")
		require.Empty(t, failures, "no failure counted against a message")
		require.True(t, relay.IsTruncated(relay.Truncated(errors.New("x"))))
		require.Nil(t, relay.Truncated(nil))
	})
}
