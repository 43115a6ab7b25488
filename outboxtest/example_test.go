package outboxtest_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/outboxtest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Order is the service's model. Creating one publishes OrderPlaced.
type Order struct {
	ID       uint
	Customer string
	Total    int64
}

// OrderPlaced is the event.
type OrderPlaced struct {
	OrderID  uint   `json:"order_id"`
	Customer string `json:"customer"`
	Total    int64  `json:"total"`
}

// openService opens the service's database, a SQLite file in a temporary
// directory, with the outbox plugin and its publish rule, the way the
// service's main does. A test would call t.TempDir and t.Cleanup instead
// of returning a cleanup function.
func openService() (*gorm.DB, func()) {
	dir, err := os.MkdirTemp("", "outboxtest-example-")
	if err != nil {
		panic(err)
	}
	db, err := gorm.Open(sqlite.Open(filepath.Join(dir, "service.db")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		panic(err)
	}
	p, err := outbox.NewPlugin(outbox.Config{Rules: []outbox.Rule{
		outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			return outbox.JSONMessage("orders.placed", []byte(strconv.FormatUint(uint64(c.Entity.ID), 10)),
				OrderPlaced{OrderID: c.Entity.ID, Customer: c.Entity.Customer, Total: c.Entity.Total})
		}),
	}})
	if err != nil {
		panic(err)
	}
	if err := db.Use(p); err != nil {
		panic(err)
	}
	if err := p.AutoMigrate(context.Background(), db); err != nil {
		panic(err)
	}
	if err := db.AutoMigrate(&Order{}); err != nil {
		panic(err)
	}
	return db, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// placeOrder is the business operation under test.
func placeOrder(db *gorm.DB, customer string, total int64) *Order {
	o := &Order{Customer: customer, Total: total}
	if err := db.Create(o).Error; err != nil {
		panic(err)
	}
	return o
}

func ExampleRequireEnqueued() {
	// In a real test, t is the test's *testing.T.
	t := &testing.T{}
	db, cleanup := openService()
	defer cleanup()

	order := placeOrder(db, "ada", 1999)

	// nil: the only outbox plugin registered on db.
	msg := outboxtest.RequireEnqueued(t, db, nil, outboxtest.Want{
		Topic:   "orders.placed",
		Key:     strconv.FormatUint(uint64(order.ID), 10),
		JSON:    OrderPlaced{OrderID: order.ID, Customer: "ada", Total: 1999},
		Headers: map[string]string{"content-type": "application/json"},
	})
	outboxtest.RequireNotEnqueued(t, db, nil, outboxtest.Want{Topic: "orders.cancelled"})

	var event OrderPlaced
	if err := msg.DecodeJSON(&event); err != nil {
		panic(err)
	}
	fmt.Println(msg.Topic, string(msg.Key), event.Customer, event.Total)
	// Output:
	// orders.placed 1 ada 1999
}

func ExampleRequireManyEnqueued() {
	t := &testing.T{} // in a real test, the test's *testing.T
	db, cleanup := openService()
	defer cleanup()

	// Both orders and their events commit together or not at all.
	err := db.Transaction(func(tx *gorm.DB) error {
		placeOrder(tx, "ada", 1999)
		placeOrder(tx, "grace", 4200)
		// The transaction sees its own messages before it commits.
		outboxtest.RequireManyEnqueued(t, tx, nil,
			outboxtest.Want{Topic: "orders.placed", JSON: OrderPlaced{OrderID: 1, Customer: "ada", Total: 1999}},
			outboxtest.Want{Topic: "orders.placed", JSON: OrderPlaced{OrderID: 2, Customer: "grace", Total: 4200}},
		)
		return nil
	})
	if err != nil {
		panic(err)
	}

	msgs := outboxtest.RequireManyEnqueued(t, db, nil,
		outboxtest.Want{Topic: "orders.placed", Key: "1"},
		outboxtest.Want{Topic: "orders.placed", Key: "2"},
	)
	fmt.Println(len(msgs), "events, in enqueue order")
	// Output:
	// 2 events, in enqueue order
}

func ExamplePending() {
	t := &testing.T{} // in a real test, the test's *testing.T
	db, cleanup := openService()
	defer cleanup()

	placeOrder(db, "ada", 1999)
	placeOrder(db, "grace", 4200)

	for _, m := range outboxtest.Pending(t, db, nil) {
		fmt.Println(m)
	}
	// Output:
	// orders.placed key=1 value={"order_id":1,"customer":"ada","total":1999} content-type:application/json
	// orders.placed key=2 value={"order_id":2,"customer":"grace","total":4200} content-type:application/json
}

func ExampleDrain() {
	t := &testing.T{} // in a real test, the test's *testing.T
	db, cleanup := openService()
	defer cleanup()

	placeOrder(db, "ada", 1999)
	placeOrder(db, "grace", 4200)

	// The real relay store and DrainOnce, publishing into a recorder.
	for _, m := range outboxtest.Drain(t, db, nil) {
		fmt.Printf("published %s key=%s\n", m.Topic, m.Key)
	}
	fmt.Println("pending after drain:", len(outboxtest.Pending(t, db, nil)))
	// Output:
	// published orders.placed key=1
	// published orders.placed key=2
	// pending after drain: 0
}

func ExampleStartBroker() {
	t := &testing.T{} // in a real test, the test's *testing.T
	db, cleanup := openService()
	defer cleanup()

	// An in-process Kafka-protocol broker with the topic. In a real test
	// it stops at the end of the test; here Close stops it.
	broker := outboxtest.StartBroker(t, "orders.placed")
	defer broker.Close()

	placeOrder(db, "ada", 1999)

	// The service's relay, as in production, with the Kafka publisher.
	pub, err := publisher.NewKafka(publisher.KafkaConfig{
		Brokers: broker.Brokers(),
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		panic(err)
	}
	if err := pub.Start(context.Background()); err != nil { // connects to the broker
		panic(err)
	}
	defer pub.Close()
	p, err := outbox.Lookup(db, "")
	if err != nil {
		panic(err)
	}
	store, err := gormrelay.NewStore(db, p.Config())
	if err != nil {
		panic(err)
	}
	r, err := relay.New(store, pub, relay.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		panic(err)
	}
	if _, err := r.DrainOnce(context.Background()); err != nil {
		panic(err)
	}

	for _, rec := range broker.Read(t, "orders.placed", 1) {
		_, hasID := rec.Header(publisher.MessageIDHeaderDefault)
		fmt.Printf("%s key=%s value=%s message id header: %v\n", rec.Topic, rec.Key, rec.Value, hasID)
	}
	// Output:
	// orders.placed key=1 value={"order_id":1,"customer":"ada","total":1999} message id header: true
}
