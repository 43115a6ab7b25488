package publisher_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// fastFranz keeps retries and timeouts short so fault tests stay fast.
var fastFranz = []kgo.Opt{
	kgo.ClientID("outbox-publisher-test"),
	kgo.RetryBackoffFn(func(int) time.Duration { return 10 * time.Millisecond }),
	kgo.RecordRetries(10),
	kgo.DialTimeout(3 * time.Second),
	kgo.ProduceRequestTimeout(3 * time.Second),
}

// newFranz returns a started Franz publisher on c, closed when the test
// ends.
func newFranz(t testing.TB, c *kafkatest.Cluster, mods ...func(*publisher.FranzConfig)) *publisher.Franz {
	t.Helper()
	cfg := publisher.FranzConfig{Brokers: c.Brokers(), Options: fastFranz, Logger: slog.New(slog.DiscardHandler)}
	for _, mod := range mods {
		mod(&cfg)
	}
	f, err := publisher.NewFranz(cfg)
	require.NoError(t, err)
	require.NoError(t, f.Start(testCtx(t)))
	t.Cleanup(func() { require.NoError(t, f.Close()) })
	return f
}

func TestFranzConformance(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	runConformance(t, c, func(t *testing.T) relay.Publisher { return newFranz(t, c) })
}

// The Franz publisher writes what the Kafka publisher writes: the same
// partition for every key (an empty key included) and pinned message,
// the same key, value and headers (the message id last, none for an
// empty MessageID).
func TestFranzWritesWhatKafkaWrites(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	ctx := testCtx(t)
	const partitions = 7
	build := func(topic string) []relay.Message {
		var msgs []relay.Message
		for i := range 200 {
			m := relay.Message{MessageID: fmt.Sprintf("id-%03d", i), Topic: topic, Key: fmt.Appendf(nil, "key-%d", i*7919),
				Value: fmt.Appendf(nil, "v%d", i), Headers: []relay.Header{{Key: "trace", Value: fmt.Appendf(nil, "t%d", i)}, {Key: "empty"}}}
			switch i % 10 {
			case 1:
				m.Key = []byte{}
			case 2:
				p := int32(i % partitions)
				m.Partition = &p
			case 3:
				m.MessageID = ""
			case 4:
				m.Value = nil
			}
			msgs = append(msgs, m)
		}
		return msgs
	}
	read := func(p relay.Publisher) []kafkatest.Record {
		topic := c.Topic(t, partitions)
		msgs := build(topic)
		acked, err := p.Publish(ctx, msgs)
		require.NoError(t, err)
		require.Equal(t, len(msgs), acked)
		recs := readAll(t, c, topic, len(msgs))
		byValue := map[string]kafkatest.Record{}
		for _, r := range recs {
			r.Topic, r.Offset = "", 0
			byValue[string(r.Value)+"/"+string(r.Headers[0].Value)] = r
		}
		out := make([]kafkatest.Record, 0, len(recs))
		for i := range msgs {
			out = append(out, byValue[string(msgs[i].Value)+"/"+string(msgs[i].Headers[0].Value)])
		}
		return out
	}
	want := read(newKafka(t, c))
	got := read(newFranz(t, c))
	require.Len(t, got, len(want))
	for i := range want {
		w, g := want[i], got[i]
		require.Equal(t, w.Partition, g.Partition, "message %d: partition", i)
		require.Equal(t, w.Key, g.Key, "message %d: key", i)
		require.Equal(t, w.Value, g.Value, "message %d: value", i)
		require.Equal(t, w.Headers, g.Headers, "message %d: headers", i)
	}
}

