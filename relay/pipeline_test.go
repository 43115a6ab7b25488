package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// pipeSink is a relay.Pipeliner over an in-memory log, a model of an
// idempotent Kafka producer with several produce requests in flight:
// Send queues a batch and returns at once; the batch's outcome is decided
// by the test (release), or at once in auto mode. A message is written
// only after every earlier message with its key in a send still in
// flight at its own Send was written or failed; when one of those
// failed, it fails too, unwritten. Sends of different keys complete in
// any order in time.
type pipeSink struct {
	mu        sync.Mutex
	sends     []*pipeSend
	written   []relay.Message
	auto      bool // every send acknowledged completely, at once
	publishes int  // Publish calls
}

// pipeSend is one Send.
type pipeSend struct {
	relay  string // the relay that sent it (pipeSink.as)
	msgs   []relay.Message
	before []*pipeSend // the sends in flight at its Send
	decide chan pipeOutcome
	done   chan struct{}
	// Set before done closes: the keys that failed in it, and what its
	// wait returned.
	failed map[string]bool
	acked  int
	err    error
	waited bool
}

// pipeOutcome is what the sink does with a send: the first acked
// messages are written, the rest fail with err.
type pipeOutcome struct {
	acked int
	err   error
}

var errKeyFailed = errors.New("an earlier message of the key failed")

func (s *pipeSink) Send(ctx context.Context, msgs []relay.Message) func() (int, error) {
	return s.send(ctx, "", msgs)
}

func (s *pipeSink) send(ctx context.Context, relayID string, msgs []relay.Message) func() (int, error) {
	s.mu.Lock()
	ps := &pipeSend{relay: relayID, msgs: slices.Clone(msgs), decide: make(chan pipeOutcome, 1), done: make(chan struct{}), failed: map[string]bool{}}
	for _, e := range s.sends {
		select {
		case <-e.done:
		default:
			ps.before = append(ps.before, e)
		}
	}
	s.sends = append(s.sends, ps)
	if s.auto {
		ps.decide <- pipeOutcome{acked: len(msgs)}
	}
	s.mu.Unlock()
	var once sync.Once
	return func() (acked int, err error) {
		called := false
		once.Do(func() { called = true; acked, err = s.resolve(ctx, ps) })
		if !called {
			panic("pipeSink: wait called twice")
		}
		return acked, err
	}
}

// resolve writes ps's messages as decided, each after the earlier
// messages of its key in flight at its Send.
func (s *pipeSink) resolve(ctx context.Context, ps *pipeSend) (int, error) {
	var o pipeOutcome
	select {
	case o = <-ps.decide:
	case <-ctx.Done():
		o = pipeOutcome{err: context.Cause(ctx)}
	}
	for _, e := range ps.before {
		if !sharesKey(e, ps) {
			continue
		}
		select {
		case <-e.done:
		case <-ctx.Done():
			o = pipeOutcome{err: context.Cause(ctx)}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	acked, err := 0, o.err
	for j, m := range ps.msgs {
		if j >= o.acked {
			break
		}
		if slices.ContainsFunc(ps.before, func(e *pipeSend) bool { return e.failed[string(m.Key)] }) {
			err = fmt.Errorf("message %d: %w", j, errKeyFailed)
			break
		}
		s.written = append(s.written, m)
		acked++
	}
	for _, m := range ps.msgs[acked:] {
		ps.failed[string(m.Key)] = true
	}
	ps.acked, ps.err, ps.waited = acked, err, true
	close(ps.done)
	return acked, err
}

func sharesKey(a, b *pipeSend) bool {
	for _, m := range a.msgs {
		if slices.ContainsFunc(b.msgs, func(n relay.Message) bool { return string(n.Key) == string(m.Key) }) {
			return true
		}
	}
	return false
}

func (s *pipeSink) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	s.mu.Lock()
	s.publishes++
	s.mu.Unlock()
	return s.Send(ctx, msgs)()
}

// relaySink is the pipeSink as one relay's publisher: its sends name it.
type relaySink struct {
	*pipeSink
	id string
}

func (s relaySink) Send(ctx context.Context, msgs []relay.Message) func() (int, error) {
	return s.send(ctx, s.id, msgs)
}

func (s relaySink) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	return s.Send(ctx, msgs)()
}

