package storetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/relay"
)

// OperatorHarness creates the operator APIs under test (ops.Operator).
// Message and dead-letter ids share one sequence in a real outbox (a dead
// letter keeps the row id it had): the suite gives the messages it
// inserts after dead letters explicit, larger ids.
type OperatorHarness struct {
	// New returns the operator API of an empty outbox with buckets
	// buckets. Each call is a separate outbox.
	New func(t *testing.T, buckets int) ops.Operator
	// Insert commits pending messages to the outbox of op in order, as a
	// writer would (Bucket, MessageID, Topic, Key, Value, Headers,
	// Partition, CreatedAt), with ID as the row id when it is non-zero.
	Insert func(t *testing.T, op ops.Operator, msgs []relay.Message)
	// InsertDead writes dead letters to the outbox of op as the failure
	// policy does, with the given ID, MessageID, Bucket, Topic, Key,
	// Value, Headers, Partition, CreatedAt, DeadAt, Attempts, LastError
	// and State.
	InsertDead func(t *testing.T, op ops.Operator, dead []ops.DeadLetter)
	// Pending returns the pending messages of op's outbox in id order.
	Pending func(t *testing.T, op ops.Operator) []relay.Message
}

// RunOperator runs the conformance suite of the operator API: status
// readings, dead-letter listing (filters, order, pages, full reads with
// the delivery note), typed errors, requeue (a key's order kept, a key
// requeued whole, lease terms advanced), discard, purge, pause and resume,
// and the oldest pending message. Every test is a subtest of t, run in
// parallel.
func RunOperator(t *testing.T, h OperatorHarness) {
	t.Helper()
	require.NotNil(t, h.New, "OperatorHarness.New")
	require.NotNil(t, h.Insert, "OperatorHarness.Insert")
	require.NotNil(t, h.InsertDead, "OperatorHarness.InsertDead")
	require.NotNil(t, h.Pending, "OperatorHarness.Pending")
	tests := []struct {
		name string
		fn   func(t *testing.T, h OperatorHarness)
	}{
		{"Status", testOpStatus},
		{"DeadLetterListing", testOpListing},
		{"DeadLetterFull", testOpFull},
		{"InvalidRequests", testOpInvalid},
		{"RequeueKeyKeepsOrder", testOpRequeueKey},
		{"RequeueIDsTakesTheKey", testOpRequeueIDs},
		{"RequeueAllByTopic", testOpRequeueAll},
		{"DiscardAndPurge", testOpDiscardPurge},
		{"PauseResume", testOpPause},
		{"OldestPending", testOpOldest},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h)
		})
	}
}

// ago is a time d before now, to the millisecond.
func ago(d time.Duration) time.Time { return time.UnixMilli(time.Now().Add(-d).UnixMilli()) }

func pendingMsg(bucket int, key, value string, age time.Duration) relay.Message {
	m := relay.Message{MessageID: "p-" + value, Bucket: bucket, Topic: "orders", Value: []byte(value), CreatedAt: ago(age)}
	if key != "" {
		m.Key = []byte(key)
	}
	return m
}

// deadSet is the dead letters most operator tests start from:
//
//	1 orders   "k" failed  bucket 1  died 72h ago
//	2 orders   "k" parked  bucket 1  died 72h ago
//	3 payments keyless     bucket 2  died 1h ago
//	4 orders   ""  failed  bucket 0  died 30m ago (the empty key)
//	5 payments "q" failed  bucket 3  died 10m ago
func deadSet() []ops.DeadLetter {
	d := func(id int64, bucket int, topic string, key []byte, state ops.DeadLetterState, died time.Duration) ops.DeadLetter {
		return ops.DeadLetter{ID: id, MessageID: fmt.Sprintf("d-%d", id), Bucket: bucket, Topic: topic, Key: key,
			Value: fmt.Appendf(nil, "v%d", id), State: state, DeadAt: ago(died), CreatedAt: ago(died + time.Minute), Attempts: 3,
			LastError: "rejected"}
	}
	return []ops.DeadLetter{
		d(1, 1, "orders", []byte("k"), ops.DeadLetterFailed, 72*time.Hour),
		d(2, 1, "orders", []byte("k"), ops.DeadLetterParked, 72*time.Hour),
		d(3, 2, "payments", nil, ops.DeadLetterFailed, time.Hour),
		d(4, 0, "orders", []byte{}, ops.DeadLetterFailed, 30*time.Minute),
		d(5, 3, "payments", []byte("q"), ops.DeadLetterFailed, 10*time.Minute),
	}
}

func listIDs(t *testing.T, op ops.Operator, q ops.DeadLetterQuery) []int64 {
	t.Helper()
	var ids []int64
	for {
		p, err := op.DeadLetters(t.Context(), q)
		require.NoError(t, err)
		for _, d := range p.Items {
			ids = append(ids, d.ID)
		}
		if p.Next == "" {
			return ids
		}
		q.Cursor = p.Next
	}
}

