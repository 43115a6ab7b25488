package gormrelay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
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

// storeBundle is one outbox on an isolated test database.
type storeBundle struct {
	db    *dbtest.DB
	cfg   outbox.Config
	store *gormrelay.Store
}

// newStoreBundle migrates the outbox tables of cfg and opens its store.
func newStoreBundle(t testing.TB, db *dbtest.DB, cfg outbox.Config) *storeBundle {
	t.Helper()
	cfg = cfg.WithDefaults()
	require.NoError(t, cfg.Tables.AutoMigrate(context.Background(), db.DB))
	store, err := gormrelay.NewStore(db.DB, cfg)
	require.NoError(t, err)
	return &storeBundle{db: db, cfg: cfg, store: store}
}

// newAdmin returns the admin API over the bundle's database and config.
func (b *storeBundle) newAdmin(t testing.TB) *gormrelay.Admin {
	t.Helper()
	admin, err := gormrelay.NewAdmin(b.db.DB, b.cfg)
	require.NoError(t, err)
	return admin
}

func (b *storeBundle) messages() *gorm.DB {
	return b.db.DB.Table(b.cfg.Tables.MessagesTable())
}

// insert writes rows directly, as the write side would inside a
// transaction, filling in the message id, bucket and creation time.
func (b *storeBundle) insert(t testing.TB, rows ...outbox.MessageRow) []outbox.MessageRow {
	t.Helper()
	b.fill(rows)
	require.NoError(t, b.messages().CreateInBatches(rows, 500).Error)
	return rows
}

// fill sets the message id, topic, bucket and creation time of rows that
// leave them zero.
func (b *storeBundle) fill(rows []outbox.MessageRow) {
	for i := range rows {
		r := &rows[i]
		if r.MessageID == "" {
			r.MessageID = fmt.Sprintf("m-%d-%d", time.Now().UnixNano(), i)
		}
		if r.Topic == "" {
			r.Topic = "events"
		}
		if r.Bucket == 0 {
			r.Bucket = int32(outbox.Bucket(r.Key, r.Partition, r.MessageID, b.cfg.BucketCount))
		}
		if r.CreatedAtMs == 0 {
			r.CreatedAtMs = time.Now().UnixMilli()
		}
	}
}

// helper marks the caller as a test helper when t is a *testing.T (not an
// *assert.CollectT inside an EventuallyWithT condition).
func helper(t require.TestingT) {
	if h, ok := t.(interface{ Helper() }); ok {
		h.Helper()
	}
}

// keyed returns perKey rows for each key, interleaved by sequence, with
// the value "key/seq".
func keyed(keys []string, perKey int) []outbox.MessageRow {
	var rows []outbox.MessageRow
	for seq := range perKey {
		for _, k := range keys {
			rows = append(rows, outbox.MessageRow{
				MessageID: fmt.Sprintf("%s-%d", k, seq),
				Key:       []byte(k),
				Value:     fmt.Appendf(nil, "%s/%d", k, seq),
			})
		}
	}
	return rows
}

func keysN(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("key-%d", i)
	}
	return keys
}

// keyInBucket returns a key that hashes to bucket.
func keyInBucket(t testing.TB, bucket, n int) string {
	t.Helper()
	return prefixedKeyInBucket(t, "k", bucket, n)
}

// prefixedKeyInBucket returns a key starting with prefix that hashes to
// bucket.
func prefixedKeyInBucket(t testing.TB, prefix string, bucket, n int) string {
	t.Helper()
	for i := range 10_000 {
		k := fmt.Sprintf("%s%d", prefix, i)
		if outbox.Bucket([]byte(k), nil, "", n) == bucket {
			return k
		}
	}
	t.Fatalf("no key for bucket %d", bucket)
	return ""
}

func (b *storeBundle) count(t require.TestingT) int64 {
	helper(t)
	var n int64
	require.NoError(t, b.messages().Count(&n).Error)
	return n
}

