// Package inbox is the consumer side of the outbox: it makes a consumer
// apply each message's effect once, although the outbox delivers at least
// once.
//
// The outbox's Kafka publisher stamps every record with the message id,
// in the header x-outbox-message-id, the same on every delivery. The
// inbox records that id in a table of the consumer's own database, in the
// transaction of the handler that applies the record:
//
//	ib, err := inbox.New(db, inbox.Config{})   // db: the consumer's *gorm.DB
//	err = ib.AutoMigrate(ctx)                  // or the files of migrations/<dialect>/inbox
//	res, err := ib.Process(ctx, rec, func(ctx context.Context, tx *gorm.DB, rec inbox.Record) error {
//		return tx.Create(&Payment{...}).Error // every write through tx
//	})
//
// In one transaction Process inserts the id, keyed by the table's primary
// key, and runs the handler; both commit or neither does:
//
//   - an id already recorded is skipped: the handler is not called, the
//     result is Outcome Duplicate with a nil error;
//   - a handler error rolls back its writes and the id (a *HandlerError),
//     so a redelivery runs it again;
//   - two deliveries of one id at once (two consumers around a
//     rebalance): the second INSERT waits on the key until the first
//     transaction ends, then fails with the database's unique violation
//     (PostgreSQL 23505, MySQL/MariaDB 1062, SQLite
//     SQLITE_CONSTRAINT_PRIMARYKEY; SQLite admits one writer at a time),
//     and reports Duplicate without running its handler. If the first
//     rolls back, the second processes the record;
//   - a record without the id header is refused with a *MessageIDError
//     (ErrNoMessageID), unless Config.AllowMissingID processes it without
//     deduplication (Outcome Unrecorded).
//
// # Consume and publish
//
// The handler's tx is an ordinary GORM transaction on a *gorm.DB with the
// outbox plugin registered: outbox.Enqueue and the publish rules work on
// it, so a consumer that reacts with events commits the effect, the
// events and the id together (see Example).
//
// # Consumers
//
// Inbox.ConsumerGroupHandler adapts a Handler to a sarama consumer group:
// each record goes through Handle, which retries failures with backoff
// (Config.RetryMin to RetryMax) until the record commits or is found a
// duplicate, and the offset is marked only then. A crash between commit
// and offset commit redelivers a record the inbox skips. When the session
// ends, a record still failing is left unmarked for the next owner.
// Records from any other client go through Process or Handle as a
// Record.
//
// # Retention
//
// Purge (or RunPurge on a goroutine) deletes ids older than
// Config.Retention (default 7 days), oldest first, Config.PurgeBatch per
// statement, each statement an index range read and primary-key deletes,
// so its cost follows what it deletes, not the size of the table. A
// record redelivered after its id
// was purged is processed again: keep the retention above the longest
// redelivery to survive, e.g. the topic's retention when consumers may
// re-read a topic from its start.
//
// # Metrics
//
// metrics.NewInbox returns a Prometheus collector to pass as
// Config.Observer: processed records, duplicates skipped, failures by
// kind, ids purged.
//
// docs/inbox.md has the whole guide: schema and migrations, the failure
// policy of the adapter, and what is and is not exactly once.
package inbox
