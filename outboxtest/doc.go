// Package outboxtest helps a service's own tests check what it put in the
// outbox, without Kafka and without a relay running. It is the testing
// room, beside the flow write → table → relay → publisher, never used by
// production code:
//
//   - RequireEnqueued, RequireManyEnqueued and RequireNotEnqueued assert
//     that the pending messages match (topic, key, decoded JSON payload,
//     headers, partition), and fail with a listing of what is pending and
//     why each message did not match;
//   - Pending lists the pending messages;
//   - Drain runs the real relay store once (gormrelay.NewStore and
//     (*relay.Relay).DrainOnce) into a recording publisher and returns what was
//     published, leaving the outbox empty;
//   - StartBroker starts an in-process Kafka-protocol broker for
//     end-to-end tests through the Kafka publisher.
//
// The assertions read the outbox's messages table directly, through the
// *gorm.DB they are given. Pass the transaction (the *gorm.DB inside
// db.Transaction) to see what it enqueued before it commits; pass the
// database to see what committed. A nil *outbox.Plugin means the only
// outbox plugin registered on the *gorm.DB.
//
// The messages table is shared: in tests that run in parallel against one
// database, give each test its own database or table names
// (outbox.WithPrefix), or filter with Want.Key.
package outboxtest