// A message larger than MaxMessageBytes fails before it is sent, with the
// Kafka publisher's error; the messages after it are not sent. A record
// the broker refuses as too large (the topic's max.message.bytes is
// lower) is a rejected batch, which the relay splits.
func TestFranzTooLarge(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	ctx := testCtx(t)
	topic := c.Topic(t, 1)
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) { cfg.MaxMessageBytes = 10_000 })

	msgs := publishertest.Messages(topic, "big", 5)
	msgs[2].Value = make([]byte, 10_000)
	acked, err := f.Publish(ctx, msgs)
	require.Equal(t, 2, acked)
	var pe *publisher.Error
	require.ErrorAs(t, err, &pe)
	require.Equal(t, 2, pe.Index)
	require.True(t, publisher.IsTooLarge(err))
	require.True(t, relay.IsPermanent(err))
	require.False(t, relay.IsBatchRejected(err))
	require.Equal(t, 10_000, pe.Limit)
	require.Greater(t, pe.Size, 10_000)
	require.Contains(t, err.Error(), "record too large: ")
	require.Equal(t, ids(msgs[:2]), ids(toMessages(t, c.ReadLog(t, topic, 15*time.Second), publisher.MessageIDHeaderDefault)))

	small := c.Topic(t, 1, kafkatest.TopicConfig("max.message.bytes", "2000"))
	msgs = publishertest.Messages(small, "broker", 3)
	msgs[1].Value = make([]byte, 5000)
	_, _ = rand.Read(msgs[1].Value)
	acked, err = f.Publish(ctx, msgs)
	// The three travel in one batch, which the broker refuses; with no
	// linger the first can also go out alone, before the others are
	// buffered (a busy machine), and be acknowledged. The large one is
	// never acknowledged, nor anything after it.
	require.LessOrEqual(t, acked, 1, "the large message is refused")
	require.ErrorAs(t, err, &pe)
	require.Equal(t, acked, pe.Index, "the error is the first message not acknowledged")
	require.True(t, publisher.IsTooLarge(err), "%v", err)
	require.True(t, relay.IsPermanent(err))
	require.True(t, relay.IsBatchRejected(err))
	require.ErrorIs(t, err, sarama.ErrMessageSizeTooLarge)
	require.ErrorIs(t, err, kerr.MessageTooLarge)
}

// A topic the cluster does not have fails as the Kafka publisher's does:
// retryable (not permanent, not unavailable), named as unknown.
func TestFranzUnknownTopic(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.InProcess()) // a kfake cluster creates no topic on its own
	f := newFranz(t, c)
	msgs := publishertest.Messages("no-such-topic-franz", "unknown", 2)
	acked, err := f.Publish(testCtx(t), msgs)
	require.Zero(t, acked)
	var pe *publisher.Error
	require.ErrorAs(t, err, &pe)
	require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition)
	require.False(t, relay.IsPermanent(err))
	require.False(t, relay.IsUnavailable(err))
	require.Contains(t, pe.Cause(), "unknown topic")

	invalid := publishertest.Messages("bad topic!", "invalid", 1)
	_, err = f.Publish(testCtx(t), invalid)
	require.ErrorIs(t, err, sarama.ErrInvalidTopic)
	require.True(t, relay.IsPermanent(err))

	topic := c.Topic(t, 2)
	p := int32(5)
	pinned := publishertest.Messages(topic, "pinned", 1)
	pinned[0].Partition = &p
	_, err = f.Publish(testCtx(t), pinned)
	require.ErrorIs(t, err, sarama.ErrInvalidPartition)
	require.True(t, relay.IsPermanent(err))
}

// failProduce makes the broker fail the first produce request of topic
// for good (POLICY_VIOLATION, which the producer does not retry).
func failProduce(fake *kfake.Cluster, topic string, count int) *kfake.FaultHandle {
	return fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.PolicyViolation, Count: count})
}

// A message of a later Send whose key's message of an earlier Send failed
// fails unwritten, even when the earlier failure was already reported by
// the producer before the later Send (and its wait not called): nothing of
// the key is written out of order, although franz-go accepts records
// produced after a failed batch under a new producer epoch.
func TestFranzSendFailsBehindAFailedKey(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker fails a produce request
	topic := c.Topic(t, 1)
	f := newFranz(t, c)
	ctx := testCtx(t)

	failProduce(fake, topic, 1)
	a := publishertest.Messages(topic, "a", 2)
	waitA := f.Send(ctx, a)
	require.Eventually(t, func() bool { return publisher.FranzFailedTails(f) == 1 }, 20*time.Second, time.Millisecond,
		"the producer reports the failed batch")

	b := publishertest.Messages(topic, "b", 2)
	b[1].Key = []byte("other key")
	waitB := f.Send(ctx, b)
	acked, err := waitA()
	require.Zero(t, acked)
	require.ErrorIs(t, err, kerr.PolicyViolation)
	require.True(t, relay.IsPermanent(err))
	acked, err = waitB()
	require.Zero(t, acked)
	require.True(t, relay.IsUnavailable(err), "held behind its key's failure: %v", err)
	require.Contains(t, err.Error(), "held back")

	// Once the failure was waited for, a new Send of the key goes out.
	acked, err = f.Publish(ctx, a)
	require.NoError(t, err)
	require.Equal(t, 2, acked)
	got := ids(toMessages(t, c.ReadLog(t, topic, 15*time.Second), publisher.MessageIDHeaderDefault))
	require.Equal(t, []string{b[1].MessageID, a[0].MessageID, a[1].MessageID}, got,
		"b's message of the failed key is not written; its other key is")
}

