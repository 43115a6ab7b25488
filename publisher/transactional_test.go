package publisher_test

import (
	"context"
	"errors"
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
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// newTransactional returns a started strict-mode publisher on c, closed
// when the test ends. Publishers of one test share the prefix unless a mod changes
// it.
func newTransactional(t testing.TB, c *kafkatest.Cluster, mods ...func(*publisher.TransactionalConfig)) *publisher.Transactional {
	t.Helper()
	cfg := publisher.TransactionalConfig{
		Brokers:               c.Brokers(),
		TransactionalIDPrefix: txnPrefix(t),
		Configure:             fastConfig,
		Logger:                slog.New(slog.DiscardHandler),
	}
	for _, mod := range mods {
		mod(&cfg)
	}
	return publishertest.StartTransactional(t, cfg)
}

// txnPrefix is a transactional id prefix unique to the test, so that tests
// on a shared real cluster never fence each other.
func txnPrefix(t testing.TB) string {
	return fmt.Sprintf("outbox-test-%s-%d-", t.Name(), time.Now().UnixNano())
}

// readCommitted returns everything a read_committed consumer sees of
// topic now.
func readCommitted(t testing.TB, c *kafkatest.Cluster, topic string) []relay.Message {
	t.Helper()
	return toMessages(t, c.ReadLog(t, topic, 15*time.Second, kafkatest.ReadCommitted()), publisher.MessageIDHeaderDefault)
}

// readUncommitted returns everything a read_uncommitted consumer sees of
// topic now: records of aborted transactions included.
func readUncommitted(t testing.TB, c *kafkatest.Cluster, topic string) []relay.Message {
	t.Helper()
	return toMessages(t, c.ReadLog(t, topic, 15*time.Second), publisher.MessageIDHeaderDefault)
}

func inBucket(msgs []relay.Message, bucket int) []relay.Message {
	for i := range msgs {
		msgs[i].Bucket = bucket
	}
	return msgs
}

func TestTransactionalCommits(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	prefix := txnPrefix(t)
	tx := newTransactional(t, c, func(cfg *publisher.TransactionalConfig) { cfg.TransactionalIDPrefix = prefix })
	require.Equal(t, prefix+"2", tx.TransactionalID(2))

	var all []relay.Message
	for b := range 3 {
		msgs := inBucket(publishertest.Messages(topic, fmt.Sprintf("batch%d", b), 40+b), 2)
		acked, err := tx.Publish(testCtx(t), msgs)
		require.NoError(t, err)
		require.Equal(t, len(msgs), acked)
		all = append(all, msgs...)
	}
	fields := inBucket(publishertest.Messages(topic, "fields", 6), 2)
	fields[0].Key = nil
	fields[1].Key = []byte{}
	fields[2].Value = nil
	fields[3].Value = []byte{}
	fields[4].Headers = nil
	fields[5].Headers = []relay.Header{{Key: "b", Value: []byte("1")}, {Key: "b", Value: []byte{}}}
	acked, err := tx.Publish(testCtx(t), fields)
	require.NoError(t, err)
	require.Equal(t, len(fields), acked)
	all = append(all, fields...)

	acked, err = tx.Publish(testCtx(t), nil)
	require.NoError(t, err)
	require.Zero(t, acked)

	publishertest.RequireSame(t, all, readCommitted(t, c, topic))
}

// TestTransactionalPartialFailure is Dekaf's case in strict mode: rows 1, 2
// and 3 share a key and row 1 is too large. The default publisher lets 2
// and 3 reach consumers before 1 (TestKafkaPartialFailure); here the batch
// fails as a whole, before its transaction begins, and names row 1.
func TestTransactionalPartialFailure(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)
	tx := newTransactional(t, c)

	rows := publishertest.Messages(topic, "row", 3)
	rows[0].Value = make([]byte, publisher.MaxMessageBytesDefault+1)
	acked, err := tx.Publish(testCtx(t), rows)
	require.Zero(t, acked)
	require.True(t, publisher.IsTooLarge(err), "%v", err)
	require.True(t, relay.IsPermanent(err), "%v", err)
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.Equal(t, 0, perr.Index)
	require.Equal(t, rows[0].MessageID, perr.MessageID)
	require.Equal(t, publisher.MaxMessageBytesDefault, perr.Limit)
	require.Greater(t, perr.Size, publisher.MaxMessageBytesDefault)
	require.False(t, perr.MaybeWritten)
	require.Empty(t, perr.LaterMaybeWritten, "a failed transaction is aborted: nothing of it is visible")
	require.Regexp(t, `^record too large: 1,000,\d{3} bytes, limit 1,000,000 \(Producer.MaxMessageBytes\); topic `+topic+`; message id "row-000", key "conformance-key"; sink error: `, err.Error())
	i, ok := relay.FailedIndex(err)
	require.True(t, ok)
	require.Zero(t, i)

	// The culprit in the middle: nothing is acknowledged, and the error
	// names it, not the acknowledged count.
	mid := publishertest.Messages(topic, "mid", 3)
	mid[1].Value = make([]byte, publisher.MaxMessageBytesDefault+1)
	acked, err = tx.Publish(testCtx(t), mid)
	require.Zero(t, acked)
	require.ErrorAs(t, err, &perr)
	require.Equal(t, 1, perr.Index)
	i, _ = relay.FailedIndex(err)
	require.Equal(t, 1, i)

	require.Zero(t, c.RecordCount(t, topic), "nothing reached the broker, not even a transaction")

	// Row 1 fixed (same message id): the key arrives in order, once.
	rows[0].Value = []byte("fixed")
	acked, err = tx.Publish(testCtx(t), rows)
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	publishertest.RequireSame(t, rows, readCommitted(t, c, topic))
}

