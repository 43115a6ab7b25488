package inbox_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
)

// Payment is the consumer's business row.
type Payment struct {
	ID      int64 `gorm:"primaryKey"`
	OrderID string
}

// Consume and publish in one call: the handler writes a payment and
// enqueues a payment event through the outbox, in the transaction that
// records the order event's message id. The redelivered record is
// skipped: one payment, one event.
func Example() {
	dir, _ := os.MkdirTemp("", "inbox-example")
	defer os.RemoveAll(dir)
	db, err := gorm.Open(sqlite.Open(filepath.Join(dir, "payments.db")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	p, err := outbox.NewPlugin(outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := db.Use(p); err != nil {
		panic(err)
	}
	ib, err := inbox.New(db, inbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := p.AutoMigrate(ctx, db); err != nil {
		panic(err)
	}
	if err := ib.AutoMigrate(ctx); err != nil {
		panic(err)
	}
	if err := db.AutoMigrate(&Payment{}); err != nil {
		panic(err)
	}

	handler := func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
		if err := tx.Create(&Payment{OrderID: string(rec.Key)}).Error; err != nil {
			return err
		}
		return outbox.EnqueueJSON(tx, "payments", rec.Key, map[string]string{"order": string(rec.Key), "status": "paid"})
	}
	// A record as any Kafka client delivers it (inbox.FromSarama converts
	// sarama's), delivered twice.
	rec := inbox.Record{Topic: "orders", Partition: 0, Offset: 41, Key: []byte("order-7"),
		Headers: []inbox.Header{{Key: []byte("x-outbox-message-id"), Value: []byte("0190a8e4-0000-7000-8000-000000000007")}}}
	for range 2 {
		res, err := ib.Process(ctx, rec, handler)
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Outcome)
	}
	var payments, events int64
	db.Model(&Payment{}).Count(&payments)
	db.Table(p.Config().Tables.MessagesTable()).Count(&events)
	fmt.Println("payments:", payments, "events:", events)
	// Output:
	// processed
	// duplicate
	// payments: 1 events: 1
}
