package publisher

import (
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

func TestDefaults(t *testing.T) {
	t.Parallel()
	cfg := KafkaConfig{}.WithDefaults()
	require.Equal(t, MessageIDHeaderDefault, cfg.MessageIDHeader)
	require.Equal(t, MaxMessageBytesDefault, cfg.MaxMessageBytes)
	require.NotNil(t, cfg.Logger)
}

// Both Kafka publishers build their sarama configuration through the same
// guarantee block: whatever a Configure hook sets, acks=all, idempotence,
// one request in flight and the partitioner hold in both modes.
func TestSaramaConfigEnforcesGuarantees(t *testing.T) {
	t.Parallel()
	downgrade := func(sc *sarama.Config) error {
		// Everything a careless callback could downgrade.
		sc.Producer.RequiredAcks = sarama.NoResponse
		sc.Producer.Idempotent = false
		sc.Net.MaxOpenRequests = 5
		sc.Producer.Retry.Max = 0
		sc.Version = sarama.V0_10_2_0
		sc.Producer.Return.Successes = false
		sc.Producer.Return.Errors = false
		sc.Producer.Partitioner = sarama.NewHashPartitioner
		sc.Producer.MaxMessageBytes = 10
		sc.ClientID = "mine"
		sc.Producer.Compression = sarama.CompressionSnappy
		return nil
	}
	keep := func(sc *sarama.Config) error {
		sc.Producer.Retry.Max = 50
		sc.Version = sarama.V3_6_0_0
		return nil
	}
	for name, build := range map[string]func(configure func(*sarama.Config) error) (*sarama.Config, error){
		"kafka": func(configure func(*sarama.Config) error) (*sarama.Config, error) {
			return KafkaConfig{Brokers: []string{"localhost:9092"}, Configure: configure}.WithDefaults().saramaConfig()
		},
		"transactional": func(configure func(*sarama.Config) error) (*sarama.Config, error) {
			return TransactionalConfig{Brokers: []string{"localhost:9092"}, TransactionalIDPrefix: "p", Configure: configure}.
				WithDefaults().saramaConfig("p-0")
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			sc, err := build(downgrade)
			require.NoError(t, err)
			require.Equal(t, sarama.WaitForAll, sc.Producer.RequiredAcks)
			require.True(t, sc.Producer.Idempotent)
			require.Equal(t, 1, sc.Net.MaxOpenRequests)
			require.Equal(t, RetryMaxDefault, sc.Producer.Retry.Max)
			floor := MinKafkaVersion
			if name == "transactional" {
				floor = MinTransactionalKafkaVersion
			}
			require.Equal(t, floor, sc.Version)
			require.True(t, sc.Producer.Return.Successes)
			require.True(t, sc.Producer.Return.Errors)
			require.Equal(t, reflect.ValueOf(newPartitioner).Pointer(), reflect.ValueOf(sc.Producer.Partitioner).Pointer())
			require.Equal(t, MaxMessageBytesDefault, sc.Producer.MaxMessageBytes)
			// What the guarantees do not depend on is the caller's.
			require.Equal(t, "mine", sc.ClientID)
			require.Equal(t, sarama.CompressionSnappy, sc.Producer.Compression)

			// Values already above the floors are kept.
			sc, err = build(keep)
			require.NoError(t, err)
			require.Equal(t, 50, sc.Producer.Retry.Max)
			require.Equal(t, sarama.V3_6_0_0, sc.Version)
			sc, err = build(nil)
			require.NoError(t, err)
			require.Equal(t, ClientIDDefault, sc.ClientID)

			// A hook setting a transactional id, or failing, is a
			// *relay.ConfigError naming the Configure field.
			_, err = build(func(sc *sarama.Config) error { sc.Producer.Transaction.ID = "x"; return nil })
			var ce *relay.ConfigError
			require.ErrorAs(t, err, &ce)
			require.Equal(t, "publisher", ce.Package)
			require.Contains(t, ce.Field, "Config.Configure")
			boom := errors.New("boom")
			_, err = build(func(*sarama.Config) error { return boom })
			require.ErrorIs(t, err, boom)
			require.ErrorIs(t, err, relay.ErrInvalidConfig)
		})
	}
}