// release decides send i's outcome.
func (s *pipeSink) release(i, acked int, err error) {
	s.mu.Lock()
	ps := s.sends[i]
	s.mu.Unlock()
	ps.decide <- pipeOutcome{acked: acked, err: err}
}

// releaseAll acknowledges send i completely.
func (s *pipeSink) releaseAll(i int) {
	s.mu.Lock()
	n := len(s.sends[i].msgs)
	s.mu.Unlock()
	s.release(i, n, nil)
}

// setAuto acknowledges every send from now on, and the ones waiting.
func (s *pipeSink) setAuto() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.auto = true
	for _, ps := range s.sends {
		select {
		case ps.decide <- pipeOutcome{acked: len(ps.msgs)}:
		default:
		}
	}
}

// sent returns the values of each send's messages.
func (s *pipeSink) sent() [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out [][]string
	for _, ps := range s.sends {
		out = append(out, msgValues(ps.msgs))
	}
	return out
}

// waited reports whether the relay's wait of send i returned.
func (s *pipeSink) waited(i int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.sends[i].done:
		return s.sends[i].waited
	default:
		return false
	}
}

// inOrder reports the messages written before an earlier message of their
// key had been written once: order per key, a repeat of an earlier
// message being a duplicate, not a reorder. Values are "key/seq".
func (s *pipeSink) inOrder() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var problems []string
	next := map[string]int{} // key -> the sequence number written up to
	for _, m := range s.written {
		key, seq := splitValue(string(m.Value))
		switch {
		case seq > next[key]:
			problems = append(problems, fmt.Sprintf("%s written before %s/%d", m.Value, key, next[key]))
		case seq == next[key]:
			next[key]++
		}
	}
	return problems
}

func (s *pipeSink) writtenValues() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return msgValues(s.written)
}

func msgValues(msgs []relay.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = string(m.Value)
	}
	return out
}

func splitValue(v string) (string, int) {
	key, seq, _ := strings.Cut(v, "/")
	var n int
	fmt.Sscan(seq, &n)
	return key, n
}

// keyed adds to bucket one message per key, valued "key/seq" with seq
// counting the key's messages, as committed.
type keyed struct {
	mu  sync.Mutex
	seq map[string]int
}

func (k *keyed) add(s *fakeStore, bucket int, keys ...string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.seq == nil {
		k.seq = map[string]int{}
	}
	var msgs []relay.Message
	for _, key := range keys {
		msgs = append(msgs, relay.Message{Bucket: bucket, Topic: "t", Key: []byte(key),
			MessageID: fmt.Sprintf("%s-%d", key, k.seq[key]), Value: fmt.Appendf(nil, "%s/%d", key, k.seq[key])})
		k.seq[key]++
	}
	s.insert(msgs)
}

// checkedStore is a skippingStore that checks every delete: only
// messages the sink wrote, and only the oldest rows of the bucket.
type checkedStore struct {
	skippingStore
	sink *pipeSink

	mu       sync.Mutex
	deletes  [][]string // the values of each delete, in order
	problems []string
}

func newCheckedStore(s *fakeStore, sink *pipeSink) *checkedStore {
	return &checkedStore{skippingStore: skippingStore{advancingStore{s}}, sink: sink}
}

func (c *checkedStore) check(l relay.Lease, msgs []relay.Message) {
	c.sink.mu.Lock()
	for _, m := range msgs {
		if !slices.ContainsFunc(c.sink.written, func(w relay.Message) bool { return w.ID == m.ID }) {
			c.problem("%s deleted, never acknowledged", m.Value)
		}
	}
	c.sink.mu.Unlock()
	last := slices.MaxFunc(msgs, func(a, b relay.Message) int { return int(a.ID - b.ID) }).ID
	c.fakeStore.mu.Lock()
	for _, m := range c.fakeStore.msgs[l.Bucket] {
		if m.ID < last && !slices.ContainsFunc(msgs, func(d relay.Message) bool { return d.ID == m.ID }) {
			c.problem("%s deleted before %s", msgValues(msgs), m.Value)
		}
	}
	c.fakeStore.mu.Unlock()
	c.mu.Lock()
	c.deletes = append(c.deletes, msgValues(msgs))
	c.mu.Unlock()
}

