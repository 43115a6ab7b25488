package relay_test

import (
	"context"
	"errors"
	"math"
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
	last            []relay.Message
	committed       []int64 // every id committed, in order
	reconciles      int
	failAfterCommit int64
	// forge, when set, is what Reconcile reports instead of the last
	// batch: a record that is not this store's.
	forge *relay.Committed
	// span makes Reconcile record the last batch as its span (first and
	// last id, count), as the strict-mode publisher does for a batch
	// whose ids do not fit its marker.
	span bool
}

func (l *sinkLedger) Publish(_ context.Context, msgs []relay.Message) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last = slices.Clone(msgs)
	for _, m := range msgs {
		l.committed = append(l.committed, m.ID)
	}
	if msgs[0].ID == l.failAfterCommit {
		l.failAfterCommit = 0 // once
		return 0, errors.New("committed, but the acknowledgement was lost")
	}
	return len(msgs), nil
}

func (l *sinkLedger) Reconcile(_ context.Context, _ relay.Lease) (relay.Committed, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.reconciles++
	if l.forge != nil {
		return *l.forge, nil
	}
	c := relay.Committed{Digest: relay.MessagesDigest(l.last)}
	if l.span && len(l.last) > 0 {
		c.First, c.Last, c.Count = l.last[0].ID, l.last[len(l.last)-1].ID, len(l.last)
		return c, nil
	}
	for _, m := range l.last {
		c.IDs = append(c.IDs, m.ID)
	}
	return c, nil
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
// The same holds for a record of the batch's span.
func TestReconcileDeletesWhatTheSinkHolds(t *testing.T) {
	t.Parallel()
	for name, span := range map[string]bool{"list": false, "span": true} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newFakeStore(8)
				s.add(4, 7) // ids 1..7
				// A previous owner committed ids 1 and 2 and died before deleting.
				head, err := s.NextBatch(t.Context(), 4, 2)
				require.NoError(t, err)
				sink := &sinkLedger{last: head, failAfterCommit: 3, span: span}
				cfg := config("a")
				cfg.BatchSize = 2
				failures := drainAll(t, s, sink, cfg)

				require.Equal(t, []int64{3, 4, 5, 6, 7}, sink.committed, "ids 1 and 2 not again, 3 and 4 once")
				require.Equal(t, 2, sink.reconciles, "before the first batch, and after the one that ended in doubt")
				require.Len(t, failures, 1, "the lost acknowledgement is a failure like any other")
			})
		})
	}
}

// A record that is not this store's deletes nothing: the same ids holding
// other messages (another outbox with the sink's identity, or ids reused
// after the database was recreated), or only some of its ids there. Every
// message is published; the worst a foreign record can cause is a
// duplicate, never a loss.
func TestReconcileIgnoresAForeignRecord(t *testing.T) {
	t.Parallel()
	for name, forge := range map[string]relay.Committed{
		"other messages": {IDs: []int64{1, 2}, Digest: relay.MessagesDigest([]relay.Message{{MessageID: "x1"}, {MessageID: "x2"}})},
		"some ids gone":  {IDs: []int64{1, 99}, Digest: relay.MessagesDigest([]relay.Message{{MessageID: "m1"}, {MessageID: "m99"}})},
		"span, other messages": {First: 1, Last: 2, Count: 2,
			Digest: relay.MessagesDigest([]relay.Message{{MessageID: "x1"}, {MessageID: "x2"}})},
		"span, a row inside it not carried": {First: 1, Last: 3, Count: 2, // row 2 committed late
			Digest: relay.MessagesDigest([]relay.Message{{MessageID: "m1"}, {MessageID: "m3"}})},
		"span, its last row gone": {First: 1, Last: 99, Count: 7,
			Digest: relay.MessagesDigest([]relay.Message{{MessageID: "m1"}, {MessageID: "m2"}, {MessageID: "m3"}, {MessageID: "m4"}, {MessageID: "m5"}, {MessageID: "m6"}, {MessageID: "m7"}})},
		"span, its first row gone": {First: 0, Last: 2, Count: 2,
			Digest: relay.MessagesDigest([]relay.Message{{MessageID: "m1"}, {MessageID: "m2"}})},
		"span, a count no batch has": {First: 1, Last: math.MaxInt64, Count: math.MaxInt, Digest: 1},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newFakeStore(8)
				s.add(4, 7)
				sink := &sinkLedger{forge: &forge}
				cfg := config("a")
				cfg.BatchSize = 2
				require.Empty(t, drainAll(t, s, sink, cfg))
				require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7}, sink.committed, "nothing deleted unpublished")
			})
		})
	}
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

// A relay given a Reconciler publisher (strict mode's) without a
// BatchSize reads batches of BatchSizeReconcilerDefault; any other
// publisher's batches are BatchSizeDefault, and a BatchSize given is
// kept.
func TestBatchSizeDefaultFollowsThePublisher(t *testing.T) {
	t.Parallel()
	pending := relay.BatchSizeReconcilerDefault + 5
	for name, tc := range map[string]struct {
		pub       func(*pubLog) relay.Publisher
		batchSize int
		want      int
	}{
		"reconciler":            {func(l *pubLog) relay.Publisher { return reconcilingLog{l.publisher(nil)} }, 0, relay.BatchSizeReconcilerDefault},
		"reconciler, batch set": {func(l *pubLog) relay.Publisher { return reconcilingLog{l.publisher(nil)} }, 300, 300},
		"other":                 {func(l *pubLog) relay.Publisher { return l.publisher(nil) }, 0, relay.BatchSizeDefault},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := newFakeStore(8)
				s.add(4, pending)
				var log pubLog
				cfg := config("a")
				cfg.BatchSize = tc.batchSize
				require.Empty(t, drainAll(t, s, tc.pub(&log), cfg))
				require.Len(t, log.call(0), tc.want)
			})
		})
	}
}

// reconcilingLog is a Reconciler publisher with nothing to reconcile.
type reconcilingLog struct{ relay.Publisher }

func (reconcilingLog) Reconcile(context.Context, relay.Lease) (relay.Committed, error) {
	return relay.Committed{}, nil
}