// Sends overlap, each with one message per key, while the broker fails
// produce requests now and then: for every key, the log holds its
// messages in Send order, and none of a Send made after a message of the
// key failed in an earlier Send and before that Send's wait returned.
func TestFranzOverlappingSendsKeepKeyOrderUnderFaults(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker fails produce requests
	topic := c.Topic(t, 3)
	f := newFranz(t, c)
	ctx := testCtx(t)

	var n atomic.Int64
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.PolicyViolation, Count: -1,
		When: func(kmsg.Request) bool { return n.Add(1)%4 == 0 }})

	// Sends overlap as the relay's pipeline has them: up to window Sends
	// are in flight, the oldest one's wait returns before the next Send,
	// and after a failure every Send in flight is waited for first.
	const sends, keys, window = 60, 12, 4
	msgsOf := make([][]relay.Message, sends)
	waits := make([]func() (int, error), sends)
	type failure struct{ send, issued int } // issued: Sends made when its wait returned
	failedAt := map[string][]failure{}      // key → its failures
	acks, next, issued := 0, 0, 0           // next: the oldest Send not waited for
	collect := func() bool {
		s := next
		next++
		acked, err := waits[s]()
		acks += acked
		if err == nil {
			return true
		}
		var pe *publisher.Error
		require.ErrorAs(t, err, &pe, "send %d", s)
		key := string(msgsOf[s][pe.Index].Key)
		failedAt[key] = append(failedAt[key], failure{s, issued})
		return false
	}
	for s := range sends {
		if s-next >= window && !collect() {
			for next < s {
				collect()
			}
		}
		msgs := make([]relay.Message, keys)
		for k := range keys {
			msgs[k] = relay.Message{MessageID: fmt.Sprintf("s%02d-k%02d", s, k), Topic: topic,
				Key: fmt.Appendf(nil, "key-%d", k), Value: fmt.Appendf(nil, "%d", s)}
		}
		msgsOf[s], waits[s] = msgs, f.Send(ctx, msgs)
		issued++
	}
	for next < sends {
		collect()
	}
	t.Logf("%d of %d messages acknowledged; %d produce requests", acks, sends*keys, n.Load())
	require.NotEmpty(t, failedAt, "the broker failed some produce requests")

	last := map[string]int{}
	for _, r := range c.ReadLog(t, topic, 15*time.Second) {
		var s int
		_, err := fmt.Sscanf(string(r.Value), "%d", &s)
		require.NoError(t, err)
		key := string(r.Key)
		if prev, ok := last[key]; ok {
			require.Greater(t, s, prev, "%s: send %d written after send %d", key, s, prev)
		}
		last[key] = s
		for _, fl := range failedAt[key] {
			require.False(t, s > fl.send && s < fl.issued,
				"%s: send %d, made before the wait of send %d returned its failure, written", key, s, fl.send)
		}
	}
}