func (c *checkedStore) problem(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.problems = append(c.problems, fmt.Sprintf(format, args...))
}

func (c *checkedStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	c.check(l, msgs)
	return c.skippingStore.MarkPublished(ctx, id, l, msgs)
}

func (c *checkedStore) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	c.check(l, msgs)
	return c.skippingStore.MarkPublishedNext(ctx, id, l, msgs, limit)
}

func (c *checkedStore) result() ([][]string, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.deletes), slices.Clone(c.problems)
}

// pipeSetup starts a relay with PipelineDepth depth on a checked store
// over a pipeSink, with hints, polling off.
func pipeSetup(t *testing.T, depth int, mod func(*relay.Config)) (*fakeStore, *fakeHints, *pipeSink, *checkedStore, relay.Config, *relay.Relay) {
	s, hints, cfg := hintedSetup()
	cfg.PipelineDepth = depth
	if mod != nil {
		mod(&cfg)
	}
	sink := &pipeSink{}
	cs := newCheckedStore(s, sink)
	r := start(t, cs, sink, cfg)
	synctest.Wait()
	return s, hints, sink, cs, cfg, r
}

// commitDuring commits keys to bucket 3 and hints it, then commits more
// keys and hints the bucket again while the first batch is in flight.
func commitDuring(s *fakeStore, hints *fakeHints, k *keyed, first, then []string) {
	k.add(s, 3, first...)
	hints.notify(3)
	synctest.Wait() // the first batch in flight
	k.add(s, 3, then...)
	hints.notify(3)
	synctest.Wait()
}

// A bucket hinted while its batch is unacknowledged has its next batch
// read without that batch's rows and sent behind it, before the first
// batch's wait returned. Acknowledgements arriving later for the earlier
// batch keep the deletes in bucket order: the second batch, acknowledged
// first, is deleted only after the first. Each batch is reported to the
// Observer on its own. With PipelineDepth 1 the next batch waits for the
// first one's acknowledgements, as with any publisher.
func TestPipelineSendsBehindUnacknowledged(t *testing.T) {
	t.Parallel()
	t.Run("depth 2", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			obs := &recObserver{}
			s, hints, sink, cs, _, r := pipeSetup(t, 2, func(c *relay.Config) { c.Observer = obs })
			var k keyed
			commitDuring(s, hints, &k, []string{"a", "a", "a"}, []string{"b", "b"})
			require.Equal(t, [][]string{{"a/0", "a/1", "a/2"}, {"b/0", "b/1"}}, sink.sent(), "the next batch sent while the first is unacknowledged")
			require.False(t, sink.waited(0))

			sink.releaseAll(1) // the later batch acknowledged first
			synctest.Wait()
			require.True(t, sink.waited(1))
			require.Equal(t, 5, s.pending(), "nothing deleted before the first batch is acknowledged")

			sink.releaseAll(0)
			synctest.Wait()
			require.Zero(t, s.pending())
			deletes, problems := cs.result()
			require.Empty(t, problems)
			require.Equal(t, [][]string{{"a/0", "a/1", "a/2"}, {"b/0", "b/1"}}, deletes)
			require.Equal(t, []string{"b/0", "b/1", "a/0", "a/1", "a/2"}, sink.writtenValues())
			require.Zero(t, sink.publishes)
			obs.get(func(o *recObserver) {
				// Reported as each wait returned: the later batch first.
				require.Len(t, o.publishes, 2)
				for i, n := range []int{2, 3} {
					require.Equal(t, n, o.publishes[i].Messages)
					require.Equal(t, n, o.publishes[i].Acked)
					require.NoError(t, o.publishes[i].Err)
					require.False(t, o.publishes[i].Cancelled)
				}
			})
			stop(t, r)
		})
	})
	t.Run("depth 1", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			s, hints, sink, cs, _, r := pipeSetup(t, 1, nil)
			var k keyed
			commitDuring(s, hints, &k, []string{"a", "a", "a"}, []string{"b", "b"})
			require.Len(t, sink.sent(), 1, "the next batch waits for the first one's acknowledgements")
			sink.releaseAll(0)
			synctest.Wait()
			require.Len(t, sink.sent(), 2)
			sink.releaseAll(1)
			synctest.Wait()
			require.Zero(t, s.pending())
			_, problems := cs.result()
			require.Empty(t, problems)
			require.Equal(t, 2, sink.publishes)
			stop(t, r)
		})
	})
}

