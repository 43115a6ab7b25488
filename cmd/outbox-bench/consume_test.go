package main

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// TestConsumeRidesOutANewTopicsLeader: the bench's consumer starts on a
// topic whose partition leader the broker it asks does not know yet, as
// right after the topic's creation on a real cluster: the first offset
// requests are refused with NotLeaderForPartition, and the consumer
// still starts and receives what is produced after it.
func TestConsumeRidesOutANewTopicsLeader(t *testing.T) {
	cluster := kafkatest.Start(t, kafkatest.InProcess())
	topic := cluster.Topic(t, 1)
	var refused atomic.Int32
	fake := cluster.RequireFake(t)
	fake.ControlKey(int16(kmsg.ListOffsets), func(r kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if refused.Add(1) > 3 {
			return nil, nil, false
		}
		req := r.(*kmsg.ListOffsetsRequest)
		resp := req.ResponseKind().(*kmsg.ListOffsetsResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewListOffsetsResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewListOffsetsResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotLeaderForPartition.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})

	got := make(chan string, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop, err := consume(ctx, cluster.Brokers(), topic, false, func(key string, _ time.Time) {
		select {
		case got <- key:
		default:
		}
	})
	require.NoError(t, err, "the consumer starts once the leader is known")
	defer stop()
	require.Greater(t, refused.Load(), int32(1), "the offset request was refused first")

	sc := sarama.NewConfig()
	sc.Producer.Return.Successes = true
	p, err := sarama.NewSyncProducer(cluster.Brokers(), sc)
	require.NoError(t, err)
	defer p.Close()
	_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("v"),
		Headers: []sarama.RecordHeader{{Key: []byte(publisher.MessageIDHeaderDefault), Value: []byte("m1")}}})
	require.NoError(t, err)
	select {
	case id := <-got:
		require.Equal(t, "m1", id)
	case <-time.After(time.Minute):
		t.Fatal("nothing received for a minute")
	}
}

// TestPublishDirectRidesOutALeaderChange: the direct writer's publish
// meets NotLeaderForPartition more often than the producer retries it
// itself (a partition's leader unknown for a while, as on a busy cluster
// right after the topic's creation); the writer retries, as the relay
// would, and the message is delivered.
func TestPublishDirectRidesOutALeaderChange(t *testing.T) {
	cluster := kafkatest.Start(t, kafkatest.InProcess())
	topic := cluster.Topic(t, 1)
	pub := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: cluster.Brokers(),
		Configure: func(sc *sarama.Config) error {
			sc.Producer.Retry.Backoff = time.Millisecond
			return nil
		}})
	var refused atomic.Int32
	fake := cluster.RequireFake(t)
	fake.ControlKey(int16(kmsg.Produce), func(r kmsg.Request) (kmsg.Response, error, bool) {
		fake.KeepControl()
		if refused.Add(1) > 12 {
			return nil, nil, false
		}
		req := r.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic = rt.Topic
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition = rp.Partition
				sp.ErrorCode = kerr.NotLeaderForPartition.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	msg := []relay.Message{{MessageID: "m1", Topic: topic, Key: []byte("k"), Value: []byte("v"), CreatedAt: time.Now()}}
	require.NoError(t, publishDirect(context.Background(), pub, msg))
	require.Greater(t, refused.Load(), int32(12), "every refusal was met")
	require.Len(t, cluster.ReadAll(t, topic, 1, time.Minute), 1)
}
