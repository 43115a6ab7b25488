package gormrelay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

func TestAdminBacklog(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := newStoreBundle(t, dbt, outbox.Config{})
		p, err := outbox.NewPlugin(b.cfg)
		require.NoError(t, err)
		require.NoError(t, dbt.DB.Use(p))
		admin := gormrelay.PluginAdmin(dbt.DB, p)
		ctx := context.Background()

		empty, err := admin.Backlog(ctx)
		require.NoError(t, err)
		require.Zero(t, empty.Pending)
		age, known := empty.OldestAge()
		require.True(t, known)
		require.Zero(t, age)
		require.Equal(t, b.cfg.BucketCount, empty.BucketCount)
		require.True(t, empty.DeadLettersKnown)

		start := time.Now()
		ka, kb := []byte(keyInBucket(t, 1, b.cfg.BucketCount)), []byte(keyInBucket(t, 2, b.cfg.BucketCount))
		require.NoError(t, dbt.DB.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx,
				&outbox.Message{Topic: "t", Key: ka}, &outbox.Message{Topic: "t", Key: ka}, &outbox.Message{Topic: "t", Key: kb})
		}))
		bl, err := admin.Backlog(ctx)
		require.NoError(t, err)
		require.Equal(t, int64(3), bl.Pending)
		require.Len(t, bl.Buckets, 2)
		per := map[int]int64{}
		for _, bb := range bl.Buckets {
			per[bb.Bucket] = bb.Pending
		}
		require.Equal(t, map[int]int64{1: 2, 2: 1}, per)
		require.WithinDuration(t, start, bl.Oldest, 2*time.Second)
		age, known = bl.OldestAge()
		require.True(t, known)
		require.GreaterOrEqual(t, age, time.Duration(0))
	})
}

// insertDead writes dead letters directly, filling in what is missing.
func (b *storeBundle) insertDead(t testing.TB, rows ...outbox.DeadLetterRow) {
	t.Helper()
	for i := range rows {
		r := &rows[i]
		if r.MessageID == "" {
			r.MessageID = fmt.Sprintf("d-%d", r.ID)
		}
		if r.Topic == "" {
			r.Topic = "events"
		}
		if r.State == "" {
			r.State = "failed"
		}
		if r.CreatedAtMs == 0 {
			r.CreatedAtMs = time.Now().UnixMilli()
		}
		if r.DeadAtMs == 0 {
			r.DeadAtMs = time.Now().UnixMilli()
		}
	}
	require.NoError(t, b.db.DB.Table(b.cfg.Tables.DeadLettersTable()).Create(&rows).Error)
}

func deadIDs(items []gormrelay.DeadLetter) []int64 {
	out := make([]int64, len(items))
	for i, d := range items {
		out[i] = d.ID
	}
	return out
}

