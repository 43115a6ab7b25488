package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
)

// Outbox modes of Config.Mode.
const (
	ModeTable = "table"
	ModeWAL   = "wal"
)

// outboxMode returns the outbox.Config.Mode of the service's mode, or an
// error naming what WAL mode needs.
func (c Config) outboxMode() (outbox.Mode, error) {
	switch c.Mode {
	case "", ModeTable:
		return outbox.ModeTable, nil
	case ModeWAL:
		if !strings.HasPrefix(c.DatabaseURL, "postgres://") && !strings.HasPrefix(c.DatabaseURL, "postgresql://") {
			return 0, fmt.Errorf("outbox mode %q needs a postgres:// DATABASE_URL (PostgreSQL 14+ with wal_level=logical)", c.Mode)
		}
		return outbox.ModeWAL, nil
	}
	return 0, fmt.Errorf("outbox mode %q: want %q or %q", c.Mode, ModeTable, ModeWAL)
}

// startWAL builds the WAL mode relay: a pgwal.Reader on the slot that
// owns its Kafka producer (pgwal.NewKafka: Run starts the producer and,
// after a graceful stop, releases the slot's lease once the producer
// closed, so a restarted service reads at once instead of waiting for the
// lease to lapse), with the service's metrics collector as its Observer
// (acknowledged events, failures, the backlog the reader holds). It
// creates the slot now (before the service takes any write) when it is
// missing. A slot that was lost is an error here: the service does not
// start.
func (a *App) startWAL(ctx context.Context, kafka publisher.KafkaConfig) (err error) {
	if a.reader, err = pgwal.NewKafka(a.db, a.plugin, kafka, pgwal.Config{
		ReplicationDSN: a.cfg.DatabaseURL, Slot: a.cfg.WALSlot, Observer: a.metrics, Logger: a.log}); err != nil {
		return err
	}
	if err := a.reader.EnsureSlot(ctx); err != nil {
		return fmt.Errorf("replication slot: %w", err)
	}
	a.log.Info("WAL mode: reading the replication slot instead of the messages table", slog.String("slot", a.reader.Config().Slot))
	return nil
}

// runWAL reads the slot until ctx ends (the reader starts and stops its
// producer). A lost slot (*pgwal.SlotLostError), a misconfiguration or
// no broker answering at start ends it with an error.
func (a *App) runWAL(ctx context.Context) error {
	if err := a.reader.Run(ctx); err != nil {
		return fmt.Errorf("wal reader: %w", err)
	}
	if ctx.Err() == nil {
		return errors.New("wal reader: stopped before the service")
	}
	return nil
}

// kafkaConfig is the producer configuration of both modes.
func (a *App) kafkaConfig() publisher.KafkaConfig {
	return publisher.KafkaConfig{
		Brokers: a.brokers,
		Configure: func(c *sarama.Config) error {
			c.ClientID = "gin-orders"
			return nil
		},
		Logger: a.log,
	}
}
