package gormrelay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// heldPipe is a relay.Pipeliner whose sends wait for the test to decide
// them (decide), or are acknowledged at once once auto is set.
type heldPipe struct {
	mu    sync.Mutex
	sends []*heldSend
	auto  bool
	sent  chan struct{} // a signal per Send
}

type heldSend struct {
	ids    []string // the MessageIDs
	decide chan heldOutcome
}

type heldOutcome struct {
	acked int
	err   error
}

func newHeldPipe() *heldPipe { return &heldPipe{sent: make(chan struct{}, 64)} }

func (p *heldPipe) Send(ctx context.Context, msgs []relay.Message) func() (int, error) {
	s := &heldSend{decide: make(chan heldOutcome, 1)}
	for _, m := range msgs {
		s.ids = append(s.ids, m.MessageID)
	}
	p.mu.Lock()
	p.sends = append(p.sends, s)
	if p.auto {
		s.decide <- heldOutcome{acked: len(msgs)}
	}
	p.mu.Unlock()
	p.sent <- struct{}{}
	return func() (int, error) {
		select {
		case o := <-s.decide:
			return o.acked, o.err
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
	}
}

func (p *heldPipe) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	return p.Send(ctx, msgs)()
}

// next waits for the next Send and returns its MessageIDs.
func (p *heldPipe) next(t *testing.T) []string {
	t.Helper()
	select {
	case <-p.sent:
	case <-time.After(deliverWithin):
		t.Fatal("no send")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sends[len(p.sends)-1].ids
}

func (p *heldPipe) decide(i int, o heldOutcome) {
	p.mu.Lock()
	s := p.sends[i]
	p.mu.Unlock()
	s.decide <- o
}

// setAuto acknowledges every later send at once.
func (p *heldPipe) setAuto() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.auto = true
}

// deleteLog is a GORM store that records the MessageIDs of every delete
// it is asked for, in order.
type deleteLog struct {
	*gormrelay.Store
	mu      sync.Mutex
	deletes [][]string
}

func (d *deleteLog) note(msgs []relay.Message) {
	var ids []string
	for _, m := range msgs {
		ids = append(ids, m.MessageID)
	}
	d.mu.Lock()
	d.deletes = append(d.deletes, ids)
	d.mu.Unlock()
}

func (d *deleteLog) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	d.note(msgs)
	return d.Store.MarkPublished(ctx, id, l, msgs)
}

func (d *deleteLog) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	d.note(msgs)
	return d.Store.MarkPublishedNext(ctx, id, l, msgs, limit)
}

func (d *deleteLog) list() [][]string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([][]string(nil), d.deletes...)
}

// pipeRun starts a relay with a pipelining publisher on the real store,
// with a row of key a in bucket 2, and returns once that row was sent.
// Then it commits a row of key b to the bucket, which the relay's
// discovery finds while the first row is unacknowledged, and returns
// once that row was sent too.
func pipeRun(t *testing.T, db *dbtest.DB) (*storeBundle, *heldPipe, *deleteLog) {
	b := newStoreBundle(t, db, outbox.Config{})
	b.insert(t, outbox.MessageRow{MessageID: "first", Key: []byte(prefixedKeyInBucket(t, "a", 2, 8)), Value: []byte("a/0")})
	pipe := newHeldPipe()
	dl := &deleteLog{Store: b.store}
	cfg := fastConfig(t, "a")
	// The test holds the first batch unacknowledged: a lease that lapsed
	// while a busy machine held back the renewals would end it (its wait
	// returns with the publish's context) and send its row again with the
	// second. A minute's lease outlasts such stalls.
	cfg.LeaseDuration = time.Minute
	startRelay(t, dl, pipe, cfg)
	require.Equal(t, []string{"first"}, pipe.next(t))
	b.insert(t, outbox.MessageRow{MessageID: "second", Key: []byte(prefixedKeyInBucket(t, "b", 2, 8)), Value: []byte("b/0")})
	require.Equal(t, []string{"second"}, pipe.next(t), "the second row sent while the first is unacknowledged")
	t.Cleanup(pipe.setAuto)
	return b, pipe, dl
}

// On every database: a bucket's second row is sent while its first is
// unacknowledged; acknowledged first, it is deleted only after the first
// row was acknowledged and deleted.
func TestRelayPipelinesBucket(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b, pipe, dl := pipeRun(t, db)
		pipe.decide(1, heldOutcome{acked: 1})
		require.EqualValues(t, 2, b.count(t))
		pipe.decide(0, heldOutcome{acked: 1})
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Zero(c, b.count(c), "rows left in the outbox table")
		}, deliverWithin, 5*time.Millisecond)
		require.Equal(t, [][]string{{"first"}, {"second"}}, dl.list())
	})
}

// On every database: the first row fails while the second, acknowledged,
// is in flight behind it: the second row is not deleted, and both are
// published again, in order, after the backoff.
func TestRelayPipelinedFailureKeepsLaterRows(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b, pipe, dl := pipeRun(t, db)
		pipe.decide(1, heldOutcome{acked: 1})
		pipe.setAuto()
		pipe.decide(0, heldOutcome{err: errors.New("record rejected")})
		require.Equal(t, []string{"first", "second"}, pipe.next(t), "both again, from the head of the bucket")
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.Zero(c, b.count(c), "rows left in the outbox table")
		}, deliverWithin, 5*time.Millisecond)
		require.Equal(t, [][]string{{"first", "second"}}, dl.list(), "nothing deleted before the retry")
	})
}