func TestAdminDeadLetters(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{Tables: outbox.WithPrefix("adm_")})
		admin := b.newAdmin(t)
		t0 := time.Now().Add(-time.Hour).UnixMilli()
		part := int32(3)
		hdrs := []outbox.Header{{Key: "trace", Value: []byte("abc")}, {Key: "bin", Value: []byte{0xff, 0x00}}}
		b.insertDead(t,
			outbox.DeadLetterRow{ID: 10, Bucket: 1, Topic: "orders", Key: []byte("k1"), Value: []byte("v10"), Headers: outbox.EncodeHeaders(hdrs),
				Partition: &part, Attempts: 10, LastError: ptr("boom"), DeadAtMs: t0},
			outbox.DeadLetterRow{ID: 11, Bucket: 1, Topic: "orders", Key: []byte("k1"), Value: []byte("v11"), DeadAtMs: t0, State: "parked"},
			outbox.DeadLetterRow{ID: 12, Bucket: 2, Topic: "payments", Key: []byte{0xfe, 0x01}, Value: nil, DeadAtMs: t0 + 1000},
			outbox.DeadLetterRow{ID: 13, Bucket: 3, Topic: "payments", Key: nil, Value: []byte("v13"), DeadAtMs: t0 + 2000},
			outbox.DeadLetterRow{ID: 14, Bucket: 3, Topic: "orders", Key: []byte{}, Value: []byte("v14"), DeadAtMs: t0 + 3000},
		)

		counts, err := admin.CountDeadLetters(ctx)
		require.NoError(t, err)
		require.Equal(t, gormrelay.DeadLetterCounts{Failed: 4, Parked: 1}, counts)
		require.EqualValues(t, 5, counts.Total())

		// Newest first, then by id; paged with a cursor.
		page, err := admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Limit: 2})
		require.NoError(t, err)
		require.Equal(t, []int64{14, 13}, deadIDs(page.Items))
		require.NotEmpty(t, page.Next)
		page, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Limit: 2, Cursor: page.Next})
		require.NoError(t, err)
		require.Equal(t, []int64{12, 11}, deadIDs(page.Items))
		page, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Limit: 2, Cursor: page.Next})
		require.NoError(t, err)
		require.Equal(t, []int64{10}, deadIDs(page.Items))
		require.Empty(t, page.Next)

		// Filters.
		for _, c := range []struct {
			q    gormrelay.DeadLetterQuery
			want []int64
		}{
			{gormrelay.DeadLetterQuery{Topic: "payments"}, []int64{13, 12}},
			{gormrelay.DeadLetterQuery{Key: []byte("k1")}, []int64{11, 10}},
			{gormrelay.DeadLetterQuery{Key: []byte{}}, []int64{14}},
			{gormrelay.DeadLetterQuery{Keyless: true}, []int64{13}},
			{gormrelay.DeadLetterQuery{State: gormrelay.DeadLetterParked}, []int64{11}},
			{gormrelay.DeadLetterQuery{Bucket: ptr(3)}, []int64{14, 13}},
			{gormrelay.DeadLetterQuery{Since: time.UnixMilli(t0 + 1000), Until: time.UnixMilli(t0 + 3000)}, []int64{13, 12}},
			{gormrelay.DeadLetterQuery{Topic: "orders", State: gormrelay.DeadLetterFailed}, []int64{14, 10}},
		} {
			page, err := admin.DeadLetters(ctx, c.q)
			require.NoError(t, err)
			require.Equal(t, c.want, deadIDs(page.Items), "%+v", c.q)
		}

		// A list leaves out values; one dead letter in full has them.
		page, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Key: []byte("k1"), State: gormrelay.DeadLetterFailed})
		require.NoError(t, err)
		require.Nil(t, page.Items[0].Value)
		require.Equal(t, 3, page.Items[0].ValueSize)
		d, err := admin.DeadLetter(ctx, 10)
		require.NoError(t, err)
		require.Equal(t, "d-10", d.MessageID)
		require.Equal(t, 1, d.Bucket)
		require.Equal(t, "orders", d.Topic)
		require.Equal(t, []byte("k1"), d.Key)
		require.Equal(t, []byte("v10"), d.Value)
		require.Equal(t, hdrs, d.Headers)
		require.Equal(t, &part, d.Partition)
		require.Equal(t, 10, d.Attempts)
		require.Equal(t, "boom", d.LastError)
		require.Equal(t, gormrelay.DeadLetterFailed, d.State)
		require.Equal(t, time.UnixMilli(t0), d.DeadAt)

		js, err := json.Marshal(d)
		require.NoError(t, err)
		require.JSONEq(t, fmt.Sprintf(`{"id":10,"message_id":"d-10","bucket":1,"topic":"orders","key":"k1","value_base64":"djEw","value_size":3,
			"headers":[{"key":"trace","value":"abc"},{"key":"bin","value_base64":"/wA="}],"partition":3,
			"created_at":%q,"dead_at":%q,"attempts":10,"last_error":"boom","state":"failed","maybe_delivered":false}`,
			d.CreatedAt.Format(time.RFC3339Nano), d.DeadAt.Format(time.RFC3339Nano)), string(js))
		d12, err := admin.DeadLetter(ctx, 12)
		require.NoError(t, err)
		require.Equal(t, []byte{0xfe, 0x01}, d12.Key)
		require.Nil(t, d12.Value)
		js, err = json.Marshal(d12)
		require.NoError(t, err)
		require.Contains(t, string(js), `"key_base64":"/gE="`)
		d13, err := admin.DeadLetter(ctx, 13)
		require.NoError(t, err)
		require.Nil(t, d13.Key)
		d14, err := admin.DeadLetter(ctx, 14)
		require.NoError(t, err)
		require.NotNil(t, d14.Key)
		require.Empty(t, d14.Key)

		_, err = admin.DeadLetter(ctx, 999)
		require.ErrorIs(t, err, gormrelay.ErrNotFound)
		_, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Cursor: "nope"})
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)
		_, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{Limit: 5000})
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)
		_, err = admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{State: "gone"})
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)

		// Discard deletes exactly the named dead letters.
		n, err := admin.DiscardDeadLetters(ctx, 12, 999)
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		counts, err = admin.CountDeadLetters(ctx)
		require.NoError(t, err)
		require.EqualValues(t, 4, counts.Total())
	})
}

