package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/outboxtest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// TestFranzTraceSplitsAPublish publishes through the Franz publisher with
// the timeline's hooks on the test broker: every acknowledged record is
// traced, each to a produce request written after franz-go took it and
// answered before its acknowledgement, and the summary splits the named
// records' time into those steps.
func TestFranzTraceSplitsAPublish(t *testing.T) {
	broker := outboxtest.StartBroker(t, "trace")
	ft := newFranzTrace(franzRecordKey(false))
	tl := &timeline{franz: ft}
	pub, err := publisher.NewFranz(publisher.FranzConfig{Brokers: broker.Brokers(), Options: tl.franzOpts()})
	require.NoError(t, err)
	require.NoError(t, pub.Start(context.Background()))
	defer pub.Close()
	var ids []string
	for batch := 0; batch < 3; batch++ {
		var msgs []relay.Message
		for i := 0; i < 7; i++ {
			id := "m" + strconv.Itoa(batch*7+i)
			ids = append(ids, id)
			msgs = append(msgs, relay.Message{MessageID: id, Topic: "trace", Key: []byte(id), Value: []byte("v")})
		}
		n, err := pub.Publish(context.Background(), msgs)
		require.NoError(t, err)
		require.Equal(t, len(msgs), n)
	}

	ft.mu.Lock()
	require.Len(t, ft.recs, len(ids), "every acknowledged record traced")
	require.Empty(t, ft.buffered, "no record left between buffered and acknowledged")
	require.NotEmpty(t, ft.reqs, "produce requests traced")
	for _, id := range ids {
		r, ok := ft.recs[id]
		require.True(t, ok, id)
		require.False(t, r.acked.Before(r.buffered), id)
		carried := false
		for _, q := range ft.reqs {
			if !q.written.Before(r.buffered) && !q.read.After(r.acked) {
				carried = true
			}
		}
		require.True(t, carried, "%s: a request written after franz-go took it and answered before its ack", id)
	}
	ft.mu.Unlock()

	s := ft.summary(ids[:5])
	t.Log(s)
	require.Contains(t, s, "franz: records ×21 ")
	require.Contains(t, s, "5 of the slow messages' records")
	require.True(t, strings.HasPrefix(s, "franz: "), s)
}
