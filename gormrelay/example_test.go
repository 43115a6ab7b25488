package gormrelay_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/outboxtest"
	"github.com/gorm-outbox/outbox/publisher"
)

// The by-hand form: the caller builds, starts and stops the publisher, and
// New wires the store, the failure policy, the plugin's hints and its
// bucket count. The broker here is the in-process Kafka-protocol broker of
// outboxtest; a service passes its cluster's addresses. NewKafka (see its
// example) is shorter.
func ExampleNew() {
	broker, err := outboxtest.NewBroker("orders")
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	dir, err := os.MkdirTemp("", "gormrelay-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()

	db, err := gorm.Open(sqlite.Open(filepath.Join(dir, "app.db")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		panic(err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		panic(err)
	}
	defer sqlDB.Close() // after the relay stopped
	plugin, err := outbox.NewPlugin(outbox.Config{})
	if err != nil {
		panic(err)
	}
	if err := db.Use(plugin); err != nil {
		panic(err)
	}
	if err := plugin.AutoMigrate(ctx, db); err != nil {
		panic(err)
	}
	pub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: broker.Brokers()})
	if err != nil {
		panic(err)
	}
	if err := pub.Start(ctx); err != nil { // connects to the brokers
		panic(err)
	}
	defer pub.Stop(ctx) // runs after r.Stop: flushes what is in flight, bounded by ctx
	r, err := gormrelay.New(db, plugin, pub)
	if err != nil {
		panic(err)
	}
	if err := r.Start(ctx); err != nil { // missing tables or a BucketCount mismatch fail here
		panic(err)
	}
	defer r.Stop(ctx)

	// A committed message reaches Kafka without any further call.
	if err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.EnqueueJSON(tx, "orders", []byte("order-7"), map[string]string{"status": "placed"})
	}); err != nil {
		panic(err)
	}
	readCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	records, err := broker.ReadContext(readCtx, "orders", 1)
	if err != nil {
		panic(err)
	}
	fmt.Printf("kafka: key=%s value=%s\n", records[0].Key, records[0].Value)
	// Output:
	// kafka: key=order-7 value={"status":"placed"}
}

// From gorm.Open to a running relay in ten lines: NewKafka builds the Kafka
// publisher and owns it, and Run blocks until ctx ends (then it stops the
// relay gracefully and the publisher after it, and returns nil) or the
// relay stops on an error (which it returns). Missing tables, a
// BucketCount mismatch and a broker that does not answer fail Run at once.
func ExampleNewKafka() {
	broker, err := outboxtest.NewBroker("orders")
	if err != nil {
		panic(err)
	}
	defer broker.Close()
	dir, err := os.MkdirTemp("", "gormrelay-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)

	// The ten lines (run is what a service's main calls).
	run := func(ctx context.Context) error {
		db, err := gorm.Open(sqlite.Open(filepath.Join(dir, "app.db")), &gorm.Config{Logger: logger.Discard})
		if err != nil {
			return err
		}
		p, err := outbox.NewPlugin(outbox.Config{})
		if err != nil {
			return err
		}
		if err := db.Use(p); err != nil {
			return err
		}
		if err := p.AutoMigrate(ctx, db); err != nil {
			return err
		}
		r, err := gormrelay.NewKafka(db, p, publisher.KafkaConfig{Brokers: broker.Brokers()})
		if err != nil {
			return err
		}
		go enqueueOrder(db) // the application's own writes
		return r.Run(ctx)   // nil after ctx ends and the relay stopped cleanly
	}
	go func() { done <- run(ctx) }()

	readCtx, cancelRead := context.WithTimeout(ctx, 30*time.Second)
	defer cancelRead()
	records, err := broker.ReadContext(readCtx, "orders", 1)
	if err != nil {
		panic(err)
	}
	fmt.Printf("kafka: key=%s value=%s\n", records[0].Key, records[0].Value)
	cancel() // SIGTERM, in a service
	fmt.Println("run returned:", <-done)
	// Output:
	// kafka: key=order-7 value={"status":"placed"}
	// run returned: <nil>
}

func enqueueOrder(db *gorm.DB) {
	if err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.EnqueueJSON(tx, "orders", []byte("order-7"), map[string]string{"status": "placed"})
	}); err != nil {
		panic(err)
	}
}
