// Command gin-orders is a small order service that publishes its events to
// Kafka through gorm-outbox.
//
// With no configuration it keeps its data in the SQLite file gin-orders.db
// and starts a Kafka-protocol broker in the process, so it runs anywhere:
//
//	go run .
//
// Against real services:
//
//	DATABASE_URL=postgres://user:pass@localhost:5432/shop KAFKA_BROKERS=localhost:9092 go run .
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
	}
	flag.StringVar(&cfg.Addr, "addr", cfg.Addr, "HTTP listen address (env ADDR)")
	flag.StringVar(&cfg.DatabaseURL, "database-url", cfg.DatabaseURL, "postgres://..., mysql://... or a SQLite file; default the SQLite file gin-orders.db (env DATABASE_URL)")
	flag.StringVar(&cfg.KafkaBrokers, "kafka-brokers", cfg.KafkaBrokers, "comma-separated Kafka brokers; empty starts an in-process broker (env KAFKA_BROKERS)")
	flag.StringVar(&cfg.Topic, "topic", cfg.Topic, "topic for order events (env TOPIC)")
	flag.BoolVar(&cfg.Consume, "consume", cfg.Consume, "run the demo consumer that logs each event once (env CONSUME)")
	flag.DurationVar(&cfg.HealthMaxAge, "health-max-age", time.Minute, "oldest pending outbox age above which /healthz fails")
	flag.Parse()

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cfg.Logger = log

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	app, err := Start(ctx, cfg)
	if err != nil {
		log.Error("start", slog.Any("error", err))
		os.Exit(1)
	}
	<-ctx.Done()
	log.Info("shutting down")
	shutdown, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	app.Close(shutdown)
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}