// requireDrained waits until the outbox holds no message. Its deadline,
// deliverWithin, is against a hung test, not a speed check: a busy
// machine's databases stall for seconds.
func (b *storeBundle) requireDrained(t *testing.T, msgAndArgs ...any) {
	t.Helper()
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Zero(c, b.count(c)) }, deliverWithin, 10*time.Millisecond, msgAndArgs...)
}

func (b *storeBundle) ids(t require.TestingT, bucket int) []int64 {
	helper(t)
	var ids []int64
	require.NoError(t, b.messages().Where("bucket = ?", bucket).Order("id").Pluck("id", &ids).Error)
	return ids
}

func (b *storeBundle) leaseRows(t require.TestingT) []outbox.LeaseRow {
	helper(t)
	var rows []outbox.LeaseRow
	require.NoError(t, b.db.DB.Table(b.cfg.Tables.LeasesTable()).Order("bucket").Find(&rows).Error)
	return rows
}

func acquire(t testing.TB, s *gormrelay.Store, id string, buckets int, d time.Duration) relay.Acquired {
	t.Helper()
	res, err := s.AcquireLeases(context.Background(), relay.AcquireRequest{RelayID: id, BucketCount: buckets, LeaseDuration: d})
	require.NoError(t, err)
	return res
}

func leaseBuckets(ls []relay.Lease) []int {
	out := make([]int, len(ls))
	for i, l := range ls {
		out[i] = l.Bucket
	}
	return out
}

func TestStoreLeasesFairShare(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		b := newStoreBundle(t, db, outbox.Config{})

		// Alone, a relay takes every bucket, each under term 1.
		a := acquire(t, b.store, "a", 8, time.Minute)
		require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, leaseBuckets(a.Leases))
		require.Equal(t, 1, a.LiveRelays)
		for _, l := range a.Leases {
			require.EqualValues(t, 1, l.Term)
		}

		// A newcomer counts two live relays but finds nothing free.
		bb := acquire(t, b.store, "b", 8, time.Minute)
		require.Empty(t, bb.Leases)
		require.Equal(t, 2, bb.LiveRelays)
		require.Equal(t, 4, bb.FairShare)
		// It is told what it waits for: the incumbent's surplus, with the
		// expiry of each lease.
		require.Len(t, bb.Waiting, 8)
		for _, h := range bb.Waiting {
			require.Equal(t, "a", h.Owner)
			require.WithinDuration(t, time.Now().Add(time.Minute), h.ExpiresAt, 30*time.Second)
		}

		// The incumbent gives back its surplus, the newcomer takes it under
		// a new term.
		a = acquire(t, b.store, "a", 8, time.Minute)
		require.Equal(t, []int{0, 1, 2, 3}, leaseBuckets(a.Leases))
		bb = acquire(t, b.store, "b", 8, time.Minute)
		require.Equal(t, []int{4, 5, 6, 7}, leaseBuckets(bb.Leases))
		require.Empty(t, bb.Waiting)
		for _, l := range bb.Leases {
			require.EqualValues(t, 2, l.Term)
		}

		// Renewal keeps the terms.
		a2 := acquire(t, b.store, "a", 8, time.Minute)
		require.Equal(t, a.Leases, a2.Leases)

		// Releasing hands over at the next acquisition; the heartbeat goes.
		require.NoError(t, b.store.ReleaseLeases(context.Background(), "a", a.Leases))
		bb = acquire(t, b.store, "b", 8, time.Minute)
		require.Equal(t, 1, bb.LiveRelays)
		require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, leaseBuckets(bb.Leases))

		// Renewing through the capability keeps everything.
		held, err := b.store.RenewLeases(context.Background(), "b", bb.Leases, time.Minute)
		require.NoError(t, err)
		require.Equal(t, bb.Leases, held)
		// Twice within a millisecond is still a success (MySQL reports the
		// unchanged rows as unaffected).
		held, err = b.store.RenewLeases(context.Background(), "b", bb.Leases, time.Minute)
		require.NoError(t, err)
		require.Equal(t, bb.Leases, held)

		// A paused bucket is given up and not claimed again.
		require.NoError(t, db.DB.Table(b.cfg.Tables.LeasesTable()).Where("bucket = ?", 7).Update("paused", true).Error)
		bb = acquire(t, b.store, "b", 8, time.Minute)
		require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6}, leaseBuckets(bb.Leases))
		require.Nil(t, b.leaseRows(t)[7].Owner)
		bb = acquire(t, b.store, "b", 8, time.Minute)
		require.Len(t, bb.Leases, 7)
	})
}

