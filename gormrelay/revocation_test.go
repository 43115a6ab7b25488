package gormrelay_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/relay"
)

// An operator's requeue advances the bucket's lease term under the relay
// that holds it. The relay stops publishing under the old term as for any
// lost lease, but says the lease was revoked by an operator, in its log
// and in outbox_lease_revocations_total, not as an expiry or takeover
// (outbox_lease_expirations_total, which the OutboxLeaseExpirations alert
// watches). A user trial saw both relays' alerts fire after a requeue.
func TestOperatorRevocationIsNotALeaseLoss(t *testing.T) {
	t.Parallel()
	const (
		revokedRenewal = "relay: leases revoked by an operator (a requeue, purge or discard of the bucket's dead letters advanced the lease term); the relay publishes them under the new term"
		revokedDelete  = "relay: lease revoked by an operator before delete; the rows are published again under the new term"
		revokedPublish = "relay: lease revoked by an operator during publish; the rest of the batch is published under the new term"
		lostRenewal    = "relay: leases lost at renewal"
		lostDelete     = "relay: lease lost before delete; the new owner publishes the rows again"
		lostPublish    = "relay: lease lost during publish; leaving the rest of the batch to the new owner"
	)
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := t.Context()
		b := newStoreBundle(t, db, outbox.Config{BucketCount: 1})
		b.insert(t, keyed([]string{"k", "j"}, 3)...)
		logger, records := dbtest.WatchLog(t, revokedRenewal, revokedDelete, revokedPublish, lostRenewal, lostDelete, lostPublish)
		collector, reg := newCollector(t, metrics.Config{Outbox: "orders"})
		policy, err := gormrelay.NewFailurePolicy(b.store, gormrelay.FailurePolicyConfig{Logger: logger})
		require.NoError(t, err)
		pois := newPoison(relay.Permanent(errors.New("rejected")), "k/0")
		rec := newRecorder()
		cfg := b.relayConfig(t, "a")
		cfg.Logger = logger
		cfg.Observer = collector
		cfg.FailureHandler = policy
		startRelay(t, b.store, rec.publisher("a", pois.hook), cfg)
		b.requireDrained(t)
		require.Equal(t, map[string]string{"k/0": "failed", "k/1": "parked", "k/2": "parked"}, deadValues(b.deadRows(t)))
		term := b.leaseRows(t)[0].Term

		pois.heal()
		res, err := b.newAdmin(t).RequeueKey(ctx, []byte("k"))
		require.NoError(t, err)
		require.EqualValues(t, 3, res.Requeued)
		require.Equal(t, term+1, b.leaseRows(t)[0].Term, "the requeue advanced the term")

		// The relay notices (at its renewal, or when its delete under the
		// old term is refused), takes the bucket again and delivers the
		// requeued messages in order.
		b.requireDrained(t)
		requireKeyOrder(t, ackedValues(rec), "k", 0, 1, 2)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.GreaterOrEqual(c, one(c, reg, metrics.NameLeaseRevocations), 1.0)
		}, 10*time.Second, 10*time.Millisecond)
		require.Zero(t, one(t, reg, metrics.NameLeaseExpirations), "a revocation is not an expiry")
		rows := b.leaseRows(t)
		require.Equal(t, "a", *rows[0].Owner, "nobody else took the bucket")

		var seen []string
		for len(records) > 0 {
			seen = append(seen, (<-records).Message)
		}
		require.NotEmpty(t, seen)
		for _, m := range seen {
			require.Contains(t, []string{revokedRenewal, revokedDelete, revokedPublish}, m)
		}
		t.Logf("lines: %q", seen)
	})
}