// Every invalid publisher configuration is a *relay.ConfigError naming
// its field.
func TestConfigErrorsNameTheirField(t *testing.T) {
	t.Parallel()
	for field, err := range map[string]error{
		"KafkaConfig.Brokers":                       KafkaConfig{}.WithDefaults().validate(),
		"KafkaConfig.StallTimeout":                  KafkaConfig{Brokers: []string{"b"}, StallTimeout: -1}.WithDefaults().validate(),
		"KafkaConfig.MaxMessageBytes":               KafkaConfig{Brokers: []string{"b"}, MaxMessageBytes: -1}.WithDefaults().validate(),
		"TransactionalConfig.Brokers":               TransactionalConfig{}.WithDefaults().validate(),
		"TransactionalConfig.TransactionalIDPrefix": TransactionalConfig{Brokers: []string{"b"}}.WithDefaults().validate(),
		"TransactionalConfig.MaxMessageBytes": TransactionalConfig{Brokers: []string{"b"}, TransactionalIDPrefix: "p",
			MaxMessageBytes: int(sarama.MaxRequestSize)}.WithDefaults().validate(),
	} {
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, field)
		require.Equal(t, field, ce.Field)
		require.Equal(t, "publisher", ce.Package)
		require.ErrorIs(t, err, relay.ErrInvalidConfig)
		require.Contains(t, err.Error(), "publisher: invalid config "+field+"=")
	}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	for _, err := range permanentKafkaErrors {
		require.True(t, relay.IsPermanent(classify(err)), "%v", err)
		require.False(t, IsTooLarge(classify(err)), "%v", err)
	}
	for _, err := range []error{
		sarama.ErrMessageSizeTooLarge,
		sarama.ErrMessageSetSizeTooLarge,
		sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 11 > 10"),
	} {
		c := classify(err)
		require.True(t, relay.IsPermanent(c), "%v", err)
		require.True(t, IsTooLarge(c), "%v", err)
		require.ErrorIs(t, c, err)
	}
	// Broker-side too large: the whole partition batch was refused.
	require.True(t, relay.IsBatchRejected(classify(sarama.ErrMessageSizeTooLarge)))
	require.False(t, relay.IsBatchRejected(classify(sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 11 > 10"))))

	// About the message, but retryable: counted against it.
	for _, err := range []error{
		sarama.ErrUnknownTopicOrPartition,
		sarama.ErrInvalidMessage,
		errors.New("something else"),
	} {
		require.False(t, relay.IsPermanent(classify(err)), "%v", err)
		require.False(t, relay.IsUnavailable(classify(err)), "%v", err)
		require.Equal(t, err, classify(err))
	}

	// Not about the message: never counted against it.
	for _, err := range []error{
		sarama.ErrNotLeaderForPartition,
		sarama.ErrLeaderNotAvailable,
		sarama.ErrRequestTimedOut,
		sarama.ErrNotEnoughReplicas,
		sarama.ErrNotEnoughReplicasAfterAppend,
		sarama.ErrOutOfBrokers,
		fmt.Errorf("%w: dial tcp 127.0.0.1:9: connect: %w", sarama.ErrOutOfBrokers, syscall.ECONNREFUSED),
		breaker.ErrBreakerOpen,
		sarama.ErrOutOfOrderSequenceNumber,
		sarama.ErrUnknownProducerID,
		sarama.ErrInvalidProducerEpoch,
		&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED},
		io.EOF,
		errHeldBack,
	} {
		c := classify(err)
		require.False(t, relay.IsPermanent(c), "%v", err)
		require.True(t, relay.IsUnavailable(c), "%v", err)
		require.ErrorIs(t, c, err)
	}
	require.True(t, isProducerState(classify(sarama.ErrOutOfOrderSequenceNumber)))
	require.False(t, isProducerState(classify(sarama.ErrOutOfBrokers)))
}

func TestErrorWrapping(t *testing.T) {
	t.Parallel()
	e := &Error{Index: 2, MessageID: "m", Topic: "t", Err: classify(sarama.ErrTopicAuthorizationFailed)}
	var err error = fmt.Errorf("relay: %w", e)
	require.ErrorIs(t, err, sarama.ErrTopicAuthorizationFailed)
	require.True(t, relay.IsPermanent(err))
	require.Equal(t, `not authorized to write to topic "t"; topic t; message id "m"; sink error: permanent: `+sarama.ErrTopicAuthorizationFailed.Error(),
		e.Error())
	require.Contains(t, err.Error(), e.Error())
	require.NotContains(t, err.Error(), "message 2")
}

func TestPartitioner(t *testing.T) {
	t.Parallel()
	p := newPartitioner("t").(*partitioner)
	pin := &envelope{pinned: true, partition: 5}

	got, err := p.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder("k"), Metadata: pin}, 8)
	require.NoError(t, err)
	require.Equal(t, int32(5), got, "a pinned partition wins over the key")
	require.True(t, p.MessageRequiresConsistency(&sarama.ProducerMessage{Metadata: pin}))

	got, err = p.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder{}, Metadata: &envelope{}}, 8)
	require.NoError(t, err)
	require.Equal(t, KeyPartition(nil, 8), got, "the empty key is hashed")
	require.True(t, p.MessageRequiresConsistency(&sarama.ProducerMessage{Key: sarama.ByteEncoder{}}))

	require.False(t, p.MessageRequiresConsistency(&sarama.ProducerMessage{}), "keyless may skip leaderless partitions")
	seen := map[int32]bool{}
	for range 200 {
		got, err := p.Partition(&sarama.ProducerMessage{Metadata: &envelope{}}, 4)
		require.NoError(t, err)
		require.True(t, got >= 0 && got < 4)
		seen[got] = true
	}
	require.Greater(t, len(seen), 1, "keyless messages are spread")
}