// Purge deletes only dead letters older than the time, never a pending
// message.
func TestAdminPurge(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{})
		admin := b.newAdmin(t)
		old := time.Now().Add(-48 * time.Hour)
		b.insert(t, outbox.MessageRow{MessageID: "pending-old", Key: []byte("k"), Value: []byte("p"), CreatedAtMs: old.Add(-time.Hour).UnixMilli()})
		b.insertDead(t,
			outbox.DeadLetterRow{ID: 1, Bucket: 1, Key: []byte("k"), DeadAtMs: old.UnixMilli()},
			outbox.DeadLetterRow{ID: 2, Bucket: 2, DeadAtMs: old.UnixMilli()},
			outbox.DeadLetterRow{ID: 3, Bucket: 1, Key: []byte("k"), State: "parked"},
		)
		_, err := admin.PurgeDeadLetters(ctx, time.Time{})
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)

		n, err := admin.PurgeDeadLetters(ctx, time.Now().Add(-24*time.Hour))
		require.NoError(t, err)
		require.EqualValues(t, 2, n)
		require.EqualValues(t, 1, b.count(t), "pending messages are never purged")
		rows := b.deadRows(t)
		require.Len(t, rows, 1)
		require.EqualValues(t, 3, rows[0].ID)
		// The purged buckets' lease terms advanced: a relay holding one
		// re-reads its quarantined keys. The empty lease table got the
		// rows of every bucket, as at a relay's first start.
		leases := b.leaseRows(t)
		require.Len(t, leases, b.cfg.BucketCount)
		for _, l := range leases {
			want := 0
			if l.Bucket == 1 || l.Bucket == 2 {
				want = 1
			}
			require.EqualValues(t, want, l.Term, "bucket %d", l.Bucket)
		}

		n, err = admin.PurgeDeadLetters(ctx, time.Now().Add(time.Minute))
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		require.Empty(t, b.deadRows(t))
		require.EqualValues(t, 1, b.count(t))
	})
}

// RequeueAll with a topic requeues the matching keyless dead letters and
// every key group with a dead letter of the topic.
func TestAdminRequeueAll(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 4})
		p, err := outbox.NewPlugin(b.cfg)
		require.NoError(t, err)
		admin := gormrelay.PluginAdmin(db.DB, p)
		b.insertDead(t,
			outbox.DeadLetterRow{ID: 1, Bucket: 1, Topic: "a", Key: []byte("k"), Value: []byte("k/0")},
			outbox.DeadLetterRow{ID: 2, Bucket: 1, Topic: "b", Key: []byte("k"), Value: []byte("k/1"), State: "parked"},
			outbox.DeadLetterRow{ID: 3, Bucket: 2, Topic: "a", Value: []byte("n/0")},
			outbox.DeadLetterRow{ID: 4, Bucket: 2, Topic: "b", Value: []byte("n/1")},
			outbox.DeadLetterRow{ID: 5, Bucket: 3, Topic: "b", Key: []byte("j"), Value: []byte("j/0")},
		)
		res, err := admin.RequeueAll(ctx, "a")
		require.NoError(t, err)
		require.EqualValues(t, 3, res.Requeued)
		require.Equal(t, []int{1, 2}, res.Buckets)
		require.Equal(t, []string{"k/0", "k/1", "n/0"}, b.pendingValues(t))
		buckets, _ := p.Notifier().Take(nil)
		require.Equal(t, []int{1, 2}, buckets, "the plugin's relays are woken")

		res, err = admin.RequeueAll(ctx, "")
		require.NoError(t, err)
		require.EqualValues(t, 2, res.Requeued)
		require.Empty(t, b.deadRows(t))
		require.Len(t, b.pendingValues(t), 5)

		_, err = admin.RequeueKey(ctx, nil)
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)
		res, err = admin.RequeueKey(ctx, []byte("missing"))
		require.NoError(t, err)
		require.Zero(t, res.Requeued)
	})
}