// Up to PipelineDepth batches of a bucket are in flight unacknowledged;
// the next hint waits for the oldest one's acknowledgements.
func TestPipelineDepthBounds(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, sink, cs, _, r := pipeSetup(t, 3, nil)
		var k keyed
		commitDuring(s, hints, &k, []string{"a"}, []string{"b"})
		k.add(s, 3, "c")
		hints.notify(3)
		synctest.Wait()
		k.add(s, 3, "d")
		hints.notify(3)
		synctest.Wait()
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"c/0"}}, sink.sent(), "three in flight, d waits")
		sink.releaseAll(0)
		synctest.Wait()
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"c/0"}, {"d/0"}}, sink.sent(), "d sent once a is acknowledged")
		require.Equal(t, 3, s.pending(), "a deleted")
		for i := 1; i < 4; i++ {
			sink.releaseAll(i)
		}
		synctest.Wait()
		require.Zero(t, s.pending())
		deletes, problems := cs.result()
		require.Empty(t, problems)
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"c/0"}, {"d/0"}}, deletes)
		stop(t, r)
	})
}

// PipelineDepth bounds the batches not acknowledged: a batch acknowledged
// behind a slow one frees its place, so the bucket's next hint is sent
// while the slow batch is still in flight. Deletes stay in bucket order.
// The batches acknowledged behind the slow one are bounded too: at most 4
// × PipelineDepth batches of a bucket are in flight or waiting for their
// delete.
func TestPipelineSlowBatchHoldsNoPlace(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, sink, cs, _, r := pipeSetup(t, 2, nil)
		var k keyed
		commitDuring(s, hints, &k, []string{"slow"}, []string{"k0"})
		require.Equal(t, [][]string{{"slow/0"}, {"k0/0"}}, sink.sent())
		for i := 1; i < 20; i++ {
			if i < len(sink.sent()) {
				sink.releaseAll(i) // acknowledged behind the slow batch
				synctest.Wait()
			}
			k.add(s, 3, fmt.Sprintf("k%d", i))
			hints.notify(3)
			synctest.Wait()
		}
		sent := sink.sent()
		require.Len(t, sent, 8, "the slow batch and 7 acknowledged behind it: 4 × PipelineDepth")
		require.Equal(t, []string{"k6/0"}, sent[7])
		require.Equal(t, 21, s.pending(), "nothing deleted before the slow batch is acknowledged")

		sink.releaseAll(0)
		synctest.Wait()
		sink.setAuto()
		k.add(s, 3, "last")
		hints.notify(3)
		synctest.Wait()
		require.Zero(t, s.pending())
		deletes, problems := cs.result()
		require.Empty(t, problems)
		var order []string
		for _, d := range deletes {
			order = append(order, d...)
		}
		require.Equal(t, "slow/0", order[0], "the slow batch deleted first")
		for i := 1; i < 8; i++ {
			require.Equal(t, fmt.Sprintf("k%d/0", i-1), order[i])
		}
		stop(t, r)
	})
}

