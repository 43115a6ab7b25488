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
//     letters, requeue, purge, pause and resume), NewAdminHandler serves it
//     as JSON over HTTP and HealthHandler answers a readiness probe from
//     the age of the oldest pending message.
//
// The flow is write → table → relay → publisher: package outbox writes
// the rows in the business transaction, the relay engine (package relay)
// drives a Store from this package, and a publisher (package publisher)
// sends the batches.
//
// New wires the lot for a plugin: the store, the failure policy, the
// plugin's hints and bucket count.
//
//	r, err := gormrelay.New(db, plugin, pub)
//	if err != nil { ... }
//	if err := r.Start(ctx); err != nil { ... } // missing tables, a BucketCount mismatch
//	defer r.Stop(shutdownCtx)
//
// This package imports package outbox; package outbox never imports it.
package gormrelay
