// Package publishertest is the conformance suite for the publishers of
// package publisher: every implementation of relay.Publisher there runs Run
// against its own sink, so they all keep the same prefix contract.
//
// What the suite pins down:
//   - an empty batch is acknowledged as 0 with no error;
//   - a fully delivered batch returns len(msgs) and nil, and the sink holds
//     the messages in batch order with key, value and headers intact (nil
//     and empty keys and values told apart);
//   - when a message fails, Publish returns exactly the number of messages
//     before it and a *publisher.Error naming it, and the sink holds that
//     prefix; republishing the rest (what the relay does) delivers it, in
//     order, after whatever the sink already holds;
//   - a context cancelled before Publish delivers nothing and returns
//     ctx.Err();
//   - consecutive batches stay in order.
//
// What it leaves to each implementation's own tests: what the sink holds
// beyond the acknowledged prefix after a failure (the Kafka publisher may
// have written later messages that were in flight), placement, and faults.
package publishertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Sink is one fresh publisher and the sink it writes to.
type Sink struct {
	// Publisher is the publisher under test.
	Publisher relay.Publisher
	// Topic is the topic messages carry; the sink starts out empty.
	Topic string
	// Read waits until the sink holds at least n messages, failing the test
	// after a timeout, and returns everything it holds in the order it
	// holds it, with MessageID, Key, Value and Headers as delivered (the
	// Kafka sink strips its message id header back into MessageID).
	Read func(t *testing.T, n int) []relay.Message
	// Reject changes msg so that the sink rejects it with a permanent
	// error.
	Reject func(msg *relay.Message)
}

// Run runs the suite. newSink is called once per subtest; it registers its
// own cleanup. Subtests run in parallel.
func Run(t *testing.T, newSink func(t *testing.T) *Sink) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(t *testing.T, s *Sink)
	}{
		{"EmptyBatch", testEmptyBatch},
		{"DeliversInOrder", testDeliversInOrder},
		{"FieldsIntact", testFieldsIntact},
		{"PrefixOnFailure", testPrefixOnFailure},
		{"FirstMessageFails", testFirstMessageFails},
		{"RepublishAfterFailure", testRepublishAfterFailure},
		{"CancelledContext", testCancelledContext},
		{"ConsecutiveBatches", testConsecutiveBatches},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.fn(t, newSink(t))
		})
	}
}

// Messages builds n messages for topic with one shared key (so a
// partitioned sink keeps them in one order), distinct ids and values, and
// a header.
func Messages(topic, prefix string, n int) []relay.Message {
	msgs := make([]relay.Message, n)
	for i := range msgs {
		msgs[i] = relay.Message{
			ID:        int64(i + 1),
			MessageID: fmt.Sprintf("%s-%03d", prefix, i),
			Topic:     topic,
			Key:       []byte("conformance-key"),
			Value:     fmt.Appendf(nil, "%s value %d", prefix, i),
			Headers:   []relay.Header{{Key: "seq", Value: fmt.Appendf(nil, "%d", i)}},
			CreatedAt: time.Now(),
		}
	}
	return msgs
}

// RequireSame fails t unless got holds want's messages in order, comparing
// MessageID, Key, Value and Headers, nil and empty told apart.
func RequireSame(t testing.TB, want, got []relay.Message) {
	t.Helper()
	require.Len(t, got, len(want), "message count")
	for i := range want {
		w, g := want[i], got[i]
		require.Equal(t, w.MessageID, g.MessageID, "message %d: MessageID", i)
		requireBytes(t, w.Key, g.Key, "message %d (%s): Key", i, w.MessageID)
		requireBytes(t, w.Value, g.Value, "message %d (%s): Value", i, w.MessageID)
		require.Len(t, g.Headers, len(w.Headers), "message %d (%s): headers", i, w.MessageID)
		for j := range w.Headers {
			require.Equal(t, w.Headers[j].Key, g.Headers[j].Key, "message %d (%s): header %d key", i, w.MessageID, j)
			requireBytes(t, w.Headers[j].Value, g.Headers[j].Value, "message %d (%s): header %d value", i, w.MessageID, j)
		}
	}
}

