// Package pgwal relays an outbox in WAL mode (outbox.ModeWAL) on
// PostgreSQL: the writers put each message in the write-ahead log as a
// logical decoding message of their transaction, with no outbox table,
// and a Reader reads them from a logical replication slot and publishes
// them, forgetting them (confirming the slot's position) only once the
// publisher acknowledged them.
//
// The wiring, from gorm.Open, with the server at wal_level = logical and a
// role with REPLICATION for ReplicationDSN:
//
//	p, err := outbox.NewPlugin(outbox.Config{Mode: outbox.ModeWAL, Rules: rules})
//	if err != nil { return err }
//	if err := db.Use(p); err != nil { return err }
//	if err := p.AutoMigrate(ctx, db); err != nil { return err }
//	r, err := pgwal.NewKafka(db, p, publisher.KafkaConfig{Brokers: brokers}, pgwal.Config{ReplicationDSN: dsn})
//	if err != nil { return err }
//	if err := r.EnsureSlot(ctx); err != nil { return err } // before any writer writes in WAL mode
//	return r.Run(ctx)                                      // until ctx ends
//
// What holds:
//
//   - One reader reads the slot at a time: readers of several processes
//     share it through a lease row (Config.LeaseTable) and take over
//     from each other; see Reader.Run.
//   - The order of a key's messages is the order of their commits. A
//     message keeps the id its writer gave it (the Kafka publisher's
//     "x-outbox-message-id" header) on every delivery.
//   - Delivery is at least once: nothing confirmed is published again,
//     and what a reader published after its last confirmation the next
//     reader publishes again. A reader confirms Config.ConfirmInterval
//     after a publish and, when it is told to stop, what the publisher
//     acknowledged. NewKafkaTransactional gives strict mode.
//   - A slot that lost WAL, or was dropped and created again, stops the
//     reader with a *SlotLostError rather than skip messages.
//   - Admin (and outboxctl --mode wal) shows the slot, the reader and
//     its lag, requeues dead letters and drops the slot.
//
// docs/wal-mode.md in the repository has the whole mode: the switch from
// table mode and back, failure handling, operations and figures.
package pgwal