// ProbeSink fails while no broker answers, though the publisher's client
// holds connections from before, and succeeds once one answers again;
// publishes do not go through meanwhile and do afterwards.
// TestFranzProbesWhileItPublishes probes the brokers from several
// goroutines while the publisher publishes: every probe builds a client
// from the publisher's options, as a replacement does, and franz-go
// writes to an option's slice while building one, so the builds must not
// overlap (run with -race).
func TestFranzProbesWhileItPublishes(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) {
		cfg.Options = append(slices.Clip(fastFranz), kgo.ProducerBatchCompression(kgo.NoCompression()))
	})
	ctx := testCtx(t)
	var wg sync.WaitGroup
	probes := make(chan error, 20)
	for range 4 {
		wg.Go(func() {
			for range 5 {
				probes <- f.ProbeSink(ctx)
			}
		})
	}
	n, err := f.Publish(ctx, publishertest.Messages(topic, "k", 10))
	wg.Wait()
	close(probes)
	require.NoError(t, err)
	require.Equal(t, 10, n)
	for err := range probes {
		require.NoError(t, err)
	}
}

func TestFranzProbeSinkSeesTheBrokersGoAndReturn(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker drops every request on demand
	topic := c.Topic(t, 1)
	down := outage(fake)
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) {
		cfg.Options = append(fastFranz, kgo.RecordRetries(2), kgo.RequestRetries(1))
	})
	ctx := testCtx(t)
	n, err := f.Publish(ctx, publishertest.Messages(topic, "before", 3))
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.NoError(t, f.ProbeSink(ctx))
	require.NoError(t, publisher.TracingPublisher(f, nil).(relay.SinkProber).ProbeSink(ctx))

	down.Store(true)
	// The request goes out and its answer is lost: an idempotent producer
	// waits for the record's outcome (the relay bounds a publish by its
	// PublishTimeout).
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = f.Publish(short, publishertest.Messages(topic, "during", 1))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Error(t, f.ProbeSink(ctx))
	require.NoError(t, f.CheckReady(ctx), "CheckReady reads local state only")

	down.Store(false)
	require.NoError(t, f.ProbeSink(ctx))
	after := publishertest.Messages(topic, "after", 3)
	n, err = f.Publish(ctx, after)
	require.NoError(t, err)
	require.Equal(t, 3, n)
}

// Stop with Sends in flight, some of their messages held behind an
// earlier Send's message of their key: Stop refuses new Sends at once,
// then produces the held messages and flushes everything before it
// returns; every wait gets its full answer, and the log holds each key in
// order.
func TestFranzStopWithSendsInFlight(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce request
	topic := c.Topic(t, 2)
	f, err := publisher.NewFranz(publisher.FranzConfig{Brokers: c.Brokers(), Options: fastFranz})
	require.NoError(t, err)
	require.NoError(t, f.Start(t.Context()))
	held, release := holdProduce(fake)
	ctx := testCtx(t)

	var sends [][]relay.Message
	var waits []func() (int, error)
	for s := range 5 {
		msgs := publishertest.Messages(topic, fmt.Sprintf("s%d", s), 20)
		sends, waits = append(sends, msgs), append(waits, f.Send(ctx, msgs))
		if s == 0 {
			<-held
		}
	}
	stopped := make(chan error, 1)
	go func() { stopped <- f.Stop(ctx) }()
	require.Eventually(t, func() bool { return f.CheckReady(ctx) != nil }, 10*time.Second, time.Millisecond)
	_, err = f.Publish(ctx, publishertest.Messages(topic, "late", 1))
	require.ErrorIs(t, err, publisher.ErrClosed, "Stop refuses new batches at once")
	require.True(t, relay.IsUnavailable(err))
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned before the held request was answered: %v", err)
	default:
	}
	close(release)
	require.NoError(t, <-stopped)
	var want []string
	for s, wait := range waits {
		acked, err := wait()
		require.NoError(t, err, "send %d", s)
		require.Equal(t, len(sends[s]), acked)
		want = append(want, ids(sends[s])...)
	}
	got := ids(toMessages(t, c.ReadLog(t, topic, 15*time.Second), publisher.MessageIDHeaderDefault))
	require.Equal(t, want, got)
	var me *relay.MisconfigurationError
	require.ErrorAs(t, f.CheckReady(ctx), &me)
	require.ErrorIs(t, f.CheckReady(ctx), publisher.ErrClosed)
	require.ErrorIs(t, f.Start(ctx), publisher.ErrStopped)
}

