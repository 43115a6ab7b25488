package pgnotify_test

import (
	"context"
	"log"
	"log/slog"
	"time"

	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/pgnotify"
	"github.com/gorm-outbox/outbox/relay"
)

// Wiring one process: its writes wake relays in other processes, and
// their writes wake its relay. Every process of the outbox runs the same.
func Example() {
	ctx := context.Background()
	// The application's pool may go through PgBouncer in transaction mode;
	// the listener needs a session, so it gets a direct address.
	const appDSN = "host=pgbouncer port=6432 user=app dbname=app"
	const directDSN = "host=postgres port=5432 user=app dbname=app"

	db, err := gorm.Open(postgres.Open(appDSN), &gorm.Config{})
	if err != nil {
		log.Fatal(err)
	}
	plugin, err := outbox.NewPlugin(outbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if err := db.Use(plugin); err != nil {
		log.Fatal(err)
	}

	sqlDB, err := db.DB()
	if err != nil {
		log.Fatal(err)
	}
	transport, err := pgnotify.New(pgnotify.Config{
		DSN:       directDSN,              // LISTEN: one session connection
		PublishDB: sqlDB,                  // NOTIFY through the application's pool
		Tables:    plugin.Config().Tables, // channel "outbox_messages_hints"
		Logger:    slog.Default(),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer transport.Close()

	bridge, err := outbox.StartHintBridge(ctx, plugin.Notifier(), transport, outbox.HintBridgeConfig{})
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = bridge.Stop(stopCtx)
	}()

	// The local relay takes its hints from the same notifier: local
	// commits and received hints alike.
	store, err := gormrelay.NewStore(db, plugin.Config())
	if err != nil {
		log.Fatal(err)
	}
	r, err := relay.New(store, relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		return len(msgs), nil // a real sink here
	}), relay.Config{Hints: plugin.Notifier()})
	if err != nil {
		log.Fatal(err)
	}
	_ = r.Start(ctx)
	defer r.Stop(context.Background())
}
