package outboxtest_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/outboxtest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

type placed struct {
	ID    int     `json:"id"`
	Total float64 `json:"total"`
}

// setup registers an outbox plugin on a fresh database and migrates it.
func setup(t *testing.T, db *dbtest.DB) *outbox.Plugin {
	t.Helper()
	p, err := outbox.NewPlugin(outbox.Config{})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), db.DB))
	return p
}

// enqueueFour writes four messages in one transaction and runs check
// inside it before the commit.
func enqueueFour(t *testing.T, db *gorm.DB, p *outbox.Plugin, check func(tx *gorm.DB)) {
	t.Helper()
	two := int32(2)
	require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
		if err := p.EnqueueJSON(tx, "orders", []byte("order-1"), placed{ID: 1, Total: 10}, outbox.Header{Key: "tenant", Value: []byte("acme")}); err != nil {
			return err
		}
		if err := p.EnqueueJSON(tx, "orders", []byte("order-2"), placed{ID: 2, Total: 20.5}); err != nil {
			return err
		}
		if err := p.Enqueue(tx, &outbox.Message{Topic: "audit", Value: []byte("created")}); err != nil {
			return err
		}
		if err := p.Enqueue(tx, &outbox.Message{Topic: "audit", Key: []byte{}, Partition: &two, Value: nil}); err != nil {
			return err
		}
		check(tx)
		return nil
	}))
}

func TestAssertions(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		p := setup(t, db)
		enqueueFour(t, db.DB, p, func(tx *gorm.DB) {
			// The transaction sees what it enqueued before it commits.
			outboxtest.RequireEnqueued(t, tx, p, outboxtest.Want{Topic: "orders", Key: "order-1"})
			require.Len(t, outboxtest.Pending(t, tx, nil), 4)
		})

		msgs := outboxtest.Pending(t, db.DB, p)
		require.Len(t, msgs, 4)
		require.Equal(t, []string{"orders", "orders", "audit", "audit"}, []string{msgs[0].Topic, msgs[1].Topic, msgs[2].Topic, msgs[3].Topic})

		m := outboxtest.RequireEnqueued(t, db.DB, nil, outboxtest.Want{
			Topic:   "orders",
			Key:     "order-1",
			JSON:    placed{ID: 1, Total: 10},
			Headers: map[string]string{"tenant": "acme", "content-type": "application/json"},
		})
		require.Equal(t, msgs[0].MessageID, m.MessageID)
		var got placed
		require.NoError(t, m.DecodeJSON(&got))
		require.Equal(t, placed{ID: 1, Total: 10}, got)
		v, ok := m.Header("tenant")
		require.True(t, ok)
		require.Equal(t, "acme", v)

		// JSON compares decoded values: key order, spacing and number
		// spelling do not matter.
		outboxtest.RequireEnqueued(t, db.DB, p, outboxtest.Want{JSON: json.RawMessage(`{ "total": 2.05e1, "id": 2.0 }`)})
		outboxtest.RequireEnqueued(t, db.DB, p, outboxtest.Want{JSON: map[string]any{"id": 2, "total": 20.5}})
		// Keyless, empty key and pinned partition are told apart.
		audit := outboxtest.RequireEnqueued(t, db.DB, p, outboxtest.Want{Topic: "audit", Keyless: true})
		require.Equal(t, []byte("created"), audit.Value)
		two := int32(2)
		pinned := outboxtest.RequireEnqueued(t, db.DB, p, outboxtest.Want{Topic: "audit", Partition: &two})
		require.NotNil(t, pinned.Key)
		require.Empty(t, pinned.Key)
		require.Nil(t, pinned.Value)
		outboxtest.RequireEnqueued(t, db.DB, p, outboxtest.Want{Topic: "audit", Value: []byte("created")})

		outboxtest.RequireNotEnqueued(t, db.DB, p, outboxtest.Want{Topic: "payments"})
		outboxtest.RequireNotEnqueued(t, db.DB, p, outboxtest.Want{Topic: "orders", Key: "order-3"})

		many := outboxtest.RequireManyEnqueued(t, db.DB, p,
			outboxtest.Want{Topic: "orders", Key: "order-1"},
			outboxtest.Want{Topic: "orders", JSON: placed{ID: 2, Total: 20.5}},
		)
		require.Len(t, many, 2)

		// Drain publishes everything once, in enqueue order, and empties
		// the outbox.
		drained := outboxtest.Drain(t, db.DB, p)
		require.Len(t, drained, 4)
		for i := range msgs {
			require.Equal(t, msgs[i].MessageID, drained[i].MessageID)
			require.Equal(t, msgs[i].Value, drained[i].Value)
			require.Equal(t, msgs[i].Headers, drained[i].Headers)
		}
		require.Empty(t, outboxtest.Pending(t, db.DB, p))
		require.Empty(t, outboxtest.Drain(t, db.DB, p))

		// A rolled-back transaction leaves nothing.
		require.Error(t, db.DB.Transaction(func(tx *gorm.DB) error {
			if err := p.EnqueueJSON(tx, "orders", []byte("order-9"), placed{ID: 9}); err != nil {
				return err
			}
			outboxtest.RequireEnqueued(t, tx, p, outboxtest.Want{Key: "order-9"})
			return context.Canceled
		}))
		outboxtest.RequireNotEnqueued(t, db.DB, p, outboxtest.Want{Key: "order-9"})
	})
}

