// Package gormrelay is the relay's GORM side: everything that reads and
// repairs the outbox tables after the write side (package outbox) wrote
// them.
//
//   - Store is the GORM implementation of relay.Store, with the lease
//     renewal, failure recording, backlog sampling and start-check
//     capabilities, on PostgreSQL, MySQL/MariaDB and SQLite.
//   - FailurePolicy decides what happens to a message that keeps failing:
//     moved to the dead-letter table (ModeDeadLetter, the default) or
//     retried until it passes, its bucket waiting behind it (ModeBlock).
//   - DrainOnce publishes everything pending once, for jobs and tests.
//   - Admin is the operational API (backlog, status, leases, relays, dead
//     letters, requeue, purge, pause and resume): the GORM implementation
//     of ops.Operator. Its front ends live in ops/opshttp and ops/opsui and
//     take any ops.Operator; NewAdminHandler (JSON over HTTP), NewUI (the
//     web UI) and Health are their gormrelay names, taking the Admin.
//     Health answers Kubernetes probes: liveness fails at once when the
//     relay stopped on an error, readiness also when the oldest pending
//     message is older than MaxAge or the database does not answer
//     (HealthHandler is readiness without the relay).
//
// The flow is write → table → relay → publisher: package outbox writes
// the rows in the business transaction, the relay engine (package relay)
// drives a Store from this package, and a publisher (package publisher)
// sends the batches.
//
// NewKafka wires the lot for a plugin and a Kafka cluster: the store, the
// failure policy, the plugin's hints and bucket count, and a Kafka
// publisher that the relay owns (started by Run before the relay, stopped
// after it). From gorm.Open to a running relay, errors checked:
//
//	db, err := gorm.Open(postgres.Open(dsn), &gorm.Config{})
//	if err != nil { return err }
//	p, err := outbox.NewPlugin(outbox.Config{Rules: rules})
//	if err != nil { return err }
//	if err := db.Use(p); err != nil { return err }
//	if err := p.AutoMigrate(ctx, db); err != nil { return err }
//	r, err := gormrelay.NewKafka(db, p, publisher.KafkaConfig{Brokers: brokers})
//	if err != nil { return err }
//	return r.Run(ctx) // nil after ctx ends and the relay stopped cleanly
//
// Run fails at once on missing tables, a BucketCount mismatch (rows a
// writer with more buckets committed) and a broker that does not answer,
// and returns the relay's error if it stops on one later.
// NewKafkaTransactional is the same with the strict-mode publisher. New
// takes a publisher the caller starts and stops (the by-hand form, for a
// shared or wrapped publisher); NewStore and relay.New are the parts.
//
// # Connection pool
//
// database/sql keeps 2 idle connections unless told otherwise and closes
// every connection returned beyond them, so a relay's drainers (8 by
// default) would open a new database session for most statements: on two
// cores that cut the drain rate by a third and raised the
// commit-to-consumer p99 from a few milliseconds to tens (BENCHMARKS.md).
// NewStore (and so New and NewKafka) therefore raises the idle limit of a
// pool whose idle limit the application never set to PoolIdleFor(8) = 16,
// and the relay's first lease acquisition raises it to PoolIdleFor of its
// Parallelism if that is larger; each change is logged once at Debug. An
// idle limit the application set (any value, SetMaxIdleConns(2) included)
// is kept, and an open limit (SetMaxOpenConns) is never changed; the store
// then warns if the pool keeps closing connections at its idle limit.
//
// This package imports package outbox; package outbox never imports it.
package gormrelay
