package pgwal_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// ownedConfig is the configuration e.reader uses, for NewKafka.
func ownedConfig(t *testing.T, id string) pgwal.Config {
	return pgwal.Config{
		ReplicationDSN: dbtest.PostgresWALDSN(), RelayID: id,
		LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BatchSize: 20, BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
		Logger: dbtest.Logger(t),
	}
}

// dropSlotAtEnd drops r's slot and publication when the test ends.
func (e *env) dropSlotAtEnd(t *testing.T, r *pgwal.Reader) { e.dropSlotNamedAtEnd(t, r.Config().Slot) }

// dropSlotNamedAtEnd drops the slot and the publication named slot when
// the test ends.
func (e *env) dropSlotNamedAtEnd(t *testing.T, slot string) {
	t.Cleanup(func() {
		require.Eventually(t, func() bool {
			return e.db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ? AND NOT active", slot).Error == nil &&
				!slotExists(e.db.DB, slot)
		}, 30*time.Second, 50*time.Millisecond)
		_ = e.db.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})
}

// NewKafka's reader owns its publisher: NewKafka starts nothing, Run
// starts it (the messages reach Kafka), and once Run returned the
// publisher is stopped.
func TestNewKafkaOwnsThePublisher(t *testing.T) {
	e := setup(t)
	r, err := pgwal.NewKafka(e.db.DB, e.plugin, publisher.KafkaConfig{Brokers: e.kafka.Brokers(), Logger: dbtest.Logger(t)},
		ownedConfig(t, "owned"))
	require.NoError(t, err)
	k, ok := r.Publisher().(*publisher.Kafka)
	require.True(t, ok, "%T", r.Publisher())
	require.ErrorIs(t, k.CheckReady(t.Context()), publisher.ErrNotStarted, "NewKafka starts nothing")
	require.NoError(t, r.EnsureSlot(t.Context()))
	e.dropSlotAtEnd(t, r)

	stop := run(r)
	e.write(t, 3, 0, 10)
	e.checkDelivered(t, 3, 10)
	require.NoError(t, k.CheckReady(t.Context()), "started by Run")
	require.NoError(t, stop())
	select {
	case <-k.Stopped():
	default:
		t.Fatal("the publisher still runs after Run returned")
	}
	require.ErrorIs(t, k.CheckReady(t.Context()), publisher.ErrClosed)
	<-r.Stopped()
	require.NoError(t, r.Err())
}

// NewKafkaTransactional owns the strict-mode publisher the same way.
func TestNewKafkaTransactionalOwnsThePublisher(t *testing.T) {
	e := setup(t)
	r, err := pgwal.NewKafkaTransactional(e.db.DB, e.plugin, publisher.TransactionalConfig{
		Brokers: e.kafka.Brokers(), TransactionalIDPrefix: fmt.Sprintf("wal-owned-%d-", time.Now().UnixNano()), Logger: dbtest.Logger(t),
	}, ownedConfig(t, "owned-tx"))
	require.NoError(t, err)
	require.NoError(t, r.EnsureSlot(t.Context()))
	e.dropSlotAtEnd(t, r)
	stop := run(r)
	e.write(t, 2, 0, 6)
	require.Eventually(t, func() bool {
		return len(e.kafka.ReadLog(t, e.topic, 30*time.Second, kafkatest.ReadCommitted())) == 12
	}, 60*time.Second, 100*time.Millisecond)
	require.NoError(t, stop())
	tx := r.Publisher().(*publisher.Transactional)
	require.ErrorIs(t, tx.CheckReady(t.Context()), publisher.ErrClosed, "stopped after the reader")
}

// With no broker answering, Run fails at once with the publisher's
// error, before it takes the slot's lease; an invalid Kafka configuration
// is refused by NewKafka.
func TestNewKafkaRunWithoutBroker(t *testing.T) {
	e := setup(t)
	r, err := pgwal.NewKafka(e.db.DB, e.plugin, publisher.KafkaConfig{
		Brokers:   []string{kafkatest.RefusingAddr(t)},
		Configure: func(c *sarama.Config) error { c.Metadata.Retry.Max = 1; return nil },
	}, ownedConfig(t, "nobroker"))
	require.NoError(t, err)
	err = r.Run(t.Context())
	require.ErrorIs(t, err, sarama.ErrOutOfBrokers)
	require.ErrorContains(t, err, "pgwal: start the publisher")
	require.NoError(t, t.Context().Err(), "Run returned before its context ended")
	require.ErrorIs(t, r.Err(), sarama.ErrOutOfBrokers)
	require.False(t, slotExists(e.db.DB, r.Config().Slot), "nothing read: no slot created")

	_, err = pgwal.NewKafka(e.db.DB, e.plugin, publisher.KafkaConfig{}, ownedConfig(t, "x"))
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce, "no brokers")
}

// A reader that owns its publisher releases the slot's lease when its
// context ends, once the publisher closed, so the next reader need not
// wait for the lease to lapse; a reader whose publisher is the caller's
// keeps it: that publisher may still deliver what it was given.
func TestGracefulStopReleasesLease(t *testing.T) {
	e := setup(t)
	long := func(id string) pgwal.Config {
		cfg := ownedConfig(t, id)
		cfg.LeaseDuration = time.Minute // never lapses during the test
		return cfg
	}
	owned, err := pgwal.NewKafka(e.db.DB, e.plugin, publisher.KafkaConfig{Brokers: e.kafka.Brokers(), Logger: dbtest.Logger(t)}, long("owned"))
	require.NoError(t, err)
	require.NoError(t, owned.EnsureSlot(t.Context()))
	e.dropSlotAtEnd(t, owned)
	row := func() pgwal.SlotLease {
		var rows []pgwal.SlotLease
		require.NoError(t, e.db.Table(owned.Config().LeaseTable).Where("slot = ?", owned.Config().Slot).Find(&rows).Error)
		require.Len(t, rows, 1)
		return rows[0]
	}
	// lease returns the reader holding the lease, "" when it is free.
	lease := func() (owner string) {
		if r := row(); r.Owner != nil && r.ExpiresAtMs > time.Now().UnixMilli() {
			owner = *r.Owner
		}
		return owner
	}

	stop := run(owned)
	e.write(t, 2, 0, 5)
	e.checkDelivered(t, 2, 5)
	require.Equal(t, "owned", lease())
	require.NoError(t, stop())
	require.Empty(t, lease(), "released once the publisher closed")
	require.Equal(t, "owned", *row().Owner, "the released row names its last owner")

	caller, err := pgwal.New(e.db.DB, e.plugin, e.pub, long("caller"))
	require.NoError(t, err)
	stop = run(caller)
	require.Eventually(t, func() bool { return lease() == "caller" }, 30*time.Second, 20*time.Millisecond, "taken over at once")
	e.write(t, 2, 5, 10)
	e.checkDelivered(t, 2, 10)
	require.NoError(t, stop())
	require.Equal(t, "caller", lease(), "kept: the caller's publisher may still deliver")
}
