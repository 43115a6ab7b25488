// Package outbox is the write side of the transactional outbox for GORM.
//
// A message to publish is written as a row in the same database
// transaction as the business change it announces; a relay publishes the
// rows afterwards and deletes each one only after the sink acknowledged
// it. There is no dual write: a message exists exactly when its business
// write committed.
//
// This package is the first step of write → table → relay → publisher:
// the plugin, its rules, Enqueue, the message and configuration types, the
// schema of the tables and the commit notifier. The relay's GORM store,
// failure policy, admin API and health handler are in package gormrelay;
// the storage-agnostic engine in package relay; the sinks in package
// publisher. This package imports none of them: what both sides share
// (Header, ConfigError, the bucket function, the row's column names,
// Kafka's topic and size rules) is in package wire, and the sink's rules
// a message is checked against at Enqueue are Config.Limits.
//
// # Writing messages
//
// Register the plugin right after gorm.Open, create its tables, then
// either declare rules per model or enqueue explicitly:
//
//	p, err := outbox.NewPlugin(outbox.Config{Rules: []outbox.Rule{
//		outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
//			return outbox.JSONMessage("orders", orderKey(c.Entity.ID), c.Entity)
//		}),
//	}})
//	err = db.Use(p)
//	err = p.AutoMigrate(ctx, db)
//
//	db.Create(&order) // the order and its message, one transaction
//
//	db.Transaction(func(tx *gorm.DB) error {
//		// ... business writes on tx ...
//		return outbox.Enqueue(tx, &outbox.Message{Topic: "payments", Key: k, Value: v})
//	})
//
// Rules run inside the write's transaction, after the model's own hooks
// and before COMMIT; a rule's error rolls the write back. A rule belongs to
// its model's table: every GORM write that changes rows there runs it once
// per row. Upserts, including the ones GORM issues to save associations,
// publish an Insert or an Update per entity, found out inside the
// transaction. Updates and deletes by condition (db.Where(…).Delete(&T{}),
// association unlinks, gorm.G[T] forms) read and lock the matching rows
// first and publish one change per row, with the row after the update or
// as it was before the delete; more rows than Config.MaxRowsPerWrite
// (default 10,000) fail with a *TooManyRowsError before anything changes,
// and rules built with AllowBulk see one change per statement instead.
// An update or delete of an entity reads nothing: the rule sees the
// caller's value, with Change.KeyOnly when it held nothing but its key
// (db.Delete(&Order{ID: 7})), unless a rule of the model for the
// operation was built with ReadRow: every update or delete of entities
// with a key is then read as one by condition on their keys, and the
// rule sees the rows from the table.
// Creates from maps and writes through Table(name) or another struct
// mapped to a rule's table are recognised by table name and read back into
// the rule's model. Raw SQL (Exec, Raw) is outside the rules. See
// docs/rules.md for every write shape.
// Enqueue outside a transaction returns ErrNoTransaction and writes
// nothing.
//
// # Buckets and order
//
// Every message falls into one of Config.BucketCount buckets by a stable
// hash of its key (see Bucket). A bucket is drained in submission order by
// one relay at a time, so messages with the same key reach the sink in the
// order their transactions wrote them. BucketCount must be the same for
// every writer and relay of a table.
//
// # Wake-ups
//
// After the outermost COMMIT of a transaction that wrote messages, the
// plugin hands the touched buckets to its Notifier, which the local relay
// waits on. Rollbacks notify nothing. Hints only shorten latency: the
// relay also polls.
package outbox