func testOpStatus(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	require.Equal(t, 4, op.BucketCount())
	st, err := op.Status(t.Context())
	require.NoError(t, err)
	require.Equal(t, 4, st.BucketCount)
	require.Len(t, st.Buckets, 4)
	require.Zero(t, st.Pending)
	require.True(t, st.Oldest.IsZero())

	pending := []relay.Message{pendingMsg(1, "a", "1", time.Hour), pendingMsg(1, "a", "2", time.Minute), pendingMsg(3, "", "3", 10*time.Minute)}
	h.Insert(t, op, pending)
	h.InsertDead(t, op, deadSet())
	st, err = op.Status(t.Context())
	require.NoError(t, err)
	require.EqualValues(t, 3, st.Pending)
	require.Equal(t, pending[0].CreatedAt.Unix(), st.Oldest.Unix())
	require.GreaterOrEqual(t, st.OldestAge(), time.Hour-time.Second)
	require.EqualValues(t, 2, st.Buckets[1].Pending)
	require.EqualValues(t, 1, st.Buckets[3].Pending)
	require.Zero(t, st.Buckets[0].Pending)
	require.Equal(t, ops.DeadLetterCounts{Failed: 4, Parked: 1}, st.DeadLetters)
	require.Equal(t, ops.DeadLetterCounts{Failed: 1, Parked: 1}, st.Buckets[1].DeadLetters)
	for i, b := range st.Buckets {
		require.Equal(t, i, b.Bucket)
		require.Equal(t, i, b.Lease.Bucket)
	}
	c, err := op.CountDeadLetters(t.Context())
	require.NoError(t, err)
	require.Equal(t, ops.DeadLetterCounts{Failed: 4, Parked: 1}, c)
	require.EqualValues(t, 5, c.Total())
}

func testOpListing(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	set := deadSet()
	h.InsertDead(t, op, set)
	// Newest first, by the time they died, then by id.
	require.Equal(t, []int64{5, 4, 3, 2, 1}, listIDs(t, op, ops.DeadLetterQuery{}))
	for _, limit := range []int{1, 2, 4} {
		require.Equal(t, []int64{5, 4, 3, 2, 1}, listIDs(t, op, ops.DeadLetterQuery{Limit: limit}), "limit %d", limit)
	}
	one := 1
	for name, c := range map[string]struct {
		q    ops.DeadLetterQuery
		want []int64
	}{
		"topic":     {ops.DeadLetterQuery{Topic: "orders"}, []int64{4, 2, 1}},
		"key":       {ops.DeadLetterQuery{Key: []byte("k")}, []int64{2, 1}},
		"empty key": {ops.DeadLetterQuery{Key: []byte{}}, []int64{4}},
		"keyless":   {ops.DeadLetterQuery{Keyless: true}, []int64{3}},
		"state":     {ops.DeadLetterQuery{State: ops.DeadLetterParked}, []int64{2}},
		"bucket":    {ops.DeadLetterQuery{Bucket: &one}, []int64{2, 1}},
		"since":     {ops.DeadLetterQuery{Since: ago(2 * time.Hour)}, []int64{5, 4, 3}},
		"until":     {ops.DeadLetterQuery{Until: ago(2 * time.Hour)}, []int64{2, 1}},
		"both":      {ops.DeadLetterQuery{Topic: "payments", State: ops.DeadLetterFailed, Since: ago(20 * time.Minute)}, []int64{5}},
		"none":      {ops.DeadLetterQuery{Topic: "nothing"}, nil},
	} {
		assert.Equal(t, c.want, listIDs(t, op, c.q), name)
	}
	p, err := op.DeadLetters(t.Context(), ops.DeadLetterQuery{Key: []byte("k")})
	require.NoError(t, err)
	require.Len(t, p.Items, 2)
	d := p.Items[1]
	// A listing leaves values and headers out and reports the size.
	require.Nil(t, d.Value)
	require.Nil(t, d.Headers)
	require.Equal(t, 2, d.ValueSize)
	require.Equal(t, "d-1", d.MessageID)
	require.Equal(t, "orders", d.Topic)
	require.Equal(t, 1, d.Bucket)
	require.Equal(t, []byte("k"), d.Key)
	require.Equal(t, 3, d.Attempts)
	require.Equal(t, "rejected", d.LastError)
	require.Equal(t, ops.DeadLetterFailed, d.State)
	require.Equal(t, set[0].DeadAt.Unix(), d.DeadAt.Unix())
	require.Equal(t, set[0].CreatedAt.Unix(), d.CreatedAt.Unix())
	require.False(t, d.MaybeDelivered)
}

