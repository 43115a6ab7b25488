package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// TestTimelineBusyDuringPublish checks trace's bucket_busy: a message
// committed while its bucket's previous batch is still being published
// found the bucket busy, even when that batch's delete, run beside the
// next publish, ended first; one committed while nothing of its bucket
// ran did not.
func TestTimelineBusyDuringPublish(t *testing.T) {
	tl := newTimeline(func(m relay.Message) string { return m.MessageID })
	at := func(ms int) time.Time { return tl.t0.Add(time.Duration(ms) * time.Millisecond) }
	tl.ops = []tlOp{
		// Batch 1 of bucket 3: read 0-1, publish 1-200, its delete 2-4
		// (beside the publish).
		{kind: "read", bucket: 3, start: at(0), end: at(1), n: 5},
		{kind: "publish", bucket: 3, start: at(1), end: at(200), n: 5},
		{kind: "delete", bucket: 3, start: at(2), end: at(4), n: 5},
		// Batch 2 carries "a" (committed at 10, during batch 1's
		// publish) and "b" (committed at 300, the bucket idle).
		{kind: "read", bucket: 3, start: at(400), end: at(401), n: 2},
		{kind: "publish", bucket: 3, start: at(401), end: at(410), n: 2},
	}
	tl.pubOf["a"], tl.pubOf["b"] = 4, 4
	msgs := tl.trace([]string{"a", "b"}, []time.Time{at(10), at(300)}, map[string]time.Time{"a": at(411), "b": at(411)})
	require.Len(t, msgs, 2)
	require.True(t, msgs[0].busy, "committed during the previous batch's publish")
	require.Equal(t, at(400), msgs[0].readStart)
	require.False(t, msgs[1].busy, "committed while its bucket was idle")
}

// TestTimedKeepsSend: with -timeline the relay's publisher is wrapped to
// time its publishes; a publisher that pipelines (publisher.Franz) must
// stay one, or the timeline would measure a relay that no longer keeps
// several batches of a bucket in flight. The sarama publisher stays
// without Send.
func TestTimedKeepsSend(t *testing.T) {
	tl := newTimeline(func(m relay.Message) string { return m.MessageID })
	franz, err := publisher.NewFranz(publisher.FranzConfig{Brokers: []string{"127.0.0.1:1"}})
	require.NoError(t, err)
	_, ok := timed(franz, tl).(relay.Pipeliner)
	require.True(t, ok, "franz, timed: still a Pipeliner")
	kafka, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: []string{"127.0.0.1:1"}})
	require.NoError(t, err)
	_, ok = timed(kafka, tl).(relay.Pipeliner)
	require.False(t, ok, "sarama, timed: no Send")
}