// TestTransactionalBrokerRejectionAborts has the broker reject one
// partition of a transaction (a record over the topic's max.message.bytes,
// below the publisher's own limit, so only the broker can refuse it): the
// records already written to the other partition are aborted, so
// read_committed consumers never see them.
func TestTransactionalBrokerRejectionAborts(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2, kafkatest.TopicConfig("max.message.bytes", "10000"))
	tx := newTransactional(t, c)

	p0, p1 := int32(0), int32(1)
	msgs := publishertest.Messages(topic, "abort", 2)
	msgs[0].Partition, msgs[1].Partition = &p0, &p1
	msgs[1].Value = make([]byte, 20_000)
	acked, err := tx.Publish(testCtx(t), msgs)
	require.Zero(t, acked)
	require.True(t, publisher.IsTooLarge(err), "%v", err)
	var perr *publisher.Error
	require.ErrorAs(t, err, &perr)
	require.Equal(t, 1, perr.Index, "the rejected message is named")

	marker := publishertest.Messages(topic, "marker", 1)
	marker[0].Partition = &p0
	acked, err = tx.Publish(testCtx(t), marker)
	require.NoError(t, err)
	require.Equal(t, 1, acked)

	publishertest.RequireSame(t, marker, readCommitted(t, c, topic))
	// Message 0 was either written (alone, or in the request whose other
	// partition failed) and aborted, visible to read_uncommitted only, or
	// never sent once the transaction had failed: kfake always writes it,
	// Apache Kafka with sarama may not.
	uncommitted := ids(readUncommitted(t, c, topic))
	if len(uncommitted) == 1 {
		require.Equal(t, []string{marker[0].MessageID}, uncommitted)
	} else {
		require.Equal(t, []string{msgs[0].MessageID, marker[0].MessageID}, uncommitted)
	}
}

type publishResult struct {
	acked int
	err   error
}

func publishAsync(ctx context.Context, p relay.Publisher, msgs []relay.Message) <-chan publishResult {
	done := make(chan publishResult, 1)
	go func() {
		acked, err := p.Publish(ctx, msgs)
		done <- publishResult{acked, err}
	}()
	return done
}