// A relay whose lease expired and was taken over, or that released and
// re-acquired a bucket, can neither delete nor renew under its old term.
func TestStoreTermGuard(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t, keyed([]string{"x"}, 4)...)

		// a holds the only bucket briefly and reads a batch.
		a := acquire(t, b.store, "a", 1, 30*time.Millisecond)
		require.Len(t, a.Leases, 1)
		staleLease := a.Leases[0]
		batch, err := b.store.NextBatch(ctx, 0, 2)
		require.NoError(t, err)
		require.Len(t, batch, 2)

		// Expired, not yet taken: refused.
		deadline := time.Now().Add(30 * time.Millisecond)
		require.Eventually(t, func() bool { return time.Now().After(deadline) }, time.Second, 5*time.Millisecond)
		err = b.store.MarkPublished(ctx, "a", staleLease, batch)
		require.ErrorIs(t, err, relay.ErrLeaseLost)

		// b takes it over under the next term.
		bb := acquire(t, b.store, "b", 1, time.Minute)
		require.Equal(t, []relay.Lease{{Bucket: 0, Term: staleLease.Term + 1}}, bb.Leases)

		// a's delete and renewal are refused and change nothing.
		err = b.store.MarkPublished(ctx, "a", staleLease, batch)
		require.ErrorIs(t, err, relay.ErrLeaseLost)
		require.EqualValues(t, 4, b.count(t))
		held, err := b.store.RenewLeases(ctx, "a", []relay.Lease{staleLease}, time.Minute)
		require.NoError(t, err)
		require.Empty(t, held)
		err = b.store.RecordFailure(ctx, "a", staleLease, batch[0], errors.New("boom"))
		require.ErrorIs(t, err, relay.ErrLeaseLost)
		require.Equal(t, []outbox.LeaseRow{{Bucket: 0, Owner: ptr("b"), Term: staleLease.Term + 1, ExpiresAtMs: b.leaseRows(t)[0].ExpiresAtMs}}, b.leaseRows(t))

		// Even the owner's own old term is refused after it released and
		// re-acquired the bucket.
		require.NoError(t, b.store.ReleaseLeases(ctx, "b", bb.Leases))
		again := acquire(t, b.store, "b", 1, time.Minute)
		require.Greater(t, again.Leases[0].Term, bb.Leases[0].Term, "a later term (the release advanced it, the claim again)")
		err = b.store.MarkPublished(ctx, "b", bb.Leases[0], batch)
		require.ErrorIs(t, err, relay.ErrLeaseLost)
		require.EqualValues(t, 4, b.count(t))

		// The current term deletes exactly the listed rows.
		require.NoError(t, b.store.MarkPublished(ctx, "b", again.Leases[0], batch))
		require.EqualValues(t, 2, b.count(t))
		// Deleting rows already gone is not an error.
		require.NoError(t, b.store.MarkPublished(ctx, "b", again.Leases[0], batch))
	})
}

func ptr[T any](v T) *T { return &v }

