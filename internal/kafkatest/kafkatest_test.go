package kafkatest_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func produce(t *testing.T, c *kafkatest.Cluster, recs []*kgo.Record, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(c.Brokers()...)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	if len(recs) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	}
	return cl
}

func TestReadAllReturnsWhatWasWritten(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 3)

	recs := []*kgo.Record{
		{Topic: topic, Partition: 0, Key: []byte("k"), Value: []byte("v0"), Headers: []kgo.RecordHeader{{Key: "h", Value: []byte("1")}, {Key: "h", Value: []byte("2")}}},
		{Topic: topic, Partition: 0, Key: nil, Value: []byte("keyless")},
		{Topic: topic, Partition: 1, Key: []byte{}, Value: []byte("empty key")},
		{Topic: topic, Partition: 2, Key: []byte("tomb"), Value: nil},
	}
	produce(t, c, recs, kgo.RecordPartitioner(kgo.ManualPartitioner()))

	got := c.ReadAll(t, topic, len(recs), 10*time.Second)
	require.Len(t, got, 4)
	require.Equal(t, int32(0), got[0].Partition)
	require.Equal(t, []byte("k"), got[0].Key)
	require.Equal(t, []kafkatest.Header{{Key: "h", Value: []byte("1")}, {Key: "h", Value: []byte("2")}}, got[0].Headers)
	require.Nil(t, got[1].Key, "null key reads back as nil")
	require.Equal(t, int64(1), got[1].Offset)
	require.NotNil(t, got[2].Key, "empty key reads back as non-nil")
	require.Empty(t, got[2].Key)
	require.Nil(t, got[3].Value, "tombstone reads back as nil")
	require.Equal(t, int64(4), c.RecordCount(t, topic))
}

func TestTopicNamesAreUnique(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	a, b := c.Topic(t, 1), c.Topic(t, 1)
	require.NotEqual(t, a, b)
	require.Equal(t, int64(0), c.RecordCount(t, a))
}

func TestTopicConfig(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1, kafkatest.TopicConfig("max.message.bytes", "1000"))
	cl := produce(t, c, nil, kgo.ProducerBatchCompression(kgo.NoCompression()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: make([]byte, 2000)}).FirstErr()
	require.Error(t, err, "the topic's max.message.bytes applies")
}

func TestSeedTopicsAndBrokers(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.NumBrokers(3), kafkatest.SeedTopics(2, "kafkatest-seeded"))
	if c.Fake() != nil {
		require.Len(t, c.Brokers(), 3)
	}
	produce(t, c, []*kgo.Record{{Topic: "kafkatest-seeded", Partition: 1, Value: []byte("x")}},
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	got := c.ReadAll(t, "kafkatest-seeded", 1, 10*time.Second)
	require.GreaterOrEqual(t, len(got), 1)
}

func TestReadCommittedSkipsAbortedRecords(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 1)
	cl := produce(t, c, nil, kgo.TransactionalID("kafkatest-"+topic))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	require.NoError(t, cl.BeginTransaction())
	require.NoError(t, cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("aborted")}).FirstErr())
	require.NoError(t, cl.EndTransaction(ctx, kgo.TryAbort))
	require.NoError(t, cl.BeginTransaction())
	require.NoError(t, cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Value: []byte("committed")}).FirstErr())
	require.NoError(t, cl.EndTransaction(ctx, kgo.TryCommit))

	got := c.ReadAll(t, topic, 1, 10*time.Second, kafkatest.ReadCommitted())
	require.Len(t, got, 1)
	require.Equal(t, []byte("committed"), got[0].Value)

	all := c.ReadAll(t, topic, 2, 10*time.Second)
	require.Len(t, all, 2, "read_uncommitted sees the aborted record too")
}

func TestReadLogReadsToTheEnd(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2)
	require.Empty(t, c.ReadLog(t, topic, 10*time.Second), "an empty topic reads as empty")

	cl := produce(t, c, nil, kgo.TransactionalID("kafkatest-log-"+topic), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	txn := func(commit kgo.TransactionEndTry, recs ...*kgo.Record) {
		t.Helper()
		require.NoError(t, cl.BeginTransaction())
		require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
		require.NoError(t, cl.EndTransaction(ctx, commit))
	}
	txn(kgo.TryCommit, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("c1")})
	// Partition 1 ends with an aborted transaction and its marker.
	txn(kgo.TryAbort, &kgo.Record{Topic: topic, Partition: 1, Value: []byte("a1")}, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("a2")})
	txn(kgo.TryCommit, &kgo.Record{Topic: topic, Partition: 0, Value: []byte("c2")})

	values := func(recs []kafkatest.Record) []string {
		var out []string
		for _, r := range recs {
			out = append(out, string(r.Value))
		}
		return out
	}
	require.Equal(t, []string{"c1", "c2"}, values(c.ReadLog(t, topic, 10*time.Second, kafkatest.ReadCommitted())))
	require.Equal(t, []string{"c1", "a2", "c2", "a1"}, values(c.ReadLog(t, topic, 10*time.Second)))
}

func TestRequireFake(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	fake := c.RequireFake(t) // skips on a real cluster
	require.NotNil(t, fake)
}

// A CreateTopics request whose connection is cut (a broker killed by a
// chaos test on the shared cluster), then answered with a retriable error,
// is sent again: the topic is created, with its partitions.
func TestTopicRidesOutACutCreate(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t, kafkatest.InProcess())
	var calls atomic.Int32
	c.Fake().ControlKey(int16(kmsg.CreateTopics), func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.Fake().KeepControl()
		switch calls.Add(1) {
		case 1:
			return nil, errors.New("connection cut"), true
		case 2:
			resp := req.ResponseKind().(*kmsg.CreateTopicsResponse)
			rt := kmsg.NewCreateTopicsResponseTopic()
			rt.Topic = req.(*kmsg.CreateTopicsRequest).Topics[0].Topic
			rt.ErrorCode = kerr.NotController.Code
			resp.Topics = append(resp.Topics, rt)
			return resp, nil, true
		}
		return nil, nil, false
	})
	topic := c.Topic(t, 3)
	require.GreaterOrEqual(t, calls.Load(), int32(3), "cut, refused, then created")
	cl := produce(t, c, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = &topic
	req.Topics = append(req.Topics, rt)
	meta, err := req.RequestWith(ctx, cl)
	require.NoError(t, err)
	require.Len(t, meta.Topics, 1)
	require.Len(t, meta.Topics[0].Partitions, 3)
}