// TestTransactionalFencedInFlight holds relay A's transaction at the broker
// while relay B initialises the same transactional id (as the new owner of
// the bucket does) and publishes. The broker aborts A's transaction and
// fences A: A's records never become visible to read_committed consumers,
// whether they were already written (held at commit) or not (held at
// produce), and A's Publish reports the fencing.
func TestTransactionalFencedInFlight(t *testing.T) {
	t.Parallel()
	for _, at := range []kmsg.Key{kmsg.EndTxn, kmsg.Produce} {
		t.Run(at.Name(), func(t *testing.T) {
			t.Parallel()
			c := kafkatest.Start(t)
			fake := c.RequireFake(t) // kfake only: the broker holds A's request; HeldBeforeProduce in strict_test.go runs on Apache Kafka
			topic := c.Topic(t, 1)
			prefix := txnPrefix(t)
			sameID := func(cfg *publisher.TransactionalConfig) { cfg.TransactionalIDPrefix = prefix }
			a := newTransactional(t, c, sameID)
			b := newTransactional(t, c, sameID)
			const bucket = 3

			first := inBucket(publishertest.Messages(topic, "a-first", 5), bucket)
			acked, err := a.Publish(testCtx(t), first)
			require.NoError(t, err)
			require.Equal(t, 5, acked)

			held, release := kafkatest.HoldRequest(fake, at, func(req kmsg.Request) bool {
				if r, ok := req.(*kmsg.EndTxnRequest); ok {
					return r.TransactionalID == a.TransactionalID(bucket) && r.Commit
				}
				return true
			})
			stale := inBucket(publishertest.Messages(topic, "a-stale", 5), bucket)
			aDone := publishAsync(testCtx(t), a, stale)
			<-held

			// The new owner: initialising the transactional id fences A and
			// aborts its open transaction; then it publishes.
			newer := inBucket(publishertest.Messages(topic, "b-newer", 5), bucket)
			acked, err = b.Publish(testCtx(t), newer)
			require.NoError(t, err)
			require.Equal(t, 5, acked)

			close(release)
			r := <-aDone
			require.Zero(t, r.acked)
			require.True(t, relay.IsFenced(r.err), "%v", r.err)
			require.ErrorIs(t, r.err, relay.ErrLeaseLost)
			require.True(t, errors.Is(r.err, sarama.ErrProducerFenced) || errors.Is(r.err, sarama.ErrInvalidProducerEpoch), "%v", r.err)
			require.False(t, relay.IsPermanent(r.err), "fencing is not the messages' fault")

			last := inBucket(publishertest.Messages(topic, "b-last", 2), bucket)
			acked, err = b.Publish(testCtx(t), last)
			require.NoError(t, err)
			require.Equal(t, 2, acked)

			want := slices.Concat(first, newer, last)
			publishertest.RequireSame(t, want, readCommitted(t, c, topic))
			uncommitted := ids(readUncommitted(t, c, topic))
			if at == kmsg.EndTxn {
				// A's records were written before B took over, and aborted.
				require.Equal(t, ids(slices.Concat(first, stale, newer, last)), uncommitted)
			} else {
				// A's produce came after the fencing and was refused.
				require.Equal(t, ids(want), uncommitted)
			}
		})
	}
}

// TestTransactionalAcquireFences shows that the new owner fences the old
// one when it acquires the bucket (LeasesAcquired), before its first
// publish, and that each producer's lifecycle follows the leases.
func TestTransactionalAcquireFences(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	prefix := txnPrefix(t)
	sameID := func(cfg *publisher.TransactionalConfig) { cfg.TransactionalIDPrefix = prefix }
	a := newTransactional(t, c, sameID)
	b := newTransactional(t, c, sameID)
	// On kfake the test also counts InitProducerID requests (an observation
	// only kfake offers); the fencing itself is the broker's, on Apache
	// Kafka as on kfake.
	inits := func(n int, msg string) {}
	if fake := c.Fake(); fake != nil {
		h := fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.InitProducerID}, TxnID: prefix + "1", Observe: true, Count: -1})
		inits = func(n int, msg string) {
			require.NoError(t, h.Wait(testCtx(t), n))
			require.Equal(t, n, h.Hits(), msg)
		}
	}

	require.NoError(t, a.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 1, Term: 1}}))
	inits(1, "acquisition starts the producer")
	acked, err := a.Publish(testCtx(t), inBucket(publishertest.Messages(topic, "a", 3), 1))
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	inits(1, "Publish used the producer started at acquisition")

	require.NoError(t, b.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 1, Term: 2}}))
	inits(2, "the new owner's acquisition initialises the transactional id")
	acked, err = a.Publish(testCtx(t), inBucket(publishertest.Messages(topic, "a-stale", 3), 1))
	require.Zero(t, acked)
	require.True(t, relay.IsFenced(err), "%v", err)
	require.ErrorIs(t, err, relay.ErrLeaseLost)
	require.True(t, errors.Is(err, sarama.ErrProducerFenced) || errors.Is(err, sarama.ErrInvalidProducerEpoch), "%v", err)
	require.False(t, relay.IsPermanent(err), "fencing is not the messages' fault")
	a.LeasesReleased(testCtx(t), []relay.Lease{{Bucket: 1, Term: 1}})

	acked, err = b.Publish(testCtx(t), inBucket(publishertest.Messages(topic, "b", 3), 1))
	require.NoError(t, err)
	require.Equal(t, 3, acked)
	inits(2, "the new owner publishes with the producer it started")
	got := readCommitted(t, c, topic)
	require.Equal(t, ids(slices.Concat(publishertest.Messages(topic, "a", 3), publishertest.Messages(topic, "b", 3))), ids(got))
	require.Equal(t, ids(got), ids(readUncommitted(t, c, topic)), "the stale publish wrote nothing")

	// A released bucket's producer is closed; publishing the bucket again
	// starts a new one (which fences b: the relay never does this without
	// holding the lease).
	b.LeasesReleased(testCtx(t), []relay.Lease{{Bucket: 1, Term: 2}})
	acked, err = b.Publish(testCtx(t), inBucket(publishertest.Messages(topic, "b-again", 1), 1))
	require.NoError(t, err)
	require.Equal(t, 1, acked)
	inits(3, "a released bucket's next publish starts a new producer")
}