// A relay's acquisition and its renewal run concurrently, and their
// statements may reach the database in either order. A renewal never
// shortens a lease, and one that finds a lease lost still reports the
// leases the relay holds when a renewal of its own moved their expiry
// further between its update and its read-back.
func TestStoreRenewConcurrentWithRenewal(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 2})
		a := acquire(t, b.store, "a", 2, time.Minute)
		require.Len(t, a.Leases, 2)
		leases := b.cfg.Tables.LeasesTable()

		// A later, shorter renewal leaves the expiry where it was.
		before := b.leaseRows(t)
		held, err := b.store.RenewLeases(ctx, "a", a.Leases, time.Second)
		require.NoError(t, err)
		require.Equal(t, a.Leases, held)
		for i, r := range b.leaseRows(t) {
			require.Equal(t, before[i].ExpiresAtMs, r.ExpiresAtMs, "bucket %d: the expiry never moves back", r.Bucket)
		}

		// Bucket 1 is taken over; right after a's renewal updates the
		// rows, a concurrent renewal of a's moves bucket 0's expiry on.
		require.NoError(t, b.db.DB.Table(leases).Where("bucket = ?", 1).Update("owner", "z").Error)
		var bumped atomic.Bool
		require.NoError(t, db.DB.Callback().Raw().After("gorm:raw").Register("test:concurrent_renewal", func(tx *gorm.DB) {
			sql := tx.Statement.SQL.String()
			if !strings.HasPrefix(sql, "UPDATE") || !strings.Contains(sql, leases) || !strings.Contains(sql, "SET expires_at_ms") || bumped.Swap(true) {
				return
			}
			tx.Session(&gorm.Session{NewDB: true}).Table(leases).Where("bucket = ?", 0).
				Update("expires_at_ms", gorm.Expr("expires_at_ms + ?", 5000))
		}))
		held, err = b.store.RenewLeases(ctx, "a", a.Leases, 2*time.Minute)
		require.NoError(t, err)
		require.True(t, bumped.Load())
		require.Equal(t, a.Leases[:1], held, "bucket 0 is still a's; bucket 1 is lost")
	})
}

// Discovery over more buckets than one statement of probes holds on
// MySQL/MariaDB and SQLite; PostgreSQL takes them all as one array.
func TestStorePendingManyBuckets(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 300})
		for _, bucket := range []int32{1, 128, 129, 299} {
			b.insert(t, outbox.MessageRow{Bucket: bucket, Value: []byte("x")})
		}
		all := make([]int, 300)
		for i := range all {
			all[i] = i
		}
		pending, err := b.store.PendingBuckets(ctx, all)
		require.NoError(t, err)
		require.Equal(t, []int{1, 128, 129, 299}, pending)
		pending, err = b.store.PendingBuckets(ctx, []int{299, 5, 128})
		require.NoError(t, err)
		require.Equal(t, []int{128, 299}, pending)
	})
}

