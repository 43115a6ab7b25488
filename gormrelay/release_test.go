package gormrelay_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// A relay stopping on a cancelled context gives up waiting for the
// statement in flight, but the database may still run it, after the
// relay's release. Neither a heartbeat nor a claim run that late holds
// anything back from the next relay: the heartbeat's update finds no row
// (the release deleted it) and brings no heartbeat back, and the claim
// names the terms the relay read before the release, which advanced
// them. The next relay counts itself alone and takes every bucket, at
// once, not after LeaseDuration.
func TestReleaseFencesLateStatements(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		const buckets = 8
		b := newStoreBundle(t, db, outbox.Config{BucketCount: buckets})
		req := func(id string) relay.AcquireRequest {
			return relay.AcquireRequest{RelayID: id, BucketCount: buckets, LeaseDuration: time.Minute}
		}
		a, err := b.store.AcquireLeases(t.Context(), req("a"))
		require.NoError(t, err)
		require.Len(t, a.Leases, buckets)

		require.NoError(t, b.store.ReleaseLeases(t.Context(), "a", a.Leases))
		beat, err := gormrelay.LateBeat(b.store, "a")
		require.NoError(t, err)
		require.Zero(t, beat, "a heartbeat run after the release brings no heartbeat back")
		// The buckets and terms a's acquisition read before the release:
		// the worst case, all of them, as free or expired.
		claimed, err := gormrelay.LateClaim(b.store, "a", a.Leases, time.Minute)
		require.NoError(t, err)
		require.Empty(t, claimed, "a claim run after the release claims nothing")

		next, err := b.store.AcquireLeases(t.Context(), req("b"))
		require.NoError(t, err)
		require.Equal(t, 1, next.LiveRelays)
		require.Len(t, next.Leases, buckets, "the next relay takes every bucket at once")
		for i, l := range next.Leases {
			require.Greater(t, l.Term, a.Leases[i].Term)
		}
	})
}