// A paused bucket is not drained, and resuming drains it; pausing a bucket
// a relay holds makes the relay release it.
func TestAdminPauseResume(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 2})
		admin := b.newAdmin(t)
		require.ErrorIs(t, admin.PauseBucket(ctx, 2), gormrelay.ErrInvalidRequest)
		require.ErrorIs(t, admin.PauseBucket(ctx, -1), gormrelay.ErrInvalidRequest)

		k0, k1 := keyInBucket(t, 0, 2), keyInBucket(t, 1, 2)
		paused, err := admin.BucketPaused(ctx, 0)
		require.NoError(t, err)
		require.False(t, paused, "no lease row yet")
		require.NoError(t, admin.PauseBucket(ctx, 0))
		paused, err = admin.BucketPaused(ctx, 0)
		require.NoError(t, err)
		require.True(t, paused)
		paused, err = admin.BucketPaused(ctx, 1)
		require.NoError(t, err)
		require.False(t, paused)
		_, err = admin.BucketPaused(ctx, 2)
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)
		b.insert(t, keyed([]string{k0, k1}, 3)...)
		rec := newRecorder()
		r := startRelay(t, b.store, rec.publisher("a", nil), b.relayConfig(t, "a"))

		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, len(b.ids(c, 1)) == 0) }, deliverWithin, 10*time.Millisecond)
		// Let the relay run several lease cycles: the paused bucket is
		// never claimed and keeps its messages.
		mark := time.Now().Add(3 * 200 * time.Millisecond).UnixMilli()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.True(c, func() bool {
				ls := b.leaseRows(c)
				return len(ls) == 2 && ls[1].ExpiresAtMs > mark+600
			}())
		}, deliverWithin, 10*time.Millisecond)
		require.Len(t, b.ids(t, 0), 3)
		// Bucket 1 only (on a busy machine its lease may lapse and come
		// back under a new term; bucket 0 is never claimed).
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			ls := r.Leases()
			if assert.Len(c, ls, 1) {
				assert.Equal(c, 1, ls[0].Bucket)
			}
		}, deliverWithin, 10*time.Millisecond)
		st, err := admin.Status(ctx)
		require.NoError(t, err)
		require.True(t, st.Buckets[0].Lease.Paused)
		require.False(t, st.Buckets[0].Lease.Held)
		require.EqualValues(t, 3, st.Buckets[0].Pending)

		require.NoError(t, admin.ResumeBucket(ctx, 0))
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, len(b.ids(c, 0)) == 0) }, deliverWithin, 10*time.Millisecond)
		requireOrdered(t, rec.acked())

		// Pausing a held bucket: the relay gives it up.
		require.NoError(t, admin.PauseBucket(ctx, 1))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.True(c, func() bool {
				ls := r.Leases()
				return len(ls) == 1 && ls[0].Bucket == 0 && b.leaseRows(c)[1].Owner == nil
			}())
		}, deliverWithin, 10*time.Millisecond)
		b.insert(t, outbox.MessageRow{MessageID: "late", Key: []byte(k1), Value: []byte(k1 + "/3")})
		mark = time.Now().Add(3 * 200 * time.Millisecond).UnixMilli()
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.True(c, b.leaseRows(c)[0].ExpiresAtMs > mark+600) }, deliverWithin, 10*time.Millisecond)
		require.Len(t, b.ids(t, 1), 1)
		require.NoError(t, admin.ResumeBucket(ctx, 1))
		b.requireDrained(t)
	})
}