func TestStoreBatches(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{})
		part := int32(5)
		hdrs := []outbox.Header{{Key: "trace", Value: []byte("abc")}, {Key: "empty", Value: []byte{}}, {Key: "nil"}}
		rows := b.insert(t,
			outbox.MessageRow{MessageID: "m1", Bucket: 3, Key: []byte("k"), Value: []byte("v1"), Headers: outbox.EncodeHeaders(hdrs), CreatedAtMs: 1700000000123},
			outbox.MessageRow{MessageID: "m2", Bucket: 3, Key: []byte{}, Value: nil, Partition: &part},
			outbox.MessageRow{MessageID: "m3", Bucket: 3, Key: nil, Value: []byte("v3")},
			outbox.MessageRow{MessageID: "m4", Bucket: 6, Key: []byte("k"), Value: []byte("v4")},
		)

		pending, err := b.store.PendingBuckets(ctx, []int{0, 1, 2, 3, 4, 5, 6, 7})
		require.NoError(t, err)
		require.Equal(t, []int{3, 6}, pending)
		pending, err = b.store.PendingBuckets(ctx, []int{0, 6})
		require.NoError(t, err)
		require.Equal(t, []int{6}, pending)

		batch, err := b.store.NextBatch(ctx, 3, 2)
		require.NoError(t, err)
		require.Len(t, batch, 2)
		m := batch[0]
		require.Equal(t, rows[0].ID, m.ID)
		require.Equal(t, "m1", m.MessageID)
		require.Equal(t, 3, m.Bucket)
		require.Equal(t, "events", m.Topic)
		require.Equal(t, []byte("k"), m.Key)
		require.Equal(t, []byte("v1"), m.Value)
		require.Equal(t, hdrs, m.Headers)
		require.Nil(t, m.Partition)
		require.Equal(t, time.UnixMilli(1700000000123), m.CreatedAt)
		require.Zero(t, m.Attempts)
		m = batch[1]
		require.Equal(t, "m2", m.MessageID)
		require.NotNil(t, m.Key)
		require.Empty(t, m.Key)
		require.Nil(t, m.Value)
		require.Equal(t, &part, m.Partition)
		require.Nil(t, m.Headers)

		all, err := b.store.NextBatch(ctx, 3, 10)
		require.NoError(t, err)
		require.Len(t, all, 3)
		require.Nil(t, all[2].Key, "nil key stays nil")

		// A transaction that took its id earlier but committed later shows
		// up below the rows already read: the next read starts with it, and
		// deleting the published ids leaves it alone.
		lease := acquire(t, b.store, "a", 8, time.Minute).Leases[3]
		late := rows[0].ID - 1
		if late < 1 {
			require.NoError(t, b.store.MarkPublished(ctx, "a", lease, batch[:1]))
			batch = batch[1:]
			late = rows[0].ID
		}
		b.insert(t, outbox.MessageRow{ID: late, MessageID: "late", Bucket: 3, Value: []byte("late")})
		require.NoError(t, b.store.MarkPublished(ctx, "a", lease, batch))
		next, err := b.store.NextBatch(ctx, 3, 10)
		require.NoError(t, err)
		require.Equal(t, []string{"late", "m3"}, []string{next[0].MessageID, next[1].MessageID})

		// A failure is recorded on the row.
		require.NoError(t, b.store.RecordFailure(ctx, "a", lease, next[0], errors.New("broker said no")))
		next, err = b.store.NextBatch(ctx, 3, 1)
		require.NoError(t, err)
		require.Equal(t, 1, next[0].Attempts)
		var row outbox.MessageRow
		require.NoError(t, b.messages().Where("id = ?", next[0].ID).Take(&row).Error)
		require.Equal(t, "broker said no", *row.LastError)
	})
}

func TestStoreMisconfiguration(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()

		// Before AutoMigrate: a clear error naming the table.
		cfg := outbox.Config{Tables: outbox.WithPrefix("none_")}
		s, err := gormrelay.NewStore(db.DB, cfg)
		require.NoError(t, err)
		_, err = s.AcquireLeases(ctx, relay.AcquireRequest{RelayID: "a", BucketCount: 8, LeaseDuration: time.Second})
		var me *relay.MisconfigurationError
		require.ErrorAs(t, err, &me)
		require.Equal(t, "Tables", me.Setting)
		require.Contains(t, me.Error(), "none_outbox_")
		require.ErrorIs(t, err, relay.ErrMisconfigured)

		b := newStoreBundle(t, db, outbox.Config{})
		// Relay and store disagree on the bucket count.
		_, err = b.store.AcquireLeases(ctx, relay.AcquireRequest{RelayID: "a", BucketCount: 16, LeaseDuration: time.Second})
		require.ErrorAs(t, err, &me)
		require.Equal(t, "BucketCount", me.Setting)

		// A writer with a larger bucket count.
		b.insert(t, outbox.MessageRow{Bucket: 11, Value: []byte("x")})
		_, err = b.store.AcquireLeases(ctx, relay.AcquireRequest{RelayID: "a", BucketCount: 8, LeaseDuration: time.Second})
		require.ErrorAs(t, err, &me)
		require.Contains(t, me.Reason, "bucket 11")
		// Discovery notices it in the same round trip as its probes, for
		// any set of owned buckets, none included.
		b.insert(t, outbox.MessageRow{Bucket: 2, Value: []byte("x")})
		for _, owned := range [][]int{{0, 1, 2, 3, 4, 5, 6, 7}, {2}, nil} {
			pending, err := b.store.PendingBuckets(ctx, owned)
			require.ErrorAs(t, err, &me, "owned %v", owned)
			require.Equal(t, "BucketCount", me.Setting)
			require.Contains(t, me.Reason, "bucket 11")
			require.Nil(t, pending)
		}

		// Invalid table names never reach SQL.
		_, err = gormrelay.NewStore(db.DB, outbox.Config{Tables: outbox.Tables{Messages: "x; DROP TABLE y"}})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	})
}