// A batch that fails while later ones are in flight: they are awaited
// before anything else happens, nothing beyond the failed batch's
// acknowledged prefix is deleted, not even a later batch the sink wrote
// completely, and the failure policy meets the failed message. After the
// backoff the bucket is published again from the failed message: order
// per key holds, a duplicate at worst.
func TestPipelineFailureWhileNextInFlight(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		var failures []relay.Failure
		s, hints, sink, cs, cfg, r := pipeSetup(t, 3, func(c *relay.Config) {
			c.FailureHandler = relay.FailureHandlerFunc(func(_ context.Context, f relay.Failure) (relay.FailureAction, error) {
				failures = append(failures, f)
				return relay.FailureBackoff, nil
			})
		})
		var k keyed
		commitDuring(s, hints, &k, []string{"a", "a", "b"}, []string{"c"})
		k.add(s, 3, "d")
		hints.notify(3)
		synctest.Wait()
		require.Equal(t, [][]string{{"a/0", "a/1", "b/0"}, {"c/0"}, {"d/0"}}, sink.sent())

		sink.release(0, 1, errors.New("record rejected")) // a/0 written, a/1 and b/0 failed
		sink.releaseAll(1)                                // c/0 written
		synctest.Wait()
		require.Equal(t, 5, s.pending(), "the batches in flight behind the failed one are awaited first")
		require.Empty(t, failures)

		sink.releaseAll(2) // d/0 written
		synctest.Wait()
		require.ElementsMatch(t, []string{"a/0", "c/0", "d/0"}, sink.writtenValues())
		require.Equal(t, 4, s.pending(), "only a/0 deleted: c/0 and d/0, written, are published again")
		require.Len(t, failures, 1)
		require.Equal(t, "a/1", string(failures[0].Message.Value))
		require.Equal(t, 1, failures[0].Acked)

		sink.setAuto()
		time.Sleep(cfg.BackoffMax) // the bubble's clock: the backoff passes
		synctest.Wait()
		require.Zero(t, s.pending())
		require.Empty(t, sink.inOrder())
		require.Equal(t, []string{"a/1", "b/0", "c/0", "d/0"}, sink.writtenValues()[3:])
		deletes, problems := cs.result()
		require.Empty(t, problems)
		require.Equal(t, [][]string{{"a/0"}, {"a/1", "b/0", "c/0", "d/0"}}, deletes)
		stop(t, r)
	})
}

// A message whose key has a message in a batch not acknowledged yet is
// not sent: the next batch is cut before it, and the rest is read and
// sent once that batch is acknowledged. A sink fails what waits behind a
// failed message, not a message that reaches it after the failure.
func TestPipelineKeyInFlightWaits(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, sink, cs, _, r := pipeSetup(t, 3, nil)
		var k keyed
		commitDuring(s, hints, &k, []string{"a"}, []string{"b", "a", "c"})
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}}, sink.sent(), "cut before a/1")
		sink.releaseAll(0)
		synctest.Wait()
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"a/1", "c/0"}}, sink.sent(), "the rest once a/0 is acknowledged")
		sink.releaseAll(1)
		sink.releaseAll(2)
		synctest.Wait()
		require.Zero(t, s.pending())
		deletes, problems := cs.result()
		require.Empty(t, problems)
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"a/1", "c/0"}}, deletes)
		stop(t, r)
	})
}

// A batch known to have failed stops the sends, even before it is the
// oldest batch in flight: nothing more is sent until the failure policy
// met it.
func TestPipelineNoSendAfterKnownFailure(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, sink, cs, cfg, r := pipeSetup(t, 3, nil)
		var k keyed
		commitDuring(s, hints, &k, []string{"a"}, []string{"b"})
		sink.release(1, 0, errors.New("record rejected")) // b/0 failed; a/0 in flight
		synctest.Wait()
		k.add(s, 3, "c")
		hints.notify(3)
		synctest.Wait()
		require.Len(t, sink.sent(), 2, "nothing sent behind a failed batch")
		sink.setAuto()
		synctest.Wait()
		require.Equal(t, 2, s.pending(), "a/0 deleted; b/0 failed, c/0 after it")
		time.Sleep(cfg.BackoffMax)
		synctest.Wait()
		require.Zero(t, s.pending())
		require.Equal(t, [][]string{{"a/0"}, {"b/0"}, {"b/0", "c/0"}}, sink.sent())
		_, problems := cs.result()
		require.Empty(t, problems)
		stop(t, r)
	})
}

// skiplessStore is a checkedStore whose BatchSkipper reads nothing, as a
// store does when asked to leave out more rows than it can.
type skiplessStore struct{ *checkedStore }

func (skiplessStore) NextBatchExcept(context.Context, int, int, []relay.Message) ([]relay.Message, error) {
	return nil, nil
}

