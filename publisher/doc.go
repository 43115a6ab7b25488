// Package publisher holds the relay's publishers: Kafka, a Kafka publisher
// over github.com/IBM/sarama, Franz, a Kafka publisher over franz-go (kgo)
// whose batches of a bucket can overlap in flight, Transactional, the
// strict mode (one Kafka transaction per batch), and Func, an adapter for
// any other sink. All
// implement relay.Publisher. It is the last step of write → table →
// relay → publisher, with TracingPublisher, which wraps any of them in a
// span per publish.
//
// # The prefix contract
//
// Publish(ctx, msgs) returns how many leading messages of msgs the sink
// acknowledged, and the first error. Only a contiguous prefix counts: the
// relay deletes exactly msgs[:acked] from the outbox and publishes the rest
// again later. If message 3 of 5 fails, acked is 2 even when 4 and 5 were
// acknowledged. The error for the first unacknowledged message is a *Error
// naming its index, message id and topic; errors that retrying cannot fix
// wrap a *relay.PermanentError (relay.IsPermanent), and a message too large
// for the sink also wraps ErrTooLarge (IsTooLarge). The conformance suite
// in package publishertest holds every publisher here to this contract.
//
// # Lifecycle
//
// Both Kafka publishers have the lifecycle of the module's other
// background services. NewKafka and NewTransactional check the
// configuration (a *ConfigError, or the error KafkaConfig.Configure
// returned) and connect nothing. Start(ctx) connects: Kafka starts its
// producer, Transactional checks that a broker answers. Start is bounded by
// ctx although sarama's constructors take no context: the connect runs on
// its own goroutine, and if ctx ends first Start returns ctx's error and
// whatever the connect opens later is closed. A failed Start leaves the
// publisher unstarted, so Start may be called again (a process starting
// while the brokers are down can retry it); Stop or Close end it. Once
// started, the end of ctx closes the publisher as Stop does. Start on a
// running publisher returns nil; after Stop or Close it returns an error
// wrapping ErrStopped.
//
// Publish before Start, and Transactional.LeasesAcquired, fail with an
// error wrapping ErrNotStarted that is a *relay.MisconfigurationError: a
// relay running with a publisher that was never started stops with it
// instead of retrying. After Stop or Close, Publish returns ErrClosed.
// Stop(ctx) closes synchronously, bounded by ctx; Close is Stop without a
// deadline. Stop before Start and a second Stop are harmless. Stopped and
// Err report the end of a started publisher.
//
//	pub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: brokers})
//	if err != nil {
//		return err // invalid configuration
//	}
//	if err := pub.Start(ctx); err != nil {
//		return err // no broker answered, or ctx ended
//	}
//	defer pub.Close() // after the relay stopped
//
// # Kafka: what is guaranteed
//
// Start starts KafkaConfig.Producers (default 4) long-lived sarama
// AsyncProducers; NewKafka enforces, after the caller's
// KafkaConfig.Configure ran, the settings the guarantees below rest on:
// acks=all, the idempotent producer with one request in flight per broker
// connection, at least one retry, Kafka protocol 0.11 or newer, and the
// partitioner (see KafkaConfig.Configure for the list).
//
// A Publish call goes entirely to one slot, number msgs[0].Bucket mod
// Producers, so a bucket's batches always travel through the same slot,
// in order, while other buckets' batches travel at once through the other
// slots: one producer has one request in flight per broker, and would
// make every bucket's batch wait for the others'. A replaced producer
// (below) takes over its predecessor's place.
//
// Each slot holds two producers, routed by the batch's size
// (KafkaConfig.LingerBatch, default 32): a batch of at least LingerBatch
// messages goes through the slot's lingering producer, which gathers
// records for KafkaConfig.Linger (1 ms, sarama's Producer.Flush.Frequency)
// before a produce request, so that the batch leaves in one request per
// broker instead of a train of small ones, each waiting for the
// followers' replication; a smaller batch goes through the other, which
// sends as soon as its broker connection is free, so that a batch of one
// message does not wait out the linger. A bucket's batches still reach
// the brokers in order although they may take either producer: the relay
// publishes a bucket's next batch only after the previous Publish call
// returned (one drainer per bucket at a time), and a call returns only
// once every message it handed over has its result. The one exception, a
// call whose ctx ended (the relay's PublishTimeout, a lost lease, a
// stop), leaves messages in its producer: the bucket's next batches then
// go through that same producer, behind them, until every one of them
// has its result. A negative LingerBatch turns the routing off: one
// producer per slot, sending as soon as the connection is free.
//
//   - Acknowledged means written to all in-sync replicas (acks=all): a
//     message counted in acked survives the loss of the partition leader
//     when the topic's min.insync.replicas is above 1.
//   - The whole batch is in flight at once: Publish hands every message to
//     the producer, which groups them into one produce request per broker,
//     and then waits for all results. It never waits a round trip per
//     message. Publish returns only when every message of the batch has a
//     result (unless ctx ends first), so when it returns nothing of the
//     batch is still in flight.
//   - No duplicates within one Publish: when the producer retries (a lost
//     reply, a timeout, a leader change) the broker recognizes the retried
//     records by the idempotent producer's sequence numbers and writes them
//     once.
//   - Order per partition: records of one partition are written in batch
//     order, and consecutive Publish calls from one goroutine in call order.
//     Messages with the same key go to the same partition, so this is
//     per-key order.
//   - At-least-once across publishes: a message is acknowledged only after
//     the brokers acknowledged it, but a message the relay publishes again
//     (because an earlier message failed, the relay crashed before deleting
//     the rows, or a lease moved) is written again. Every record carries the
//     message id header (KafkaConfig.MessageIDHeader, default
//     "x-outbox-message-id"), identical on every attempt, so consumers can
//     deduplicate.
//
// # Kafka: order under failures
//
// sarama fails some messages without stopping the later ones of their
// partition: a record over KafkaConfig.MaxMessageBytes is rejected before
// it is sent, and a failed leader lookup ("circuit breaker is open", no
// broker available) fails one message while the next one finds the leader.
// The publisher's order gate runs when sarama adds a record to a produce
// request: a record is admitted only if the previous record of its key in
// the same Publish call (for keyless records, of its pinned partition) was
// admitted before it and has not been reported failed. Otherwise it fails
// with an unavailable "held back" error and is not written. Take rows 1, 2
// and 3 with one key, row 1 too large: Publish returns acked=0 and a
// permanent too-large error, and the broker holds none of them; the relay
// deals with row 1 and publishes 2 and 3 after it.
//
// The gate runs on every attempt: sarama adds a record to a produce
// request again when it retries it. A retry is where sarama could put a key
// out of order, because a request whose retries run out is failed while the
// records that waited behind it are sent under a bumped producer epoch, and
// the producer reports that failure asynchronously. So once sarama started
// a retry during a Publish call (it asks for a backoff before each retry,
// and retried records pass the gate again), the gate admits a record only
// after the previous record of its key was acknowledged; the others are
// held back, unwritten, and the relay publishes them after the earlier
// ones. A fault that sarama retries therefore cuts the batch: Publish
// returns the acknowledged prefix with an unavailable error, and the next
// publish carries the rest. The outage test (outage_test.go) counts late
// first deliveries of a key; it counted 0 of 300 messages in each of 9
// runs, against 0-29 (93 in total) before the gate ran on retries.
//
// What the gate cannot see: a request that fails for good on its first
// attempt, without a retry (a non-retriable error for the partition, such
// as a broker refusing the producer's sequence state), while records of a
// later request were already admitted; and records first admitted in the
// instant between a connection failure and sarama asking for the backoff
// of its retry. Consumers that need strict per-key
// order under every failure use strict mode (below) and read with
// isolation.level=read_committed; all consumers should deduplicate by
// message id.
//
// A record larger than the topic's max.message.bytes but below
// MaxMessageBytes is rejected by the broker instead, with
// MESSAGE_TOO_LARGE for the whole produce batch it travelled in, so other
// messages of that partition can fail with it: keep MaxMessageBytes at or
// below the smallest max.message.bytes of the topics you publish to.
//
// # Kafka: placement
//
// A message with relay.Message.Partition set goes to that partition (an
// index the topic does not have is a permanent error). Otherwise a message
// with a key, including an empty key, goes to KeyPartition(key), the
// partition the Java client's default partitioner picks: murmur2 of the key
// with the sign bit cleared, modulo the partition count. A message with a
// nil key goes to a random partition that has a leader.
//
// # Kafka: records
//
// The record key and value are relay.Message.Key and Value byte for byte;
// a nil Key is a null key and a nil Value a null value (a tombstone), while
// empty slices stay empty. Headers are the message's headers in order,
// duplicates kept, followed by the message id header. The record timestamp
// is the time of publishing, not relay.Message.CreatedAt, so that a message
// published late is not deleted early by the topic's time-based retention.
//
// # Kafka: cancellation and shutdown
//
// If ctx ends during Publish, it returns the prefix acknowledged so far and
// ctx.Err(). Messages already handed to the producer are not recalled: they
// may still be written, which the relay's at-least-once handling absorbs;
// their results are discarded without blocking anything. Close stops new
// publishes (Publish then returns ErrClosed), waits for the messages in
// flight to be acknowledged or to fail, and stops the producer's
// goroutines.
//
// # Franz: overlapping batches
//
// NewFranz(FranzConfig) builds a publisher over one franz-go client: an
// idempotent producer (acks=all) with up to five produce requests in
// flight per broker, against sarama's one, so that a bucket's next batch
// can travel while its previous one waits for its acknowledgement. It
// writes what Kafka writes (the same partition for every key, pinned
// partition and empty key, the same headers with the message id last),
// checks topics and sizes before sending with the same errors, and its
// broker errors match sarama's of the same code (errors.Is), so the
// relay's failure policy treats them alike. Publish has Kafka's contract;
// Send hands a batch over and returns a wait for its answer, for a relay
// that pipelines a bucket's batches.
//
// Order per key, across Sends, holds by construction: a message whose key
// (for a keyless message, its pinned partition) has a message of an
// earlier Send not yet reported waits in the publisher, unwritten, until
// that one is acknowledged. If that one failed, the message fails
// unwritten (relay.Unavailable), and so does every later message of the
// key handed over before the failed Send's wait returned. Within one Send
// the messages go out at once: franz-go fails every record buffered for a
// partition when one of its batches fails for good, then writes records
// produced later under a new producer epoch. A message of the same Send
// produced after its key's predecessor failed there, before the failure
// reached the publisher, can therefore be written after it, out of order;
// the producer hands a Send's messages over in one loop, and a new epoch
// needs a round trip before anything is written, so the window is the
// rest of that loop. Kafka's order gate closes it; Franz does not.
//
// franz-go resets its producer id and epoch itself and has no circuit
// breakers, but its idempotent producer never fails a record whose
// outcome it cannot know: after a broker answered REQUEST_TIMED_OUT or
// NOT_ENOUGH_REPLICAS_AFTER_APPEND (the record may be written) it retries
// the record without end, past its retries and delivery timeout, and
// every later message of its key waits behind it in the publisher. So
// when a Send's messages have had no result for FranzConfig.StallTimeout
// (default 45s), Franz replaces its client with a new one (a new producer
// id; Replacements counts them) and closes the old one, which fails its
// messages unavailable; the messages held behind them fail unwritten, and
// the relay republishes them through the new client: a duplicate at
// worst. It does the same when a partition's messages have failed
// unavailable, none acknowledged, for StallTimeout: franz-go keeps
// producing on the connection it has to a broker that answers
// NOT_LEADER_FOR_PARTITION naming that node as the leader (a broker
// removed from the cluster keeps its connections, and added back under
// its node id it leads again on a new listener), and a new client
// connects afresh. Not fenced: a request of the old client that a broker
// is still handling when it closes can be written after the republished
// messages.
// Close flushes every message handed over, held ones included, until
// StallTimeout passes without a result: then it fails the rest and
// returns an error. FranzConfig.Observer is told of each replacement
// (reason ReplaceStalled). Franz has one client rather than Producers
// slots, and no routing by size. The tests:
// TestFranzReplacesAClientStuckOnAnUnknownOutcome (a broker answers every
// produce request with REQUEST_TIMED_OUT),
// TestFranzReplacesAClientWhosePartitionKeepsFailing (the partition's
// leader is removed, added back and made leader again) and
// TestFranzReplacementUnderConcurrentPipelines (-race).
//
// The chaos suite runs through Franz (TestChaosFranz, on kfake and on
// three Apache Kafka nodes): nothing lost, no key reordered. It is not
// the default publisher. A stall costs up to StallTimeout before the
// replacement, and the order gaps above remain. Before the replacement
// existed, one of three drains through Franz on three heavily loaded
// Apache Kafka nodes stalled (BENCHMARKS.md, "The Franz publisher beside
// the Kafka publisher"); that drain has not been run again since.
//
// # Strict mode: Transactional
//
// NewTransactional builds the strict-mode publisher (Start checks that a
// broker answers; the producers start per bucket). Each bucket publishes
// through its own transactional producer, with transactional id
// TransactionalConfig.TransactionalIDPrefix + bucket, the same on every
// relay of the outbox, and every batch is one Kafka transaction: begin,
// produce the whole batch, commit. What read_committed consumers see
// (isolation.level=read_committed; for sarama consumers
// Consumer.IsolationLevel = sarama.ReadCommitted with Version 0.11 or
// newer):
//
//   - A batch is visible entirely or not at all. Any failure aborts it:
//     Publish returns acked=0 and nothing of the batch becomes visible, so
//     a later row of a key can never be seen before an earlier one that
//     failed. The error still names the failed message (Error.Index,
//     relay.FailedIndex); the relay publishes the messages before it on
//     their own and hands the culprit to its failure policy. A message
//     that cannot be sent at all (too large, no topic) fails the batch
//     before the transaction begins.
//
//   - A relay that lost its bucket is fenced by the broker. The relay that
//     takes the bucket over initialises the same transactional id, which
//     bumps the producer epoch and aborts the previous owner's open
//     transaction; the previous owner's later produce, commit or abort is
//     refused with PRODUCER_FENCED (or INVALID_PRODUCER_EPOCH), Publish
//     returns an error for which relay.IsFenced reports true, and the relay
//     drops the bucket without deleting anything. A stale relay's in-flight
//     batch therefore never interleaves with the new owner's.
//
//   - Each message is delivered once. Every transaction also commits,
//     atomically with its records, a progress marker: an offset in the
//     bucket's progress group (Transactional.ProgressGroup, a consumer
//     group without members) whose value is the bucket's transaction
//     sequence number and whose metadata lists the row ids the
//     transaction carried and a digest of their message ids
//     (relay.MessagesDigest). A producer reads the marker when it starts,
//     after its InitProducerID fenced the previous owner (whose last
//     transaction is then committed or aborted), with an OffsetFetch that
//     requires stable offsets; Reconcile (relay.Reconciler) hands the ids
//     and the digest to the relay, which deletes those rows before it
//     reads the bucket, and again after any batch that ended in doubt,
//     if they are all there and hold those messages: a marker of another
//     outbox sharing the prefix, or one left before the database was
//     recreated, deletes nothing. A batch committed but
//     not deleted (the relay died, lost the database or its lease just
//     after the commit) is therefore not published again. The marker is
//     bounded by TransactionalConfig.MarkerMaxBytes (the brokers'
//     offset.metadata.max.bytes, 4096 by default). Ascending ids (a
//     table-mode relay's batches) are listed while they fit, a byte per id within
//     127 of the one before; a batch whose list does not fit is recorded
//     as its span (first id, last id, count, digest), committed whole,
//     and the relay deletes the rows of the span only if they are
//     exactly that batch's (a row committed late inside the span deletes
//     nothing: a duplicate, never a loss). A WAL-mode batch (its messages
//     have a Position), and ids in another order, that do not fit are
//     published up to the last id that fits, and Publish
//     returns that prefix with an error for which relay.IsTruncated
//     reports true; the relay deletes it and publishes the rest at once.
//
// This rests on: read_committed consumers; the relay calling Reconcile (a
// wrapper must forward relay.Reconciler; TracingPublisher does); store
// ids that are never reused (bigserial, AUTO_INCREMENT on MySQL 8.0 or
// MariaDB 10.2.4 and newer, whose counters survive a restart; SQLite
// AUTOINCREMENT); the marker outliving the failed delete (the brokers'
// offsets.retention.minutes, 7 days by default, counted from the bucket's
// last commit); and the principal having READ on the progress groups (a
// PREFIXED group ACL on TransactionalIDPrefix) and on the outbox's
// topics, which the broker requires for a transactional offset commit. A
// refused marker is a *relay.MisconfigurationError and aborts the
// transaction: nothing is lost. In WAL mode (pgwal) the marker of a batch
// of positioned messages (relay.Message.Position) also records its last
// message's position and digest (relay.Committed.Position, LastDigest):
// the reader that takes the slot over skips, in its replay, what the
// record shows Kafka holds (docs/strict-mode.md, "WAL mode").
//
// read_uncommitted consumers (the default of most clients) see aborted
// records too, so none of this holds for them.
//
// A relay holds one producer, with its own broker connections, per bucket
// it owns. It starts it when it acquires the bucket (relay.LeaseAware),
// which costs a metadata request, FindCoordinator and InitProducerID, and
// closes it when it gives the bucket up, and reads the bucket's progress
// marker (FindCoordinator and OffsetFetch for the group). Each batch adds
// four round trips (AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit
// to the group's coordinator, EndTxn) and the broker writes a commit marker
// per partition, the progress group's included; see docs/strict-mode.md. A bucket's next transaction may
// find the coordinator still writing the previous one's markers
// (CONCURRENT_TRANSACTIONS), a millisecond on an idle broker and tens of
// milliseconds on a cold or loaded one, or on three nodes; unless TransactionalConfig.Configure chose
// a Producer.Transaction.Retry backoff, the producer asks again after 2ms
// ten times, then after 4ms doubling to 100ms, instead of sarama's fixed
// 20ms or 100ms, and retries up to 60 times (about 4.6s in all) unless
// Configure chose Producer.Transaction.Retry.Max.
//
// # Errors
//
// Permanent: message too large (client-side or MESSAGE_TOO_LARGE,
// RECORD_LIST_TOO_LARGE), an invalid topic or partition, a message with no
// topic, topic or cluster authorization failures, INVALID_RECORD,
// INVALID_TIMESTAMP, unsupported format or compression, and policy
// violations. A too-large error from the broker is also
// relay.BatchRejected: the broker refuses a partition's whole batch, so the
// relay splits the batch until the culprit is alone before its failure
// policy runs.
//
// Unavailable (relay.IsUnavailable; never counted against the message, so
// an outage dead-letters nothing): connection and network errors, no
// broker available, the circuit breaker (but see UNKNOWN_TOPIC_OR_PARTITION
// below), NOT_LEADER_FOR_PARTITION,
// LEADER_NOT_AVAILABLE, REQUEST_TIMED_OUT, NOT_ENOUGH_REPLICAS(_AFTER_APPEND),
// KAFKA_STORAGE_ERROR and the other errors of a cluster not ready to take
// the write, ErrClosed, and the producer-state errors
// (OUT_OF_ORDER_SEQUENCE_NUMBER, UNKNOWN_PRODUCER_ID, INVALID_PRODUCER_EPOCH,
// PRODUCER_FENCED, INVALID_PRODUCER_ID_MAPPING).
//
// Everything else is left retriable and counted against the message,
// notably UNKNOWN_TOPIC_OR_PARTITION: Kafka calls it retriable, and a topic
// that does not exist yet may be created by a deploy in progress; the
// relay's MaxAttempts still bounds how long a bucket waits for it. sarama
// opens a topic's circuit breaker after three failed lookups of it and
// fails its messages with "circuit breaker is open" until a lookup is let
// through (10s later): when the topic's last failure was
// UNKNOWN_TOPIC_OR_PARTITION, those failures are reported as the unknown
// topic (they wrap sarama.ErrUnknownTopicOrPartition and are not
// relay.Unavailable), so every attempt of the message counts.
//
// The *Error of a failed message reads cause first, in plain words with
// its numbers, then where, then the client's own text:
//
//	record too large: 1,234,567 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic orders, partition 3; message id "m-1", key "order-42"; sink error: permanent: publisher: message too large: kafka: invalid configuration (...)
//
// Error.Cause gives the first part alone. The message is named by its id,
// topic and key; Error.Index, its position in the batch, is not in the
// text. The error also says which records may have been written although
// they were not acknowledged (Error.MaybeWritten, Error.LaterMaybeWritten):
// the relay's GORM store notes them on the rows, and a dead letter then
// reports that an earlier copy may already have been delivered. Topic
// names Kafka never accepts (empty, over 249 characters, characters other
// than a-z, A-Z, 0-9, '.', '_' and '-') are refused before anything is
// sent, as a permanent error wrapping sarama.ErrInvalidTopic.
//
// # Kafka: a producer that cannot make progress
//
// An idempotent producer can end up out of step with the brokers after
// broker trouble: its sequence numbers or epoch refused, or every publish
// failing although the cluster is healthy again. The Kafka publisher
// replaces it (only the one of its producers concerned) with a new
// producer (a new producer id): at once when the
// brokers refuse its state, and after KafkaConfig.StallTimeout (default
// 30s) of publishes that all failed without one acknowledgement, or of
// publishes of one bucket that all failed while other buckets' went
// through (sarama can keep producing to a partition on a connection
// whose broker answers NOT_LEADER_FOR_PARTITION while the metadata names
// it the leader; only new connections end that). Failures on an unknown
// topic, or of messages refused for good, are about the message and do
// not count. It is also replaced, through ProbeSink
// (relay.SinkProber), when a broker answers again after a failed probe
// while the producer's publishes had been failing since before it
// (ReplaceBrokersBack): sarama's circuit breakers, opened by the outage,
// would fail its next publishes for up to 10s more. The new
// producer serves the next Publish; the old one is closed once the
// messages it holds have their results. Replacements are at least 1s
// apart, doubling while they do not help, are logged at Warn, counted by
// Kafka.Replacements and reported to KafkaConfig.Observer
// (outbox_publisher_producer_replacements_total with *metrics.Collector).
// A slot's two producers (the routing by size) keep their progress and
// are replaced each on its own: a stall that catches both counts two
// replacements, and one refused by the brokers leaves the other in
// service. A bucket whose cancelled Publish left messages in a producer
// that is then replaced goes on through the replacement: the new
// producer's records may then reach the brokers ahead of the old one's
// last ones, as with a single producer per slot.
package publisher