func requireBytes(t testing.TB, want, got []byte, format string, args ...any) {
	t.Helper()
	what := fmt.Sprintf(format, args...)
	require.Equal(t, want == nil, got == nil, "%s: want nil=%v, got nil=%v", what, want == nil, got == nil)
	require.True(t, bytes.Equal(want, got), "%s: want %q, got %q", what, want, got)
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func publishAll(t *testing.T, s *Sink, msgs []relay.Message) {
	t.Helper()
	acked, err := s.Publisher.Publish(ctx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)
}

func testEmptyBatch(t *testing.T, s *Sink) {
	acked, err := s.Publisher.Publish(ctx(t), nil)
	require.NoError(t, err)
	require.Zero(t, acked)
	acked, err = s.Publisher.Publish(ctx(t), []relay.Message{})
	require.NoError(t, err)
	require.Zero(t, acked)
}

func testDeliversInOrder(t *testing.T, s *Sink) {
	msgs := Messages(s.Topic, "order", 50)
	publishAll(t, s, msgs)
	RequireSame(t, msgs, s.Read(t, len(msgs)))
}

func testFieldsIntact(t *testing.T, s *Sink) {
	msgs := Messages(s.Topic, "fields", 6)
	msgs[0].Key = nil                 // keyless
	msgs[1].Key = []byte{}            // empty key is a real key
	msgs[2].Value = nil               // tombstone
	msgs[3].Value = []byte{}          // empty value
	msgs[4].Headers = nil             // no headers
	msgs[5].Headers = []relay.Header{ // repeated names, order kept
		{Key: "b", Value: []byte("1")}, {Key: "a", Value: []byte("2")},
		{Key: "b", Value: []byte("3")}, {Key: "empty", Value: []byte{}},
	}
	publishAll(t, s, msgs)
	RequireSame(t, msgs, s.Read(t, len(msgs)))
}

// requireFailedAt checks the result of a batch whose message k failed.
func requireFailedAt(t *testing.T, msgs []relay.Message, k, acked int, err error) {
	t.Helper()
	require.Equal(t, k, acked, "acked is exactly the prefix before the failed message")
	require.Error(t, err)
	var perr *publisher.Error
	require.True(t, errors.As(err, &perr), "error is a *publisher.Error: %v", err)
	require.Equal(t, k, perr.Index)
	require.Equal(t, msgs[k].MessageID, perr.MessageID)
	require.Equal(t, msgs[k].Topic, perr.Topic)
	require.True(t, relay.IsPermanent(err), "a rejected message is a permanent failure: %v", err)
}

func testPrefixOnFailure(t *testing.T, s *Sink) {
	msgs := Messages(s.Topic, "prefix", 10)
	s.Reject(&msgs[4])
	acked, err := s.Publisher.Publish(ctx(t), msgs)
	requireFailedAt(t, msgs, 4, acked, err)
	got := s.Read(t, 4)
	RequireSame(t, msgs[:4], got[:4])
	for _, g := range got {
		require.NotEqual(t, msgs[4].MessageID, g.MessageID, "the rejected message is not in the sink")
	}
}

func testFirstMessageFails(t *testing.T, s *Sink) {
	msgs := Messages(s.Topic, "first", 3)
	s.Reject(&msgs[0])
	acked, err := s.Publisher.Publish(ctx(t), msgs)
	requireFailedAt(t, msgs, 0, acked, err)
}

func testRepublishAfterFailure(t *testing.T, s *Sink) {
	msgs := Messages(s.Topic, "republish", 8)
	fixed := msgs[3]
	s.Reject(&msgs[3])
	acked, err := s.Publisher.Publish(ctx(t), msgs)
	requireFailedAt(t, msgs, 3, acked, err)

	// The relay deletes the acknowledged prefix and publishes the rest
	// again; here the rejected message was fixed in the meantime.
	msgs[3] = fixed
	rest := msgs[acked:]
	publishAll(t, s, rest)

	got := s.Read(t, len(msgs))
	require.GreaterOrEqual(t, len(got), len(msgs))
	RequireSame(t, msgs[:acked], got[:acked])
	RequireSame(t, rest, got[len(got)-len(rest):])
}

func testCancelledContext(t *testing.T, s *Sink) {
	c, cancel := context.WithCancel(context.Background())
	cancel()
	acked, err := s.Publisher.Publish(c, Messages(s.Topic, "cancelled", 5))
	require.ErrorIs(t, err, context.Canceled)
	require.Zero(t, acked)

	// Nothing of the cancelled batch reached the sink: a later marker is
	// the only message there.
	marker := Messages(s.Topic, "marker", 1)
	publishAll(t, s, marker)
	RequireSame(t, marker, s.Read(t, 1))
}

func testConsecutiveBatches(t *testing.T, s *Sink) {
	var all []relay.Message
	for b := range 4 {
		msgs := Messages(s.Topic, fmt.Sprintf("batch%d", b), 5+b)
		publishAll(t, s, msgs)
		all = append(all, msgs...)
	}
	RequireSame(t, all, s.Read(t, len(all)))
}