// A store that cannot leave the rows in flight out reads nothing: the
// drainer sends nothing more, and the batch in flight ends the turn as
// without a Pipeliner: a full one is deleted with the next read
// (BatchAdvancer), which is the bucket's next batch.
func TestPipelineStoreCannotSkip(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, cfg := hintedSetup()
		cfg.BatchSize = 2
		sink := &pipeSink{}
		cs := newCheckedStore(s, sink)
		r := start(t, skiplessStore{cs}, sink, cfg)
		synctest.Wait()
		var k keyed
		commitDuring(s, hints, &k, []string{"a", "a"}, []string{"b"})
		require.Len(t, sink.sent(), 1)
		sink.setAuto()
		synctest.Wait()
		require.Zero(t, s.pending())
		require.Equal(t, [][]string{{"a/0", "a/1"}, {"b/0"}}, sink.sent())
		require.Equal(t, 1, s.count("batch"), "b/0 read with a/0-a/1's delete, not afresh")
		require.Equal(t, 1, s.count("advance"))
		deletes, problems := cs.result()
		require.Empty(t, problems)
		require.Equal(t, [][]string{{"a/0", "a/1"}, {"b/0"}}, deletes)
		stop(t, r)
	})
}

// The lease lost while batches are in flight: the acknowledged batch is
// deleted, the waits of the two others end with the lease, and nothing of
// them is deleted or counted against a message; the bucket is not
// published again by this relay.
func TestPipelineLeaseLostMidFlight(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		s, hints, sink, cs, cfg, r := pipeSetup(t, 3, nil)
		var k keyed
		commitDuring(s, hints, &k, []string{"a"}, []string{"b", "c"})
		k.add(s, 3, "d")
		hints.notify(3)
		synctest.Wait()
		require.Len(t, sink.sent(), 3)
		sink.releaseAll(0)
		synctest.Wait()
		require.Equal(t, 3, s.pending())
		require.False(t, sink.waited(1))
		require.False(t, sink.waited(2))

		s.mu.Lock()
		s.renew = func([]relay.Lease) []relay.Lease { // another relay took bucket 3 over
			s.leases[3] = fakeLease{owner: "b", term: s.leases[3].term + 1, expires: time.Now().Add(time.Hour)}
			return nil
		}
		s.mu.Unlock()
		time.Sleep(cfg.LeaseRenewInterval)
		synctest.Wait()
		require.True(t, sink.waited(1), "the waits end with the lease")
		require.True(t, sink.waited(2))
		require.Equal(t, 3, s.pending())
		require.Zero(t, s.count("record"), "a lost lease is not a publish failure")
		require.Len(t, sink.sent(), 3, "the bucket is not published again")
		require.NotContains(t, leasedBuckets(r), 3)
		deletes, problems := cs.result()
		require.Empty(t, problems)
		require.Equal(t, [][]string{{"a/0"}}, deletes)
		stop(t, r)
	})
}

func leasedBuckets(r *relay.Relay) []int {
	var out []int
	for _, l := range r.Leases() {
		out = append(out, l.Bucket)
	}
	return out
}

// A graceful stop with two batches in flight sends nothing more and
// waits for both: their rows are deleted once acknowledged. A stop whose
// context ends first cancels the sends: nothing unacknowledged is
// deleted.
func TestPipelineStop(t *testing.T) {
	t.Parallel()
	t.Run("graceful", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			s, hints, sink, cs, _, r := pipeSetup(t, 2, nil)
			var k keyed
			commitDuring(s, hints, &k, []string{"a"}, []string{"b"})
			stopped := make(chan error, 1)
			go func() { stopped <- r.Stop(context.Background()) }()
			synctest.Wait()
			k.add(s, 3, "c")
			hints.notify(3)
			synctest.Wait()
			sink.releaseAll(1)
			sink.releaseAll(0)
			require.NoError(t, <-stopped)
			require.Len(t, sink.sent(), 2, "nothing sent after the stop")
			require.Equal(t, 1, s.pending(), "c/0 left")
			deletes, problems := cs.result()
			require.Empty(t, problems)
			require.Equal(t, [][]string{{"a/0"}, {"b/0"}}, deletes)
		})
	})
	t.Run("cancelled", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			s, hints, sink, cs, _, r := pipeSetup(t, 2, nil)
			var k keyed
			commitDuring(s, hints, &k, []string{"a"}, []string{"b"})
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			require.ErrorIs(t, r.Stop(ctx), context.DeadlineExceeded)
			synctest.Wait()
			require.True(t, sink.waited(0))
			require.True(t, sink.waited(1))
			require.Equal(t, 2, s.pending())
			require.Zero(t, s.count("record"), "a stop is not a publish failure")
			deletes, problems := cs.result()
			require.Empty(t, problems)
			require.Empty(t, deletes)
		})
	})
}

