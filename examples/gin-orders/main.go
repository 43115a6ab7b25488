// Command gin-orders is a small order service that publishes its events to
// Kafka through gorm-outbox.
//
// With no configuration it keeps its data in the SQLite file gin-orders.db
// (through a pure-Go SQLite driver, so no C compiler is needed) and starts a
// Kafka-protocol broker in the process, so it runs anywhere Go does:
//
//	go run .
//
// Against real services:
//
//	DATABASE_URL=postgres://user:pass@localhost:5432/shop KAFKA_BROKERS=localhost:9092 go run .
//
// In WAL mode (PostgreSQL 14+, wal_level=logical, a role with the
// REPLICATION attribute) the messages go to the write-ahead log and a
// reader of a replication slot, created at start, relays them instead of
// the table relay; a lost slot ends the process with status 1:
//
//	OUTBOX_MODE=wal DATABASE_URL=postgres://user:pass@localhost:5432/shop go run .
//
// SIGINT (Ctrl-C) or SIGTERM shuts the service down in order within
// -shutdown-timeout and exits 0; a second signal exits at once. A relay
// that stops on an error (a misconfiguration it cannot retry) ends the
// process with status 1 and the error.
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	cfg := Config{
		Addr:         env("ADDR", ":8080"),
		DatabaseURL:  env("DATABASE_URL", ""),
		KafkaBrokers: env("KAFKA_BROKERS", ""),
		Topic:        env("TOPIC", "orders"),
		Consume:      env("CONSUME", "true") == "true",
		Mode:         env("OUTBOX_MODE", ModeTable),
		WALSlot:      env("OUTBOX_WAL_SLOT", ""),
		OutboxName:   env("OUTBOX_NAME", ""),
	}
	var shutdownTimeout time.Duration
	flag.StringVar(&cfg.Addr, "addr", cfg.Addr, "HTTP listen address (env ADDR)")
	flag.StringVar(&cfg.DatabaseURL, "database-url", cfg.DatabaseURL, "postgres://..., mysql://... or a SQLite file; default the SQLite file gin-orders.db (env DATABASE_URL)")
	flag.StringVar(&cfg.KafkaBrokers, "kafka-brokers", cfg.KafkaBrokers, "comma-separated Kafka brokers; empty starts an in-process broker (env KAFKA_BROKERS)")
	flag.StringVar(&cfg.Topic, "topic", cfg.Topic, "topic for order events (env TOPIC)")
	flag.BoolVar(&cfg.Consume, "consume", cfg.Consume, "run the demo consumer that logs each event once (env CONSUME)")
	flag.StringVar(&cfg.Mode, "outbox-mode", cfg.Mode, "table, or wal: messages in PostgreSQL's WAL, relayed from a replication slot (env OUTBOX_MODE)")
	flag.StringVar(&cfg.WALSlot, "wal-slot", cfg.WALSlot, "replication slot in wal mode; default outbox_<outbox name> (env OUTBOX_WAL_SLOT)")
	flag.StringVar(&cfg.OutboxName, "outbox-name", cfg.OutboxName, "the outbox's name: metrics label and WAL message prefix; distinct per service sharing a database in wal mode (env OUTBOX_NAME)")
	flag.DurationVar(&cfg.HealthMaxAge, "health-max-age", time.Minute, "oldest pending outbox age above which /healthz fails")
	flag.DurationVar(&shutdownTimeout, "shutdown-timeout", 15*time.Second, "time the shutdown may take after SIGINT or SIGTERM before the process exits anyway")
	flag.Parse()

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cfg.Logger = log

	// The first SIGINT or SIGTERM cancels ctx, which ends a start still in
	// progress or begins the shutdown; a second one exits at once.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		sig := <-signals
		log.Info("shutting down; a second signal exits at once",
			slog.String("signal", sig.String()), slog.Duration("timeout", shutdownTimeout))
		cancel()
		sig = <-signals
		log.Warn("second signal: exiting without finishing the shutdown", slog.String("signal", sig.String()))
		os.Exit(1)
	}()

	// Serve returns when ctx ends (nil after a clean shutdown) or when a
	// part of the service fails, the relay included: its error then ends
	// the process with a non-zero status instead of a relay that stopped
	// while the process kept running.
	cfg.ShutdownTimeout = shutdownTimeout
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, cfg, nil) }()
	var err error
	select {
	case err = <-served:
	case <-ctx.Done():
		// The shutdown may take shutdownTimeout, whatever hangs.
		t := time.NewTimer(shutdownTimeout)
		defer t.Stop()
		select {
		case err = <-served:
		case <-t.C:
			log.Error("shutdown did not finish within its timeout; exiting", slog.Duration("timeout", shutdownTimeout))
			os.Exit(1)
		}
	}
	if err != nil {
		log.Error("stopped on error", slog.Any("error", err))
		os.Exit(1)
	}
	log.Info("stopped")
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}
