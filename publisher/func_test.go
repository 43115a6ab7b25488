package publisher_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// memorySink is an in-process sink for the Func publisher.
type memorySink struct {
	mu   sync.Mutex
	msgs []relay.Message
}

var errRejected = errors.New("rejected by the sink")

func (s *memorySink) deliver(_ context.Context, m relay.Message) error {
	for _, h := range m.Headers {
		if h.Key == "reject" {
			return relay.Permanent(errRejected)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.msgs = append(s.msgs, m)
	return nil
}

func (s *memorySink) read(t *testing.T, n int) []relay.Message {
	t.Helper()
	// Func delivers synchronously: by the time Publish returned, the sink
	// holds everything it ever will.
	s.mu.Lock()
	defer s.mu.Unlock()
	require.GreaterOrEqual(t, len(s.msgs), n, "sink holds too few messages")
	return append([]relay.Message(nil), s.msgs...)
}

func TestFuncConformance(t *testing.T) {
	t.Parallel()
	publishertest.Run(t, func(t *testing.T) *publishertest.Sink {
		sink := &memorySink{}
		return &publishertest.Sink{
			Publisher: publisher.Func(sink.deliver),
			Topic:     "memory",
			Read:      sink.read,
			Reject: func(m *relay.Message) {
				m.Headers = append(m.Headers, relay.Header{Key: "reject"})
			},
		}
	})
}

func TestFuncStopsAtFirstError(t *testing.T) {
	t.Parallel()
	transient := errors.New("503")
	var calls []string
	f := publisher.Func(func(_ context.Context, m relay.Message) error {
		calls = append(calls, m.MessageID)
		if m.MessageID == "m-002" {
			return transient
		}
		return nil
	})
	msgs := publishertest.Messages("t", "m", 5)
	acked, err := f.Publish(context.Background(), msgs)
	require.Equal(t, 2, acked)
	require.ErrorIs(t, err, transient)
	require.False(t, relay.IsPermanent(err), "Func passes the error's class through")
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.Equal(t, 2, perr.Index)
	require.Equal(t, "m-002", perr.MessageID)
	require.Equal(t, []string{"m-000", "m-001", "m-002"}, calls, "nothing after the failed message is attempted")
}

func TestFuncContextCancelledMidBatch(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	f := publisher.Func(func(_ context.Context, m relay.Message) error {
		n++
		if n == 3 {
			cancel() // the sink accepted this one, then the caller gave up
		}
		return nil
	})
	acked, err := f.Publish(ctx, publishertest.Messages("t", "m", 10))
	require.Equal(t, 3, acked)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 3, n)
}