// Several relays with pipelining drainers share one outbox while writers
// keep adding and hinting, relays join and leave, and the sink completes
// sends out of order in time and fails some in part: a bucket's batches in flight are one
// relay's, order per key holds across relays and sends, only
// acknowledged prefixes are deleted, and everything is delivered.
func TestPipelineRelaysRace(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const buckets = 4
		s := newFakeStore(buckets)
		sink := &pipeSink{}
		cs := newCheckedStore(s, sink)
		hints := newFakeHints()
		// The sink acknowledges each send after a delay of its own, so a
		// later send often completes first.
		stopAcking := make(chan struct{})
		var ackers sync.WaitGroup
		ackers.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stopAcking:
					return
				case <-time.After(time.Millisecond):
				}
				sink.mu.Lock()
				var open []*pipeSend
				for _, ps := range sink.sends {
					select {
					case <-ps.done:
					default:
						open = append(open, ps)
					}
				}
				sink.mu.Unlock()
				for j, ps := range open {
					o := pipeOutcome{acked: len(ps.msgs)}
					switch (i + j) % 11 {
					case 0, 3, 6, 9:
					case 1:
						o = pipeOutcome{acked: len(ps.msgs) / 2, err: errors.New("record rejected")}
					default:
						continue
					}
					select {
					case ps.decide <- o:
					default:
					}
				}
			}
		})
		cfgFor := func(id string) relay.Config {
			cfg := config(id)
			cfg.BucketCount = buckets
			cfg.BatchSize = 4
			cfg.Hints = hints
			cfg.PipelineDepth = 3
			cfg.PollInterval = 50 * time.Millisecond
			cfg.LeaseDuration = 2 * time.Second
			cfg.LeaseRenewInterval = 20 * time.Millisecond
			cfg.BackoffMin = time.Millisecond
			cfg.BackoffMax = 10 * time.Millisecond
			return cfg
		}
		var k keyed
		stopWriting := make(chan struct{})
		var writers sync.WaitGroup
		writers.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stopWriting:
					return
				case <-time.After(time.Millisecond):
				}
				b := i % buckets
				k.add(s, b, fmt.Sprintf("k%d-%d", b, i%17), fmt.Sprintf("k%d-%d", b, (i+5)%17))
				hints.notify(b)
			}
		})
		var relays []*relay.Relay
		for i := range 2 {
			cfg := cfgFor(fmt.Sprintf("r%d", i))
			cfg.Parallelism = 1 + i
			relays = append(relays, start(t, cs, relaySink{sink, cfg.RelayID}, cfg))
		}
		for round := range 4 {
			time.Sleep(100 * time.Millisecond)
			i := round % 2
			stop(t, relays[i])
			cfg := cfgFor(fmt.Sprintf("r%d-%d", i, round))
			cfg.Parallelism = 1 + i
			relays[i] = start(t, cs, relaySink{sink, cfg.RelayID}, cfg)
		}
		close(stopWriting)
		writers.Wait()
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, s.pending()) }, time.Minute, 10*time.Millisecond)
		for _, r := range relays {
			stop(t, r)
		}
		close(stopAcking)
		ackers.Wait()
		_, problems := cs.result()
		require.Empty(t, problems)
		require.Empty(t, sink.inOrder())
		sink.mu.Lock()
		defer sink.mu.Unlock()
		seen := map[int64]bool{}
		for _, m := range sink.written {
			seen[m.ID] = true
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		require.Len(t, seen, int(s.nextID), "every message delivered")
		pipelined := 0
		for _, ps := range sink.sends {
			for _, e := range ps.before {
				if e.msgs[0].Bucket != ps.msgs[0].Bucket {
					continue
				}
				pipelined++
				require.Equal(t, e.relay, ps.relay, "bucket %d: two relays' batches in flight at once", ps.msgs[0].Bucket)
			}
		}
		require.Positive(t, pipelined, "some sends went behind others of their bucket")
	})
}

