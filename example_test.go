package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/outboxtest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Bill is a business model of the examples.
type Bill struct {
	ID     uint64
	Amount int64
}

// BillIssued is the event a new bill publishes.
type BillIssued struct {
	ID     uint64 `json:"id"`
	Amount int64  `json:"amount"`
}

// openExampleDB opens a SQLite database in a temporary directory. A
// service opens its PostgreSQL or MySQL database the same way.
func openExampleDB() (*gorm.DB, func()) {
	dir, err := os.MkdirTemp("", "outbox-example-")
	if err != nil {
		panic(err)
	}
	db, err := gorm.Open(sqlite.Open(filepath.Join(dir, "app.db")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		panic(err)
	}
	return db, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// printPending prints the rows waiting in the messages table.
func printPending(db *gorm.DB, p *outbox.Plugin) {
	var rows []outbox.MessageRow
	if err := db.Table(p.Config().Tables.MessagesTable()).Order("id").Find(&rows).Error; err != nil {
		panic(err)
	}
	for _, r := range rows {
		fmt.Printf("pending: topic=%s key=%s value=%s\n", r.Topic, r.Key, r.Value)
	}
}

// The core flow: a publish rule turns every created bill into an
// BillIssued message, written in the same transaction as the invoice.
func Example() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()

	p, err := outbox.NewPlugin(outbox.Config{Rules: []outbox.Rule{
		outbox.OnCreate(func(c outbox.Change[*Bill]) (*outbox.Message, error) {
			return outbox.JSONMessage("bills", []byte(strconv.FormatUint(c.Entity.ID, 10)),
				BillIssued{ID: c.Entity.ID, Amount: c.Entity.Amount})
		}),
	}})
	if err != nil {
		panic(err)
	}
	if err := db.Use(p); err != nil { // right after gorm.Open
		panic(err)
	}
	if err := p.AutoMigrate(ctx, db); err != nil { // the outbox tables
		panic(err)
	}
	if err := db.AutoMigrate(&Bill{}); err != nil {
		panic(err)
	}

	// The bill and its message commit together, or not at all.
	if err := db.Create(&Bill{Amount: 4200}).Error; err != nil {
		panic(err)
	}
	printPending(db, p)
	// Output:
	// pending: topic=bills key=1 value={"id":1,"amount":4200}
}

// Enqueue writes a message inside the caller's transaction: it is stored
// when the transaction commits and gone when it rolls back.
func ExampleEnqueue() {
	db, cleanup := openExampleDB()
	defer cleanup()
	p, err := outbox.NewPlugin(outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := db.Use(p); err != nil {
		panic(err)
	}
	if err := p.AutoMigrate(context.Background(), db); err != nil {
		panic(err)
	}

	err = db.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "payments", Key: []byte("order-7"), Value: []byte("captured")})
	})
	fmt.Println("committed:", err)

	err = db.Transaction(func(tx *gorm.DB) error {
		if err := outbox.Enqueue(tx, &outbox.Message{Topic: "payments", Key: []byte("order-8"), Value: []byte("captured")}); err != nil {
			return err
		}
		return fmt.Errorf("card declined") // rolls the message back with the business write
	})
	fmt.Println("rolled back:", err)

	// Outside a transaction nothing is written.
	err = outbox.Enqueue(db, &outbox.Message{Topic: "payments", Value: []byte("x")})
	fmt.Println("no transaction:", errors.Is(err, outbox.ErrNoTransaction))

	printPending(db, p)
	// Output:
	// committed: <nil>
	// rolled back: card declined
	// no transaction: true
	// pending: topic=payments key=order-7 value=captured
}

// A relay publishes the committed messages to Kafka through the Kafka
// publisher and deletes each one once the broker acknowledged it. Here the
// broker is the in-process Kafka-protocol broker of outboxtest; a service
// passes its cluster's addresses instead.
func Example_relay() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()
	p, err := outbox.NewPlugin(outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := db.Use(p); err != nil {
		panic(err)
	}
	if err := p.AutoMigrate(ctx, db); err != nil {
		panic(err)
	}
	// Two events of one order: same key, so the same bucket and partition,
	// published in the order they were committed.
	for _, status := range []string{"placed", "paid"} {
		if err := db.Transaction(func(tx *gorm.DB) error {
			return outbox.EnqueueJSON(tx, "orders", []byte("order-7"), map[string]string{"status": status})
		}); err != nil {
			panic(err)
		}
	}

	broker, err := outboxtest.NewBroker("orders")
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	quiet := slog.New(slog.DiscardHandler)
	pub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: broker.Brokers(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	if err := pub.Start(context.Background()); err != nil { // connects to the broker
		panic(err)
	}
	defer pub.Close()
	store, err := gormrelay.NewStore(db, p.Config())
	if err != nil {
		panic(err)
	}
	r, err := relay.New(store, pub, relay.Config{Hints: p.Notifier(), Logger: quiet})
	if err != nil {
		panic(err)
	}
	// DrainOnce publishes everything pending and returns; a service calls
	// r.Start(ctx) instead and r.Stop(ctx) on shutdown.
	n, err := r.DrainOnce(ctx)
	fmt.Println("published:", n, err)
	printPending(db, p) // nothing: acknowledged rows are deleted

	readCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	records, err := broker.ReadContext(readCtx, "orders", 2)
	if err != nil {
		panic(err)
	}
	for _, rec := range records {
		_, hasID := rec.Header(publisher.MessageIDHeaderDefault)
		fmt.Printf("kafka: key=%s value=%s message id header: %v\n", rec.Key, rec.Value, hasID)
	}
	// Output:
	// published: 2 <nil>
	// kafka: key=order-7 value={"status":"placed"} message id header: true
	// kafka: key=order-7 value={"status":"paid"} message id header: true
}