func TestFranzNotStarted(t *testing.T) {
	t.Parallel()
	f, err := publisher.NewFranz(publisher.FranzConfig{Brokers: []string{"127.0.0.1:1"}})
	require.NoError(t, err)
	_, err = f.Publish(t.Context(), publishertest.Messages("t", "x", 1))
	require.ErrorIs(t, err, publisher.ErrNotStarted)
	require.True(t, relay.IsMisconfiguration(err))
	require.ErrorIs(t, f.CheckReady(t.Context()), publisher.ErrNotStarted)
	require.Error(t, f.ProbeSink(t.Context()), "no broker answers")
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	require.Error(t, f.Start(ctx), "no broker answers")
	require.NoError(t, f.Stop(t.Context()))
}

// spanCount counts the spans a tracer provider started and ended.
type spanCount struct {
	embedded.TracerProvider
	started, ended *atomic.Int32
}

func (p spanCount) Tracer(string, ...trace.TracerOption) trace.Tracer { return spanCountTracer{p: p} }

type spanCountTracer struct {
	embedded.Tracer
	p spanCount
}

func (t spanCountTracer) Start(ctx context.Context, _ string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	t.p.started.Add(1)
	return ctx, countedSpan{Span: trace.SpanFromContext(context.Background()), ended: t.p.ended}
}

type countedSpan struct {
	trace.Span
	ended *atomic.Int32
}

func (s countedSpan) End(...trace.SpanEndOption) { s.ended.Add(1) }

// TracingPublisher keeps Franz's Send: the span runs from Send to the end
// of its wait.
func TestFranzTracingKeepsSend(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	tp := spanCount{started: new(atomic.Int32), ended: new(atomic.Int32)}
	p, ok := publisher.TracingPublisher(newFranz(t, c), tp).(relay.Pipeliner)
	require.True(t, ok, "the wrapped Franz still sends")
	wait := p.Send(testCtx(t), publishertest.Messages(topic, "traced", 3))
	require.Equal(t, int32(1), tp.started.Load())
	acked, err := wait()
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	require.Equal(t, int32(1), tp.ended.Load())
}