// TestTransactionalProducerDefaults: the transactional producers resend
// a coordinator request after 2ms ten times, then after 4ms doubling to
// 100ms, up to 60 times, and linger TxnLingerDefault for a transaction's
// records, unless Configure chose a backoff, a retry count or a flush
// threshold of its own.
func TestTransactionalProducerDefaults(t *testing.T) {
	t.Parallel()
	cfg := TransactionalConfig{Brokers: []string{"127.0.0.1:1"}, TransactionalIDPrefix: "p-"}.WithDefaults()
	sc, err := cfg.saramaConfig("p-0")
	require.NoError(t, err)
	require.Equal(t, TxnLingerDefault, sc.Producer.Flush.Frequency)
	f := sc.Producer.Transaction.Retry.BackoffFunc
	require.NotNil(t, f)
	require.Equal(t, 60, sc.Producer.Transaction.Retry.Max)
	var waits []time.Duration
	total := time.Duration(0)
	for r := range sc.Producer.Transaction.Retry.Max {
		d := f(r, sc.Producer.Transaction.Retry.Max)
		waits = append(waits, d/time.Millisecond)
		total += d
	}
	require.Equal(t, []time.Duration{2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 8, 16, 32, 64, 100, 100}, waits[:17], "ms")
	require.Equal(t, time.Duration(100), waits[len(waits)-1], "ms")
	require.Greater(t, total, 4500*time.Millisecond, "a coordinator moving is still ridden out")

	cfg.Configure = func(sc *sarama.Config) error {
		sc.Producer.Transaction.Retry.Max = 7
		return nil
	}
	sc, err = cfg.saramaConfig("p-0")
	require.NoError(t, err)
	require.NotNil(t, sc.Producer.Transaction.Retry.BackoffFunc)
	require.Equal(t, 7, sc.Producer.Transaction.Retry.Max, "Configure's retry count is kept")

	cfg.Configure = func(sc *sarama.Config) error {
		sc.Producer.Transaction.Retry.Backoff = 50 * time.Millisecond
		sc.Producer.Flush.Messages = 10
		return nil
	}
	sc, err = cfg.saramaConfig("p-0")
	require.NoError(t, err)
	require.Zero(t, sc.Producer.Flush.Frequency, "Configure's flush threshold is kept")
	require.Equal(t, 10, sc.Producer.Flush.Messages)
	require.Nil(t, sc.Producer.Transaction.Retry.BackoffFunc, "Configure's fixed backoff is kept")
	require.Equal(t, 50*time.Millisecond, sc.Producer.Transaction.Retry.Backoff)
	require.Equal(t, sarama.NewConfig().Producer.Transaction.Retry.Max, sc.Producer.Transaction.Retry.Max,
		"with Configure's backoff, sarama's retry count")

	own := func(int, int) time.Duration { return time.Second }
	cfg.Configure = func(sc *sarama.Config) error {
		sc.Producer.Transaction.Retry.BackoffFunc = own
		return nil
	}
	sc, err = cfg.saramaConfig("p-0")
	require.NoError(t, err)
	require.Equal(t, time.Second, sc.Producer.Transaction.Retry.BackoffFunc(0, 50), "Configure's function is kept")
}