// TestTransactionalCancelAborts cancels a Publish whose produce request the
// broker holds: Publish returns at once, the transaction is aborted in the
// background, and the bucket's next Publish waits for that abort.
func TestTransactionalCancelAborts(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker holds the produce request
	topic := c.Topic(t, 1)
	tx := newTransactional(t, c)
	held, release := kafkatest.HoldRequest(fake, kmsg.Produce, func(kmsg.Request) bool { return true })

	cancelled := publishertest.Messages(topic, "cancelled", 10)
	ctx, cancel := context.WithCancel(context.Background())
	done := publishAsync(ctx, tx, cancelled)
	<-held
	cancel()
	r := <-done // returns while the broker still holds the request
	require.Zero(t, r.acked)
	require.ErrorIs(t, r.err, context.Canceled)

	next := publishertest.Messages(topic, "next", 3)
	nextDone := publishAsync(testCtx(t), tx, next)
	close(release)
	r = <-nextDone
	require.NoError(t, r.err)
	require.Equal(t, 3, r.acked)

	publishertest.RequireSame(t, next, readCommitted(t, c, topic))
	// How many cancelled records were handed to the producer before the
	// cancellation is up to timing, at least the held one; they were
	// written and aborted.
	uncommitted := ids(readUncommitted(t, c, topic))
	k := len(uncommitted) - len(next)
	require.GreaterOrEqual(t, k, 1)
	require.Equal(t, ids(slices.Concat(cancelled[:k], next)), uncommitted)
}

func TestTransactionalClose(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	tx, err := publisher.NewTransactional(publisher.TransactionalConfig{
		Brokers: c.Brokers(), TransactionalIDPrefix: txnPrefix(t), Configure: fastConfig,
	})
	require.NoError(t, err)
	require.NoError(t, tx.Start(t.Context()))
	require.NoError(t, tx.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 0}, {Bucket: 1}, {Bucket: 2}}))
	acked, err := tx.Publish(testCtx(t), publishertest.Messages(topic, "before-close", 2))
	require.NoError(t, err)
	require.Equal(t, 2, acked)

	require.NoError(t, tx.Close()) // closes all three producers; goleak checks
	require.NoError(t, tx.Close())
	_, err = tx.Publish(testCtx(t), publishertest.Messages(topic, "late", 1))
	require.ErrorIs(t, err, publisher.ErrClosed)
	require.ErrorIs(t, tx.LeasesAcquired(testCtx(t), []relay.Lease{{Bucket: 0}}), publisher.ErrClosed)
	tx.LeasesReleased(testCtx(t), []relay.Lease{{Bucket: 0}})
}

func TestTransactionalOneBucketPerBatch(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	tx := newTransactional(t, c)
	msgs := publishertest.Messages(topic, "mixed", 2)
	msgs[1].Bucket = 1
	acked, err := tx.Publish(testCtx(t), msgs)
	require.Zero(t, acked)
	require.ErrorContains(t, err, "one bucket")
}