func TestAdminStatusAndWatch(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 4})
		admin := b.newAdmin(t)
		admin = admin.WithLiveWindow(600 * time.Millisecond)

		st, err := admin.Status(ctx)
		require.NoError(t, err)
		require.Equal(t, 4, st.BucketCount)
		require.Len(t, st.Buckets, 4)
		require.Zero(t, st.Pending)
		require.Empty(t, st.Relays)

		wctx, cancel := context.WithCancel(ctx)
		stream := admin.Watch(wctx, 20*time.Millisecond)
		first := <-stream
		require.NoError(t, first.Err)
		require.Zero(t, first.Status.Pending)

		created := time.Now().Add(-time.Minute)
		b.insert(t, outbox.MessageRow{MessageID: "m", Key: []byte("k"), Value: []byte("v"), CreatedAtMs: created.UnixMilli()})
		b.insertDead(t, outbox.DeadLetterRow{ID: 77, Bucket: 2, State: "parked"})
		// A snapshot may fall between the two inserts: wait for one that
		// sees both.
		var snap gormrelay.Snapshot
		deadline := time.After(15 * time.Second)
	wait:
		for {
			select {
			case snap = <-stream:
				if snap.Err != nil || (snap.Status.Pending == 1 && snap.Status.DeadLetters.Parked == 1) {
					break wait
				}
			case <-deadline:
				t.Fatalf("no snapshot within 15 s saw the message and the dead letter; last: %+v", snap.Status)
			}
		}
		require.NoError(t, snap.Err)
		require.GreaterOrEqual(t, snap.Status.OldestAge(), time.Minute)
		require.Equal(t, gormrelay.DeadLetterCounts{Parked: 1}, snap.Status.DeadLetters)
		require.Equal(t, gormrelay.DeadLetterCounts{Parked: 1}, snap.Status.Buckets[2].DeadLetters)
		cancel()
		for range stream {
		}
		require.EqualValues(t, 1, b.count(t), "watching changes nothing")

		rec := newRecorder()
		startRelay(t, b.store, rec.publisher("r1", nil), b.relayConfig(t, "r1"))
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.True(c, func() bool {
				st, err = admin.Status(ctx)
				require.NoError(c, err)
				return st.LiveRelays == 1 && st.Pending == 0 && len(st.Relays) == 1 && st.Relays[0].Buckets == 4
			}())
		}, deliverWithin, 10*time.Millisecond)
		require.Equal(t, "r1", st.Relays[0].ID)
		for _, bs := range st.Buckets {
			require.Equal(t, "r1", bs.Lease.Owner)
			require.True(t, bs.Lease.Held)
			require.True(t, bs.Lease.ExpiresAt.After(st.SampledAt))
		}
		leases, err := admin.Leases(ctx)
		require.NoError(t, err)
		require.Len(t, leases, 4)
		relays, err := admin.Relays(ctx)
		require.NoError(t, err)
		require.Len(t, relays, 1)
		require.True(t, relays[0].Live)
	})
}

// AcquireLeases says which held buckets it gave up because they were
// paused and which because the relay held more than its fair share, for
// the relay's log.
func TestAcquireSaysWhyLeasesWereReleased(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 4})
		acquire := func(id string) relay.Acquired {
			t.Helper()
			res, err := b.store.AcquireLeases(ctx, relay.AcquireRequest{RelayID: id, BucketCount: 4, LeaseDuration: time.Minute})
			require.NoError(t, err)
			return res
		}
		buckets := func(res relay.Acquired) []int {
			var out []int
			for _, l := range res.Leases {
				out = append(out, l.Bucket)
			}
			return out
		}
		res := acquire("x")
		require.Equal(t, []int{0, 1, 2, 3}, buckets(res))
		require.Empty(t, res.Paused)
		require.Empty(t, res.AboveShare)

		require.NoError(t, b.newAdmin(t).PauseBucket(ctx, 2))
		res = acquire("x")
		require.Equal(t, []int{0, 1, 3}, buckets(res))
		require.Equal(t, []int{2}, res.Paused)
		require.Empty(t, res.AboveShare)

		require.Empty(t, acquire("y").Leases, "x's leases are unexpired")
		res = acquire("x")
		require.Equal(t, 2, res.FairShare)
		require.Equal(t, []int{0, 1}, buckets(res))
		require.Equal(t, []int{3}, res.AboveShare)
		require.Empty(t, res.Paused, "bucket 2 was not held")
	})
}
