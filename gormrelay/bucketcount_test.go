package gormrelay_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// requireCountMismatch requires err to be the BucketCount
// misconfiguration of a lease table defining have buckets met by a relay
// with want.
func requireCountMismatch(t require.TestingT, err error, have, want int) {
	var me *relay.MisconfigurationError
	require.ErrorAs(t, err, &me)
	require.ErrorIs(t, err, relay.ErrMisconfigured)
	require.Equal(t, "BucketCount", me.Setting)
	require.Contains(t, me.Reason, "defines "+itoa(have)+" buckets")
	require.Contains(t, me.Reason, "BucketCount is "+itoa(want))
	require.Contains(t, me.Reason, "docs/operations.md")
}

func itoa(n int) string { return strconv.Itoa(n) }

// A relay whose BucketCount differs from the count the lease table
// defines refuses to start and writes nothing; the relays already running
// keep every lease. A user trial had a relay with 16 buckets start beside
// two with 8: it created lease rows 8..15, which stopped the right relays.
func TestLeaseTableDefinesBucketCount(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := t.Context()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 8})
		rec := newRecorder()
		ra := startRelay(t, b.store, rec.publisher("a", nil), fastConfig(t, "a"))
		rb := startRelay(t, b.store, rec.publisher("b", nil), fastConfig(t, "b"))
		held := func(c require.TestingT) {
			rows := b.leaseRows(t)
			require.Len(c, rows, 8)
			for _, r := range rows {
				require.NotNil(c, r.Owner, "bucket %d", r.Bucket)
				require.Contains(c, []string{"a", "b"}, *r.Owner, "bucket %d", r.Bucket)
			}
		}
		require.EventuallyWithT(t, func(c *assert.CollectT) { held(c) }, 10*time.Second, 10*time.Millisecond)

		for _, n := range []int{16, 4} {
			wrong, err := gormrelay.NewStore(db.DB, outbox.Config{BucketCount: n})
			require.NoError(t, err)
			cfg := fastConfig(t, "wrong")
			r, err := relay.New(wrong, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
				t.Error("a relay with the wrong BucketCount published")
				return 0, nil
			}), cfg)
			require.NoError(t, err)
			requireCountMismatch(t, r.Start(ctx), 8, n)
			// The store refuses the acquisition itself too, before its
			// heartbeat or a lease row.
			_, err = wrong.AcquireLeases(ctx, relay.AcquireRequest{RelayID: "wrong", BucketCount: n, LeaseDuration: time.Second})
			requireCountMismatch(t, err, 8, n)
			var beats int64
			require.NoError(t, db.DB.Table(b.cfg.Tables.RelaysTable()).Where("relay_id = ?", "wrong").Count(&beats).Error)
			require.Zero(t, beats, "heartbeat of the refused relay")
		}
		require.Len(t, b.leaseRows(t), 8, "no lease row beyond the count")

		// The running relays were not disturbed: they still run, hold
		// every bucket and deliver. They split the buckets four and four:
		// a bucket one gives up above its fair share (between its
		// batches, so possibly only after the delivery) has no owner
		// until the other's next acquisition.
		rows := b.insert(t, keyed(keysN(16), 2)...)
		requireAllDelivered(t, b, rec, rows)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			held(c)
			assert.Len(c, ra.Leases(), 4)
			assert.Len(c, rb.Leases(), 4)
		}, 10*time.Second, 10*time.Millisecond)
		for _, r := range []*relay.Relay{ra, rb} {
			select {
			case <-r.Stopped():
				t.Fatalf("a relay with the right count stopped: %v", r.Err())
			default:
			}
		}

		// The status read with another count says which count the lease
		// table defines and lists the rows beyond its own.
		small := &storeBundle{db: db, cfg: outbox.Config{BucketCount: 4}.WithDefaults()}
		st, err := small.newAdmin(t).Status(ctx)
		require.NoError(t, err)
		require.Equal(t, 8, st.LeaseBuckets)
		require.Len(t, st.Buckets, 4)
		require.Len(t, st.LeasesBeyond, 4)
		for i, l := range st.LeasesBeyond {
			require.Equal(t, 4+i, l.Bucket)
			require.True(t, l.Held)
		}
		// An admin with a larger count cannot create a row beyond the
		// table's.
		large := &storeBundle{db: db, cfg: outbox.Config{BucketCount: 16}.WithDefaults()}
		err = large.newAdmin(t).PauseBucket(ctx, 12)
		require.ErrorIs(t, err, gormrelay.ErrInvalidRequest)
		require.Contains(t, err.Error(), "bucket 12 outside 0..7")
		require.Len(t, b.leaseRows(t), 8)

		// The documented change of the count: stop every relay, delete
		// the lease rows, start the relays with the new count.
		stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		require.NoError(t, ra.Stop(stopCtx))
		require.NoError(t, rb.Stop(stopCtx))
		require.NoError(t, db.DB.Exec("DELETE FROM "+b.cfg.Tables.LeasesTable()).Error)
		b16 := &storeBundle{db: db, cfg: outbox.Config{BucketCount: 16}.WithDefaults()}
		b16.store, err = gormrelay.NewStore(db.DB, b16.cfg)
		require.NoError(t, err)
		r16 := startRelay(t, b16.store, rec.publisher("c", nil), fastConfig(t, "c"))
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Len(c, r16.Leases(), 16) }, 10*time.Second, 10*time.Millisecond)
		require.Len(t, b.leaseRows(t), 16)
	})
}

// Relays with different counts starting together on an empty lease
// table: the first to create the rows defines the count, the other is
// refused, and the table holds the rows of one count only.
func TestLeaseTableFirstStartOneCount(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := t.Context()
		for round := range 3 {
			cfg := outbox.Config{Tables: outbox.WithPrefix("first" + itoa(round) + "_")}.WithDefaults()
			require.NoError(t, cfg.Tables.AutoMigrate(ctx, db.DB))
			counts := []int{8, 16}
			stores := make([]*gormrelay.Store, len(counts))
			for i, n := range counts {
				c := cfg
				c.BucketCount = n
				s, err := gormrelay.NewStore(db.DB, c)
				require.NoError(t, err)
				stores[i] = s
			}
			errs := make([]error, len(counts))
			var wg sync.WaitGroup
			for i, n := range counts {
				wg.Go(func() {
					_, errs[i] = stores[i].AcquireLeases(ctx, relay.AcquireRequest{RelayID: "r" + itoa(n), BucketCount: n, LeaseDuration: time.Second})
				})
			}
			wg.Wait()
			// A relay whose insert met the other's uncommitted rows (SQLite:
			// a busy database) gets a transient error and retries.
			for i, n := range counts {
				if errs[i] != nil && !relay.IsMisconfiguration(errs[i]) {
					_, errs[i] = stores[i].AcquireLeases(ctx, relay.AcquireRequest{RelayID: "r" + itoa(n), BucketCount: n, LeaseDuration: time.Second})
				}
			}
			var rows []outbox.LeaseRow
			require.NoError(t, db.DB.Table(cfg.Tables.LeasesTable()).Order("bucket").Find(&rows).Error)
			defined := len(rows)
			require.Contains(t, counts, defined, "round %d", round)
			for i, r := range rows {
				require.EqualValues(t, i, r.Bucket)
			}
			for i, n := range counts {
				if n == defined {
					require.NoError(t, errs[i], "round %d: the relay whose count the table took", round)
				} else {
					requireCountMismatch(t, errs[i], defined, n)
				}
			}
			t.Logf("round %d: the table took %d buckets", round, defined)
		}
	})
}