func TestTransactionalConfigEnforced(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	var (
		mu   sync.Mutex
		seen []*sarama.Config
	)
	tx := newTransactional(t, c, func(cfg *publisher.TransactionalConfig) {
		cfg.Configure = func(sc *sarama.Config) error {
			_ = fastConfig(sc)
			// Everything a careless callback could downgrade.
			sc.Producer.RequiredAcks = sarama.NoResponse
			sc.Producer.Idempotent = false
			sc.Net.MaxOpenRequests = 5
			sc.Producer.Retry.Max = 0
			sc.Version = sarama.V0_10_2_0
			sc.Producer.Return.Successes = false
			sc.Producer.MaxMessageBytes = 10
			sc.ClientID = "mine"
			mu.Lock()
			seen = append(seen, sc)
			mu.Unlock()
			return nil
		}
	})
	acked, err := tx.Publish(testCtx(t), inBucket(publishertest.Messages(topic, "cfg", 2), 5))
	require.NoError(t, err)
	require.Equal(t, 2, acked)

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, seen, 2, "Configure runs once at NewTransactional and once per producer")
	sc := seen[1] // the producer's, after enforcement
	require.Equal(t, tx.TransactionalID(5), sc.Producer.Transaction.ID)
	require.Equal(t, sarama.WaitForAll, sc.Producer.RequiredAcks)
	require.True(t, sc.Producer.Idempotent)
	require.Equal(t, 1, sc.Net.MaxOpenRequests)
	require.Equal(t, publisher.RetryMaxDefault, sc.Producer.Retry.Max)
	require.True(t, sc.Version.IsAtLeast(publisher.MinTransactionalKafkaVersion))
	require.True(t, sc.Producer.Return.Successes)
	require.Equal(t, publisher.MaxMessageBytesDefault, sc.Producer.MaxMessageBytes)
	require.Equal(t, "mine", sc.ClientID)
	require.Empty(t, seen[0].Producer.Transaction.ID, "the connectivity check is not transactional")
}

func TestNewTransactionalErrors(t *testing.T) {
	t.Parallel()
	_, err := publisher.NewTransactional(publisher.TransactionalConfig{TransactionalIDPrefix: "x-"})
	require.ErrorContains(t, err, "Brokers")

	_, err = publisher.NewTransactional(publisher.TransactionalConfig{Brokers: []string{"127.0.0.1:1"}})
	require.ErrorContains(t, err, "TransactionalIDPrefix")

	_, err = publisher.NewTransactional(publisher.TransactionalConfig{Brokers: []string{"127.0.0.1:1"}, TransactionalIDPrefix: "x-", MaxMessageBytes: -1})
	require.ErrorContains(t, err, "MaxMessageBytes")

	boom := errors.New("boom")
	_, err = publisher.NewTransactional(publisher.TransactionalConfig{
		Brokers: []string{"127.0.0.1:1"}, TransactionalIDPrefix: "x-",
		Configure: func(*sarama.Config) error { return boom },
	})
	require.ErrorIs(t, err, boom)

	_, err = publisher.NewTransactional(publisher.TransactionalConfig{
		Brokers: []string{"127.0.0.1:1"}, TransactionalIDPrefix: "x-",
		Configure: func(sc *sarama.Config) error { sc.Producer.Transaction.ID = "mine"; return nil },
	})
	require.ErrorContains(t, err, "Transaction.ID")
}

// A missing topic fails every transaction as the unknown topic, never as
// an outage, including once sarama's circuit breaker of the topic opened:
// the relay counts each failure against the message.
func TestTransactionalUnknownTopicIsCounted(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	if c.AutoCreatesTopics(t) {
		t.Skip("the cluster creates topics on demand (auto.create.topics.enable); scripts/kafka.sh runs Apache Kafka without it")
	}
	requireUnknownTopicCounted(t, newTransactional(t, c))
}

// TestTransactionalRidesOutBusyCoordinator: the coordinator answers
// CONCURRENT_TRANSACTIONS while it still writes a transaction's markers,
// and a retried EndTxn meets it too. The publisher's retry defaults start
// with ten quick retries (2ms) but keep sarama's budget of waiting: an
// EndTxn refused 55 times, about 4.1s of waits, still commits, where
// sarama's 50 retries would have failed the batch.
func TestTransactionalRidesOutBusyCoordinator(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // kfake only: the broker answers CONCURRENT_TRANSACTIONS on demand
	topic := c.Topic(t, 2)
	tx := newTransactional(t, c)

	const refusals = 55
	var ends atomic.Int32
	fake.ControlKey(int16(kmsg.EndTxn), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if ends.Add(1) > refusals {
			return nil, nil, false // handled by the broker as usual
		}
		resp := kreq.(*kmsg.EndTxnRequest).ResponseKind().(*kmsg.EndTxnResponse)
		resp.ErrorCode = kerr.ConcurrentTransactions.Code
		return resp, nil, true
	})

	msgs := inBucket(publishertest.Messages(topic, "busy", 20), 3)
	acked, err := tx.Publish(testCtx(t), msgs)
	require.NoError(t, err)
	require.Equal(t, len(msgs), acked)
	require.Equal(t, int32(refusals+1), ends.Load(), "one EndTxn per refusal, then the one accepted")
	publishertest.RequireSame(t, msgs, readCommitted(t, c, topic))
}