// latencySink is a relay.Pipeliner that acknowledges each send lat after
// it was sent, sends overlapping, and records each message's
// commit-to-acknowledgement time (from Message.CreatedAt).
type latencySink struct {
	lat time.Duration
	mu  sync.Mutex
	got []time.Duration
}

func (l *latencySink) Send(ctx context.Context, msgs []relay.Message) func() (int, error) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(l.lat)
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, m := range msgs {
			l.got = append(l.got, time.Since(m.CreatedAt))
		}
	}()
	return func() (int, error) { <-done; return len(msgs), nil }
}

func (l *latencySink) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	return l.Send(ctx, msgs)()
}

// pipelineModel runs, in a synctest bubble, a relay with PipelineDepth
// depth over a latencySink with latency lat, while a writer commits and
// hints a message of a key of its own every millisecond, round robin
// over the 8 buckets, n messages in all. It returns the messages'
// commit-to-acknowledgement times in the bubble's clock, sorted.
func pipelineModel(t *testing.T, depth int, lat time.Duration, n int) []time.Duration {
	sink := &latencySink{lat: lat}
	synctest.Test(t, func(t *testing.T) {
		s, hints, cfg := hintedSetup()
		cfg.PipelineDepth = depth
		r := start(t, skippingStore{advancingStore{s}}, sink, cfg)
		synctest.Wait()
		for i := range n {
			time.Sleep(time.Millisecond)
			s.insert([]relay.Message{{Bucket: i % 8, Topic: "t", Key: fmt.Appendf(nil, "k%d", i), CreatedAt: time.Now()}})
			hints.notify(i % 8)
		}
		time.Sleep(time.Second)
		synctest.Wait()
		require.Zero(t, s.pending())
		stop(t, r)
	})
	require.Len(t, sink.got, n)
	slices.Sort(sink.got)
	return sink.got
}

// In a model of the relay at 1,000 messages per second over 8 buckets
// (a hinted batch per bucket every 8 ms), with a sink that takes 10, 30
// or 50 ms per send, sends overlapping: the commit-to-acknowledgement p99
// (the bubble's clock, no real time) never grows with PipelineDepth, is
// the sink's own latency once the depth covers it (ceil(latency / 8 ms)
// batches), and is that with the default at 30 ms, where PipelineDepth 1
// adds nearly a whole send. The figures are logged:
// go test -run TestPipelineModel -v ./relay.
func TestPipelineModel(t *testing.T) {
	t.Parallel()
	const n = 2000
	for _, lat := range []time.Duration{10 * time.Millisecond, 30 * time.Millisecond, 50 * time.Millisecond} {
		var prev time.Duration
		for _, depth := range []int{1, 2, 3, 4, 6, 8} {
			got := pipelineModel(t, depth, lat, n)
			p99 := got[n*99/100]
			t.Logf("sink %s, PipelineDepth %d: p50 %s, p99 %s, max %s", lat, depth, got[n/2], p99, got[n-1])
			if depth > 1 {
				require.LessOrEqual(t, p99, prev, "sink %s, depth %d", lat, depth)
			}
			if covers := int((lat + 8*time.Millisecond - 1) / (8 * time.Millisecond)); depth >= covers {
				require.Equal(t, lat, p99, "sink %s, depth %d covers it", lat, depth)
			}
			switch {
			case lat == 30*time.Millisecond && depth == 1:
				// A message waits for the batch in flight, then its own:
				// close to two sends at the tail.
				require.GreaterOrEqual(t, p99, lat*3/2)
			case lat == 30*time.Millisecond && depth == relay.PipelineDepthDefault:
				require.Equal(t, lat, p99)
			}
			prev = p99
		}
	}
}