// A bucket stays on the lane of its stray calls until every one of them
// reported, not only the last: a later call pinned to the lane can return
// with none of its own messages out while an earlier call's still are (a
// narrowed batch need not carry them), and a batch on the other lane
// could then overtake them.
func TestStrayPinHoldsEveryCall(t *testing.T) {
	k := &Kafka{lanes: 2, lingerMin: 32, slots: []slot{{strays: map[int]stray{}}}}
	s := &k.slots[0]
	p := &producer{slot: 0, lane: laneLinger}
	small := make([]relay.Message, 1)
	large := make([]relay.Message, 40)

	first := &call{}
	first.pending.Store(2) // two messages of a cancelled large batch still out
	k.strayed(p, 0, first)
	require.Equal(t, laneLinger, k.laneOf(s, small), "pinned while the first call has messages out")

	second := &call{}
	second.pending.Store(1)
	k.strayed(p, 0, second)
	second.pending.Store(0) // the second call's message reported; the first's have not
	require.Equal(t, laneLinger, k.laneOf(s, small), "still pinned: the first call has messages out")

	first.pending.Store(0)
	require.Equal(t, laneFree, k.laneOf(s, small), "every stray call reported: routed by size again")
	require.Equal(t, laneLinger, k.laneOf(s, large))
	require.Empty(t, s.strays, "the bucket's pin is gone")
}

// TestHealthBucketFailing: a bucket's failures count from the first one
// since its last acknowledgement, and start anew when the bucket had not
// failed for more than twice the stall timeout (it was not retried through
// this producer meanwhile).
func TestHealthBucketFailing(t *testing.T) {
	const stall = 10 * time.Second
	var h health
	t0 := time.Unix(1000, 0)
	require.Equal(t, t0, h.failing(3, t0, stall))
	require.Equal(t, t0, h.failing(3, t0.Add(stall), stall))
	require.Equal(t, t0.Add(time.Second), h.failing(4, t0.Add(time.Second), stall), "each bucket on its own")
	require.Equal(t, t0, h.failing(3, t0.Add(3*stall), stall), "at most 2 × stall since its previous failure")
	later := t0.Add(6 * stall)
	require.Equal(t, later, h.failing(3, later, stall), "more than 2 × stall without a failure starts anew")
}