// Several goroutines (the relay's drainers, one bucket each) pipeline
// Sends at once, up to four in flight each, their keys sharing the
// topic's partitions: everything is acknowledged, and each key's log is
// in Send order. Run with -race.
func TestFranzConcurrentPipelines(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 4)
	f := newFranz(t, c)
	ctx := testCtx(t)

	const drainers, sends, perSend, keys, window = 6, 25, 20, 5, 4
	var wg sync.WaitGroup
	errs := make(chan error, drainers)
	for d := range drainers {
		wg.Go(func() {
			var waits []func() (int, error)
			wait := func() {
				acked, err := waits[0]()
				waits = waits[1:]
				if err != nil || acked != perSend {
					errs <- fmt.Errorf("drainer %d: acked %d of %d: %v", d, acked, perSend, err)
				}
			}
			for s := range sends {
				if len(waits) == window {
					wait()
				}
				msgs := make([]relay.Message, perSend)
				for i := range msgs {
					msgs[i] = relay.Message{MessageID: fmt.Sprintf("d%d-s%02d-%02d", d, s, i), Topic: topic, Bucket: d,
						Key: fmt.Appendf(nil, "d%d-k%d", d, i%keys), Value: fmt.Appendf(nil, "%d", s*perSend+i)}
				}
				waits = append(waits, f.Send(ctx, msgs))
			}
			for len(waits) > 0 {
				wait()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	recs := readAll(t, c, topic, drainers*sends*perSend)
	require.Len(t, recs, drainers*sends*perSend)
	last := map[string]int{}
	for _, r := range recs {
		var n int
		_, err := fmt.Sscanf(string(r.Value), "%d", &n)
		require.NoError(t, err)
		if prev, ok := last[string(r.Key)]; ok {
			require.Greater(t, n, prev, "key %s out of order", r.Key)
		}
		last[string(r.Key)] = n
	}
}

// A record whose outcome franz-go cannot know (the broker answered
// REQUEST_TIMED_OUT: it may have written it) is never failed by franz-go's
// idempotent producer, neither by its delivery timeout nor its retries:
// while the broker keeps answering so, it is retried without end. After
// StallTimeout without a result the publisher replaces the client: the
// Publish fails unavailable (the relay republishes: a duplicate at
// worst) before its ctx ends, the key is not held behind the lost record,
// and Stop ends within its ctx with such a record in flight.
func TestFranzReplacesAClientStuckOnAnUnknownOutcome(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker answers every produce request with a timeout
	topic := c.Topic(t, 1)
	var stuck atomic.Bool
	var timedOut atomic.Int64 // produce requests answered with a timeout
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.RequestTimedOut, Count: -1,
		When: func(kmsg.Request) bool { return stuck.Load() && timedOut.Add(1) > 0 }})
	observer := &replacedCounter{}
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) {
		cfg.StallTimeout = 300 * time.Millisecond
		cfg.Options = append(slices.Clip(fastFranz), kgo.RecordRetries(2), kgo.RecordDeliveryTimeout(time.Second))
		cfg.Observer = observer
	})
	long, cancel := context.WithTimeout(testCtx(t), time.Minute)
	defer cancel()

	stuck.Store(true)
	a := publishertest.Messages(topic, "a", 2)
	acked, err := f.Publish(long, a)
	require.Zero(t, acked)
	require.NoError(t, long.Err(), "the publish ended on its own, not by its ctx")
	require.True(t, relay.IsUnavailable(err), "%v", err)
	require.False(t, relay.IsPermanent(err))
	require.NotErrorIs(t, err, publisher.ErrClosed, "the publisher is not closed: its client was replaced")
	require.Equal(t, int64(1), f.Replacements())
	require.Equal(t, []string{publisher.ReplaceStalled}, observer.get(), "the Observer is told of the replacement")

	stuck.Store(false)
	acked, err = f.Publish(long, a)
	require.NoError(t, err, "the key is not held behind the record of unknown outcome")
	require.Equal(t, 2, acked)
	got := ids(toMessages(t, c.ReadLog(t, topic, 15*time.Second), publisher.MessageIDHeaderDefault))
	require.Equal(t, ids(a), got[len(got)-2:], "the republished messages are the log's last")

	// Stop with a record of unknown outcome in flight ends within its ctx.
	stuck.Store(true)
	before := timedOut.Load()
	wait := f.Send(long, publishertest.Messages(topic, "b", 1))
	require.Eventually(t, func() bool { return timedOut.Load() > before+1 }, 20*time.Second, time.Millisecond,
		"the broker answered the record's produce request with a timeout, and its retry too")
	err = f.Stop(long)
	require.NoError(t, long.Err(), "Stop ended on its own, not by its ctx")
	require.ErrorContains(t, err, "stall timeout", "the record left without a result is reported")
	_, err = wait()
	require.ErrorIs(t, err, publisher.ErrClosed)
}