// Schema-qualified table names are quoted part by part in every statement.
func TestStoreSchemaQualified(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		if db.Dialect == dbtest.SQLite {
			t.Skip("SQLite has no schemas besides attached databases")
		}
		ctx := context.Background()
		b := newStoreBundle(t, db, outbox.Config{Tables: outbox.Tables{Schema: db.Namespace, Messages: "Msgs"}, BucketCount: 2})
		require.Contains(t, b.cfg.Tables.MessagesTable(), db.Namespace+".")
		b.insert(t, keyed([]string{"a", "b", "c"}, 2)...)
		leases := acquire(t, b.store, "r", 2, time.Minute).Leases
		require.Len(t, leases, 2)
		pending, err := b.store.PendingBuckets(ctx, []int{0, 1})
		require.NoError(t, err)
		for _, bucket := range pending {
			batch, err := b.store.NextBatch(ctx, bucket, 10)
			require.NoError(t, err)
			require.NoError(t, b.store.RecordFailure(ctx, "r", leases[bucket], batch[0], errors.New("x")))
			require.NoError(t, b.store.MarkPublished(ctx, "r", leases[bucket], batch))
		}
		require.Zero(t, b.count(t))
		_, err = b.store.RenewLeases(ctx, "r", leases, time.Minute)
		require.NoError(t, err)
		require.NoError(t, b.store.ReleaseLeases(ctx, "r", leases))
	})
}

// StoreConfig.Timeout bounds the store's operations: an acquisition
// blocked on a lease row another transaction locked fails with the
// configured bound in its error, not the default's.
func TestStoreConfigTimeout(t *testing.T) {
	t.Parallel()
	b := newStoreBundle(t, dbtest.Open(t, dbtest.Postgres), outbox.Config{BucketCount: 2})
	db, cfg := b.db, b.cfg
	req := relay.AcquireRequest{RelayID: "a", BucketCount: 2, LeaseDuration: time.Minute}
	_, err := b.store.AcquireLeases(t.Context(), req) // creates the lease rows
	require.NoError(t, err)
	store, err := gormrelay.NewStore(db.DB, cfg, gormrelay.StoreConfig{Timeout: 2 * time.Second})
	require.NoError(t, err)
	require.NoError(t, store.CheckStart(t.Context(), 2)) // the schema check, done once per store

	tx := db.DB.Begin()
	require.NoError(t, tx.Error)
	defer tx.Rollback()
	var buckets []int
	require.NoError(t, tx.Raw("SELECT bucket FROM "+cfg.Tables.LeasesTable()+" FOR UPDATE").Scan(&buckets).Error)
	require.Len(t, buckets, 2)

	_, err = store.AcquireLeases(t.Context(), req)
	require.ErrorContains(t, err, "outbox: store acquire leases: timed out after 2s")
	require.False(t, relay.IsMisconfiguration(err), "a timeout is retried, not a misconfiguration")
}

// A StoreConfig value out of range is refused with a *relay.ConfigError
// naming the field; the zero value takes the default.
func TestStoreConfigValidation(t *testing.T) {
	t.Parallel()
	require.Equal(t, gormrelay.StoreTimeoutDefault, gormrelay.StoreConfig{}.WithDefaults().Timeout)
	require.Equal(t, time.Second, gormrelay.StoreConfig{Timeout: time.Second}.WithDefaults().Timeout)
	db := dbtest.Open(t, dbtest.SQLite)
	for name, scs := range map[string][]gormrelay.StoreConfig{
		"StoreConfig.Timeout": {{Timeout: -time.Second}},
		"storeCfg":            {{}, {}},
	} {
		_, err := gormrelay.NewStore(db.DB, outbox.Config{}, scs...)
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, name)
		require.Equal(t, name, ce.Field)
	}
}