func testOpFull(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	part := int32(2)
	note := ops.MaybeDeliveredPrefix + "a publish was attempted and its outcome is unknown"
	h.InsertDead(t, op, []ops.DeadLetter{
		{ID: 7, MessageID: "d-7", Bucket: 1, Topic: "orders", Key: []byte{0xff, 0}, Value: []byte(`{"n":7}`), Partition: &part,
			Headers: []relay.Header{{Key: "trace", Value: []byte("t-1")}, {Key: "nil"}}, State: ops.DeadLetterFailed,
			DeadAt: ago(time.Minute), CreatedAt: ago(2 * time.Minute), Attempts: 10, LastError: "timed out\n" + note},
		{ID: 8, MessageID: "d-8", Bucket: 1, Topic: "orders", State: ops.DeadLetterFailed, DeadAt: ago(time.Minute), CreatedAt: ago(time.Minute)},
	})
	d, err := op.DeadLetter(t.Context(), 7)
	require.NoError(t, err)
	require.Equal(t, []byte(`{"n":7}`), d.Value)
	require.Equal(t, 7, d.ValueSize)
	require.Equal(t, []byte{0xff, 0}, d.Key)
	require.Equal(t, &part, d.Partition)
	require.Len(t, d.Headers, 2)
	require.Equal(t, relay.Header{Key: "trace", Value: []byte("t-1")}, d.Headers[0])
	require.Equal(t, "nil", d.Headers[1].Key)
	require.Empty(t, d.Headers[1].Value)
	require.True(t, d.MaybeDelivered)
	require.Equal(t, note, d.DeliveryNote)
	p, err := op.DeadLetters(t.Context(), ops.DeadLetterQuery{})
	require.NoError(t, err)
	require.Len(t, p.Items, 2)
	require.True(t, p.Items[1].MaybeDelivered, "a listing derives the note too")

	keyless, err := op.DeadLetter(t.Context(), 8)
	require.NoError(t, err)
	require.Nil(t, keyless.Key)
	require.Nil(t, keyless.Partition)
	require.Empty(t, keyless.Value)

	_, err = op.DeadLetter(t.Context(), 99)
	require.ErrorIs(t, err, ops.ErrNotFound)
}

func testOpInvalid(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.InsertDead(t, op, deadSet())
	ctx := t.Context()
	for name, q := range map[string]ops.DeadLetterQuery{
		"limit negative":  {Limit: -1},
		"limit too big":   {Limit: ops.DeadLetterPageMax + 1},
		"key and keyless": {Key: []byte("k"), Keyless: true},
		"state":           {State: "lost"},
		"cursor":          {Cursor: "x"},
	} {
		_, err := op.DeadLetters(ctx, q)
		require.ErrorIs(t, err, ops.ErrInvalidRequest, name)
	}
	_, err := op.RequeueKey(ctx, nil)
	require.ErrorIs(t, err, ops.ErrInvalidRequest)
	_, err = op.PurgeDeadLetters(ctx, time.Time{})
	require.ErrorIs(t, err, ops.ErrInvalidRequest)
	require.ErrorIs(t, op.PauseBucket(ctx, 4), ops.ErrInvalidRequest)
	require.ErrorIs(t, op.ResumeBucket(ctx, -1), ops.ErrInvalidRequest)
	c, err := op.CountDeadLetters(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 5, c.Total(), "a refused request changes nothing")
}

// leases reads every bucket's lease through Status.
func leases(t *testing.T, op ops.Operator) []ops.LeaseInfo {
	t.Helper()
	st, err := op.Status(t.Context())
	require.NoError(t, err)
	out := make([]ops.LeaseInfo, len(st.Buckets))
	for i, b := range st.Buckets {
		out[i] = b.Lease
	}
	return out
}

func testOpRequeueKey(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.InsertDead(t, op, deadSet())
	// Pending messages are younger than the dead letters: their row ids
	// come after.
	k9, o1 := pendingMsg(1, "k", "k/9", time.Second), pendingMsg(1, "other", "o/1", time.Second)
	k9.ID, o1.ID = 100, 101
	h.Insert(t, op, []relay.Message{k9, o1})
	before := leases(t, op)
	res, err := op.RequeueKey(t.Context(), []byte("k"))
	require.NoError(t, err)
	require.Equal(t, ops.RequeueResult{Requeued: 2, Moved: 1, Buckets: []int{1}}, res)
	// The key's dead letters come back first, in their order, and its
	// pending message behind them, with their ids, keys and payloads;
	// other keys stay.
	var key []relay.Message
	var others []string
	for _, m := range h.Pending(t, op) {
		require.Equal(t, 1, m.Bucket)
		require.Zero(t, m.Attempts)
		if string(m.Key) == "k" {
			key = append(key, m)
		} else {
			others = append(others, string(m.Value))
		}
	}
	require.Equal(t, []string{"v1", "v2", "k/9"}, values(key))
	require.Equal(t, []string{"o/1"}, others)
	require.Equal(t, "d-1", key[0].MessageID)
	require.Equal(t, "orders", key[0].Topic)
	require.Greater(t, leases(t, op)[1].Term, before[1].Term, "a requeue revokes the bucket's lease term")
	require.Equal(t, []int64{5, 4, 3}, listIDs(t, op, ops.DeadLetterQuery{}))

	res, err = op.RequeueKey(t.Context(), []byte("k"))
	require.NoError(t, err)
	require.Zero(t, res.Requeued, "nothing left to requeue")
	// The empty key is a key.
	res, err = op.RequeueKey(t.Context(), []byte{})
	require.NoError(t, err)
	require.Equal(t, ops.RequeueResult{Requeued: 1, Buckets: []int{0}}, res)
}