// End to end: the relay publishes through the Kafka publisher to the
// in-process broker, and the records read back carry the key, value,
// headers and message id.
func TestBroker(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	p := setup(t, db)
	broker := outboxtest.StartBroker(t, "orders")
	broker.CreateTopic(t, "payments", 3)

	require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
		if err := p.EnqueueJSON(tx, "orders", []byte("order-1"), placed{ID: 1}); err != nil {
			return err
		}
		if err := p.EnqueueJSON(tx, "orders", []byte("order-2"), placed{ID: 2}); err != nil {
			return err
		}
		return p.EnqueueJSON(tx, "payments", []byte("order-1"), placed{ID: 1, Total: 3})
	}))
	pending := outboxtest.Pending(t, db.DB, p)

	pub := publishertest.StartKafka(t, publisher.KafkaConfig{
		Brokers: broker.Brokers(),
		Configure: func(c *sarama.Config) error {
			c.Producer.Retry.Backoff = 10 * time.Millisecond
			c.Metadata.Retry.Backoff = 10 * time.Millisecond
			return nil
		},
		Logger: slog.New(slog.DiscardHandler),
	})
	store, err := gormrelay.NewStore(db.DB, p.Config())
	require.NoError(t, err)
	r, err := relay.New(store, pub, relay.Config{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	n, err := r.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 3, n)

	// Order is kept per key; two keys may be published in either order.
	recs := broker.Read(t, "orders", 2)
	require.Len(t, recs, 2)
	byKey := map[string]outboxtest.Message{}
	for _, m := range pending {
		byKey[m.Topic+"/"+string(m.Key)] = m
	}
	for _, rec := range recs {
		m := byKey["orders/"+string(rec.Key)]
		require.Equal(t, m.Value, rec.Value)
		id, ok := rec.Header(publisher.MessageIDHeaderDefault)
		require.True(t, ok)
		require.Equal(t, m.MessageID, id)
		ct, _ := rec.Header("content-type")
		require.Equal(t, "application/json", ct)
	}
	require.NotEqual(t, recs[0].Key, recs[1].Key)
	pay := broker.Read(t, "payments", 1)
	require.Len(t, pay, 1)
	require.Equal(t, publisher.KeyPartition([]byte("order-1"), 3), pay[0].Partition)
	require.Empty(t, outboxtest.Pending(t, db.DB, p))
}