// Pipelines of overlapping Sends run on while the broker leaves records
// without an outcome and the publisher replaces its client under them:
// every wait returns on its own (acknowledged or unavailable), a
// pipeline that republishes from its first failure gets everything
// acknowledged, and each key's acknowledged messages are in the log in
// order. Run with -race, it checks the replacement against concurrent
// Sends, reports and releases.
func TestFranzReplacementUnderConcurrentPipelines(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker answers produce requests with a timeout
	topic := c.Topic(t, 3)
	var stuck atomic.Bool
	fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.RequestTimedOut, Count: -1,
		When: func(kmsg.Request) bool { return stuck.Load() }})
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) {
		cfg.StallTimeout = 200 * time.Millisecond
		cfg.Options = append(slices.Clip(fastFranz), kgo.RecordRetries(2), kgo.RecordDeliveryTimeout(time.Second))
	})
	long, cancel := context.WithTimeout(testCtx(t), 2*time.Minute)
	defer cancel()

	const pipelines, window = 4, 3
	var (
		wg          sync.WaitGroup
		done        atomic.Bool    // the stalls are over: the pipelines finish
		acks        atomic.Int64   // batches acknowledged, all pipelines
		unavailable atomic.Int64   // windows that failed unavailable
		final       [pipelines]int // each pipeline's acknowledged batches
	)
	for p := range pipelines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Appendf(nil, "pipeline-%d", p)
			next := 0 // the first batch not acknowledged
			for !done.Load() {
				// Up to window batches in flight; after a failure, the
				// pipeline republishes from the first unacknowledged one.
				waits := make([]func() (int, error), window)
				for i := range waits {
					b := next + i
					waits[i] = f.Send(long, []relay.Message{{MessageID: fmt.Sprintf("p%d-b%04d", p, b), Topic: topic, Key: key, Value: fmt.Appendf(nil, "%d", b)}})
				}
				failed := false
				for _, w := range waits {
					acked, err := w()
					switch {
					case err != nil && !relay.IsUnavailable(err):
						t.Errorf("pipeline %d: batch %d: %v", p, next, err)
						return
					case err != nil:
						failed = true
					case !failed && acked == 1:
						next++
						acks.Add(1)
					}
				}
				if failed {
					unavailable.Add(1)
				}
			}
			final[p] = next
		}()
	}
	for range 3 {
		stuck.Store(true)
		before := f.Replacements()
		require.Eventually(t, func() bool { return f.Replacements() > before }, 30*time.Second, time.Millisecond)
		stuck.Store(false)
		progress := acks.Load()
		require.Eventually(t, func() bool { return acks.Load() > progress+pipelines }, 30*time.Second, time.Millisecond,
			"the pipelines make progress through the new client")
	}
	done.Store(true)
	wg.Wait()
	require.NoError(t, long.Err(), "every wait returned on its own")
	require.Positive(t, unavailable.Load(), "some waits failed at a replacement")

	last := map[string]int{}
	seen := map[string]int{}
	for _, r := range c.ReadLog(t, topic, 15*time.Second) {
		var b int
		_, err := fmt.Sscanf(string(r.Value), "%d", &b)
		require.NoError(t, err)
		key := string(r.Key)
		if prev, ok := last[key]; ok {
			// Next in order, or a republish from an earlier batch on.
			require.LessOrEqual(t, b, prev+1, "%s: batch %d written after batch %d, skipping", key, b, prev)
		} else {
			require.Zero(t, b, "%s: the first batch written", key)
		}
		last[key] = b
		seen[key] = max(seen[key], b)
	}
	for p := range pipelines {
		require.GreaterOrEqual(t, seen[fmt.Sprintf("pipeline-%d", p)], final[p]-1, "pipeline %d: its acknowledged batches are written", p)
	}
}

// A broker removed from the cluster keeps the connections it had; added
// back under its node id and made the partition's leader again, it
// answers on a new listener, while franz-go keeps producing on its old
// connection, to the removed broker, which answers
// NOT_LEADER_FOR_PARTITION naming that same node as the leader: franz-go
// retries there, fails the messages and starts over, for good. A
// partition whose messages keep failing unavailable with none
// acknowledged for StallTimeout gets the client replaced (as the Kafka
// publisher replaces a producer whose publishes all fail); the new client
// connects afresh and the messages go through.
func TestFranzReplacesAClientWhosePartitionKeepsFailing(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.NumBrokers(2))
	fake := c.RequireFake(t) // kfake only: a broker is removed and added back
	topic := c.Topic(t, 1)
	require.NoError(t, fake.MoveTopicPartition(topic, 0, 0))
	f := newFranz(t, c, func(cfg *publisher.FranzConfig) {
		cfg.StallTimeout = 3 * time.Second
		cfg.Options = append(slices.Clip(fastFranz), kgo.RecordRetries(2))
	})
	ctx := testCtx(t)
	acked, err := f.Publish(ctx, publishertest.Messages(topic, "before", 1))
	require.NoError(t, err)
	require.Equal(t, 1, acked)

	readdFirstNode(t, fake, topic)

	msgs := publishertest.Messages(topic, "after", 2)
	start := time.Now()
	var failures int
	require.Eventually(t, func() bool {
		acked, err := f.Publish(ctx, msgs)
		if err == nil {
			require.Equal(t, 2, acked)
			return true
		}
		failures++
		require.True(t, relay.IsUnavailable(err), "%v", err)
		if f.Replacements() == 0 {
			require.ErrorIs(t, err, kerr.NotLeaderForPartition, "franz-go reports the failure: the publish is not stalled")
		}
		return false
	}, time.Minute, 10*time.Millisecond, "the messages go through")
	require.Equal(t, int64(1), f.Replacements())
	t.Logf("%d failed publishes, then a replacement; through after %s", failures, time.Since(start).Round(time.Millisecond))
}