func testOpRequeueIDs(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.InsertDead(t, op, deadSet())
	res, err := op.RequeueIDs(t.Context(), 2, 3, 42)
	require.NoError(t, err)
	// Dead letter 2 brings its key's failed message 1 with it.
	require.Equal(t, ops.RequeueResult{Requeued: 3, Buckets: []int{1, 2}, NotFound: []int64{42}}, res)
	require.ElementsMatch(t, []string{"v1", "v2", "v3"}, values(h.Pending(t, op)))
	var inOne []string
	for _, m := range h.Pending(t, op) {
		if m.Bucket == 1 {
			inOne = append(inOne, string(m.Value))
		}
	}
	require.Equal(t, []string{"v1", "v2"}, inOne)
	require.Equal(t, []int64{5, 4}, listIDs(t, op, ops.DeadLetterQuery{}))
}

func testOpRequeueAll(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.InsertDead(t, op, deadSet())
	res, err := op.RequeueAll(t.Context(), "payments")
	require.NoError(t, err)
	require.Equal(t, ops.RequeueResult{Requeued: 2, Buckets: []int{2, 3}}, res)
	require.Equal(t, []int64{4, 2, 1}, listIDs(t, op, ops.DeadLetterQuery{}))
	res, err = op.RequeueAll(t.Context(), "")
	require.NoError(t, err)
	require.Equal(t, ops.RequeueResult{Requeued: 3, Buckets: []int{0, 1}}, res)
	require.Empty(t, listIDs(t, op, ops.DeadLetterQuery{}))
	require.Len(t, h.Pending(t, op), 5)
}

func testOpDiscardPurge(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.InsertDead(t, op, deadSet())
	h.Insert(t, op, []relay.Message{pendingMsg(1, "k", "k/9", 100*time.Hour)})
	before := leases(t, op)
	n, err := op.DiscardDeadLetters(t.Context(), 3, 42)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Greater(t, leases(t, op)[2].Term, before[2].Term, "a discard revokes the bucket's lease term")
	n, err = op.PurgeDeadLetters(t.Context(), ago(2*time.Hour))
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.Equal(t, []int64{5, 4}, listIDs(t, op, ops.DeadLetterQuery{}))
	require.Equal(t, []string{"k/9"}, values(h.Pending(t, op)), "pending messages are never deleted")
	n, err = op.DiscardDeadLetters(t.Context(), 3)
	require.NoError(t, err)
	require.Zero(t, n)
}

func testOpPause(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	h.Insert(t, op, []relay.Message{pendingMsg(2, "a", "1", time.Second)})
	paused := func() []bool {
		var out []bool
		for _, l := range leases(t, op) {
			out = append(out, l.Paused)
		}
		return out
	}
	require.NoError(t, op.PauseBucket(t.Context(), 2))
	require.Equal(t, []bool{false, false, true, false}, paused())
	require.NoError(t, op.PauseBucket(t.Context(), 2), "pausing twice is harmless")
	require.Equal(t, []string{"1"}, values(h.Pending(t, op)), "a paused bucket keeps its messages")
	require.NoError(t, op.ResumeBucket(t.Context(), 2))
	require.Equal(t, []bool{false, false, false, false}, paused())
}

func testOpOldest(t *testing.T, h OperatorHarness) {
	op := h.New(t, 4)
	_, _, ok, err := op.OldestPending(t.Context())
	require.NoError(t, err)
	require.False(t, ok)
	h.Insert(t, op, []relay.Message{pendingMsg(0, "a", "1", time.Minute), pendingMsg(3, "b", "2", time.Hour), pendingMsg(1, "c", "3", time.Second)})
	age, bucket, ok, err := op.OldestPending(t.Context())
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, 3, bucket)
	require.GreaterOrEqual(t, age, time.Hour-time.Second)
	require.Less(t, age, 2*time.Hour)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = op.Status(ctx)
	require.Error(t, err, "a cancelled context fails the reading")
}
