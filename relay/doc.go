// Package relay is the storage-agnostic engine that moves outbox messages
// from a database to a sink. It leases buckets of the outbox, reads each
// owned bucket oldest-first, hands batches to a Publisher and deletes what
// the publisher acknowledged. It imports no database API: storage is behind
// the small Store interface; the GORM implementation is in
// package gormrelay (gormrelay.NewStore). It is the relay step of write →
// table → relay → publisher.
//
// WAL mode publishes through the same engine: a pgwal.Reader runs one
// relay per term of reading the slot, over a Store of its own whose
// buckets are the decoded messages queued in memory (all of them leased
// under the reader's term while it holds the slot's lease), woken by
// Hints from the stream, with a FailureHandler and BatchFilter of table
// mode's semantics (see pgwal and docs/wal-mode.md). What follows holds
// for both modes, with "row" read as "queued message" and "delete" as
// "take out of the queue" in WAL mode.
//
//	store, _ := gormrelay.NewStore(db, cfg)
//	r, _ := relay.New(store, publisher, relay.Config{Hints: notifier})
//	_ = r.Start(ctx)
//	defer r.Stop(shutdownCtx)
//
// # The engine
//
// A started relay is three parts with one job each:
//
//   - the lease keeper, the only writer of lease state: acquisition,
//     renewal, fair share and the trust deadline. Each lease it holds
//     carries a context that ends when the lease is lost, when the trust
//     window passes without a renewal, or when the relay releases the
//     bucket; a publish runs under that context, so it is cancelled by
//     any of the three.
//   - the scheduler: the ready buckets in a fair FIFO queue, one state
//     per bucket (ready, in flight, backoff, the batch cap after a
//     failure), fed by hints and discovery.
//   - a pool of Config.Parallelism drainers (default 8). A drainer takes
//     the bucket at the head of the queue, drains one batch of it under
//     its lease, and hands it back: to the back of the queue if the batch
//     was full. The scheduler never hands one bucket to two drainers, so
//     one drainer at a time handles a bucket's batches while other
//     buckets' database round trips and publishes overlap with them: one
//     batch in flight at a time, or up to Config.PipelineDepth with a
//     Pipeliner publisher (see Pipelined batches).
//
// The ties between the parts run one way. The keeper calls only the
// store and the Observer: it reports what changed (leases ended or
// gained, an acquisition or a discovery asked for, a misconfiguration
// met by the renewal) as lease events, collected until taken and
// signalled on a one-slot channel. The scheduler knows nothing of
// leases: it is told which buckets are ready and signals when no batch is
// in flight. Drainers ask the keeper whether a lease is still trusted,
// tell it of a lease they found lost, and hand buckets back to the
// scheduler. The control loop is the one place that joins them: it takes
// the keeper's events and applies them to the scheduler (a bucket whose
// lease ended is forgotten unless held again, a newly held one starts
// without backoff), acquires, announces, and turns hints and discovery
// into ready buckets. A bucket whose lease ends before the loop took the
// event is still never published under it: a drainer that takes it finds
// the lease gone and hands it back.
//
// Acquisition (which releases surplus leases and claims new ones) does
// not wait for the batches in flight: the scheduler starts no new batch
// during the store call, and the call names the buckets in flight
// (AcquireRequest.Busy), whose leases the store keeps; their surplus goes
// at a later acquisition, between batches. A LeaseAware publisher is told
// of a bucket's change only while that bucket has no batch in flight (a
// change met during its batch is announced when the batch ends), and a
// drainer takes a newly acquired bucket only once it was announced. A
// bucket is therefore never released, or announced, during its own
// publish, and a slow or hung publish of one bucket holds up neither the
// lease maintenance nor the other buckets. Renewal runs on the keeper's
// own goroutine at any time.
//
// With Parallelism above 1 the Publisher, the Store and the
// FailureHandler are called concurrently for different buckets, never
// for the same bucket. Parallelism 1 drains one bucket after another.
//
// # One batch
//
// Every batch is one bucket's, and goes through one path (drainBatch), a
// step per invariant, in this order:
//
//   - reconcile: with a Reconciler publisher, before the first batch
//     under a lease and before the next batch after one that ended in
//     doubt (a publish that failed or was cancelled, a failed delete), the
//     row ids the sink says it already holds are deleted by MarkPublished
//     under the lease; nothing is read or published until that succeeded;
//   - read: the bucket's oldest rows, read afresh, or the batch read ahead
//     with the previous delete (BatchAdvancer) under the same term;
//   - filter: the failure handler's BatchFilter may take messages out;
//   - admit: wait for Config.RateLimit's pace, then check the lease is
//     still trusted before anything reaches the publisher;
//   - publish: under the lease's context; only the acknowledged prefix
//     counts, and a count outside the batch deletes nothing;
//   - fenced: a sink that fenced the bucket (IsFenced) makes the rows the
//     new owner's, and nothing is deleted;
//   - delete: the acknowledged prefix by id, guarded by the lease in the
//     same statement, even when the relay is stopping; after a batch
//     published completely, not full, of a bucket hinted meanwhile, the
//     delete runs alongside the next batch's publish (see The batch
//     cycle);
//   - lease ended: after a lease lost during the publish, the rest is the
//     new owner's;
//   - failure policy: publish the rest at once after a prefix the
//     publisher took on purpose (IsTruncated), narrow the failure to its
//     culprit (FailedIndex, IsBatchRejected), or record it and ask the
//     FailureHandler (see Failures).
//
// The scheduler then backs a failed bucket off, and a lease announcement
// that waited for the batch goes out (LeaseAware).
//
// # The batch cycle
//
// With a store that has the BatchSkipper capability (gormrelay.Store
// has), a batch's delete is off the path to its bucket's next publish.
// When a batch that was not full was published completely and a hint or
// discovery marked its bucket while the batch was read or published, the
// drainer keeps the bucket:
// it reads the next batch without the published batch's rows
// (NextBatchExcept, the rows NextBatch would read once they are
// deleted), starts the delete, and runs the next batch's filter, admit
// and publish while the delete runs; it waits for the delete before that
// batch's own delete or the end of its turn. So a message committed while
// its bucket's batch is in flight waits for that publish and one read,
// not for the delete too, and a drainer still holds one database
// connection at a time. The scheduler's marks tell whether a hint came
// after the last read began: one that the read covered does not read the
// bucket again. The drainer hands the bucket back when its next read
// finds nothing, when a batch is full (its delete then reads the next one,
// BatchAdvancer, and the bucket goes to the back of the queue), after 64
// batches, or as soon as another bucket waits in the queue, an
// acquisition holds the scheduler, or a lease announcement waits for the
// bucket. Full batches are not deleted alongside: in a drain that did so
// the relay ran at 0.37 of the rate it had with the delete and the next
// read back to back (BENCHMARKS.md, "The delete off the critical path").
//
// What holds: a bucket's next batch is handed to the publisher only
// after the previous Publish returned with every message acknowledged
// (but with a Pipeliner, below), so per-key order rests on the publisher
// as before; a batch that failed
// or was cut short is deleted in turn and handled as above. A delete that
// fails (lease lost, database error) while the next batch is published
// ends the bucket's turn without deleting that batch: both are published
// again, in order, by this relay after its backoff or by the lease's new
// owner, at least once as always. With a LeaseAware or Reconciler
// publisher (the strict mode's, publisher.Transactional, whose progress
// marker names only the last batch it committed) every delete comes
// before the bucket's next read, as without a BatchSkipper.
//
// # Pipelined batches
//
// With a publisher that implements Pipeliner (Send hands a batch to the
// sink behind the earlier ones and returns; its wait returns what Publish
// would), a store with BatchSkipper, Config.PipelineDepth above 1
// (default 4), and a publisher that is neither LeaseAware nor a
// Reconciler (the strict mode keeps the sequence above), the drainer keeps
// up to PipelineDepth batches of its bucket in flight (drainBatch's
// pipelined variant). The first batch is read, filtered and admitted as
// above, then sent; while the oldest batch in flight is unacknowledged,
// a hint or discovery that marked the bucket since the last read reads
// the next batch without the rows in flight (NextBatchExcept with every
// message in flight) and sends it behind them. So a message committed
// while its bucket's batch is in flight waits for one read, not for that
// batch's acknowledgements. The scheduler signals the drainer of each
// mark of its bucket, so the hint is seen while the drainer waits.
//
// What holds:
//
//   - order per key: a batch is cut before its first message whose key
//     has a message in a batch whose acknowledgements have not all come
//     back (the rest is read once the oldest batch ends), and nothing is
//     sent behind a batch known to have failed. A message is therefore
//     never sent while an earlier message of its key may still fail: a
//     sink fails the messages queued behind a failed one, not one that
//     reaches it after the failure and before the relay saw it, so the
//     relay does not rest on the Pipeliner's own order across sends for
//     that;
//   - only an acknowledged prefix of the bucket is deleted, in bucket
//     order: batches end in the order they were sent, and a batch
//     acknowledged completely is deleted (guarded by the lease) only
//     after every earlier batch was acknowledged and deleted, after the
//     next batch was sent when there is one;
//   - a batch that failed, was acknowledged in part, or lost its lease
//     stops the sends; every later batch in flight is awaited, nothing of
//     them is deleted (their rows are published again: a duplicate at
//     worst, never a loss), and the batch ends as the last batch of a
//     turn does: its acknowledged prefix deleted, the lease check, the
//     failure policy on its first unacknowledged message;
//   - a lost lease ends the context of every send, so every wait ends; a
//     stop sends nothing more and lets the batches in flight end as a
//     Publish does (a graceful stop waits for them, a cancelled one
//     cancels them);
//   - each batch is reported to the Observer on its own, when its wait
//     returns (PublishEvent: its messages, its acknowledged count, the
//     time from its Send to that return).
//
// A drainer goes on while fewer than PipelineDepth batches are
// unacknowledged (a batch acknowledged behind a slower one waits for its
// delete, not for the sink, and counts only against the bound of 4 ×
// PipelineDepth batches in flight or waiting for their delete: their
// rows are left out of every read) and the scheduler is open, not acquiring, and no lease announcement
// waits for the bucket; other buckets waiting in the queue stop it once
// nothing is in flight (a batch in flight holds the drainer anyway) or
// after 64 batches in the turn. With no other bucket waiting the turn
// goes on past 64 batches: ending it would stall the bucket until its
// batches in flight are acknowledged (in the model of
// TestPipelineModel, 1.2 % of the messages waited for such an end).
// The depth that keeps a bucket from waiting is the send's latency over
// the time between its batches: PipelineDepthDefault (4) covers 32 ms at
// 1,000 messages per second over 8 buckets (docs/configuration.md has
// the model's figures). The last batch, acknowledged with
// nothing in flight and no hint to follow, ends the turn as without a
// Pipeliner (a full one deleted with the next read, BatchAdvancer). Tests:
// relay/pipeline_test.go, with a sink that completes sends out of order
// in time and fails the messages queued behind a failed one of their key.
//
// The optional capabilities (LeaseRenewer, FailureRecorder,
// BatchAdvancer, the store's FailureHandler, the handler's BatchFilter,
// Config.RateLimit) are resolved once, by New: each missing one is
// replaced by a fallback that does what the relay does without it (no
// renewal, the publish bounded by the trust window; no attempt recorded;
// a delete with nothing read ahead; FailureBackoff; every message kept;
// no pacing), so the batch path has no branch on them. BatchSkipper,
// resolved there too, is the one the path asks about: without it, or
// with a LeaseAware or Reconciler publisher, each delete comes before the
// next read. A Pipeliner is the other: with it (and a BatchSkipper) the
// batches take the pipelined variant.
//
// A batch never spans buckets. Batches of several ready buckets (one
// read, one publish, one delete guarded per bucket) were built and
// measured, and drained a backlog slower than one-bucket batches, so they
// were removed: on PostgreSQL with kfake, same binary, runs interleaved
// A B B A A B, the median drain of 100,000 rows was 161k msg/s over 8
// buckets and 139k over 256 with one-bucket batches, against 130k and
// 88k with batches of up to 64 buckets (outbox-bench -scenarios drain
// -max-batch-buckets 1 and 64, built at aa1845d, on a shared machine
// at load 4 to 10).
//
// Delivery is at least once. A message is deleted only after the publisher
// acknowledged it; a crash, a lost lease or a failed delete can publish it
// again, never drop it. Every message carries a stable MessageID for
// consumers to deduplicate on. A publisher that implements Reconciler
// closes the window between the sink's commit and the delete: the
// strict-mode Kafka publisher records each transaction's row ids in the
// transaction, and the relay that takes a bucket over (or this relay,
// after a failed delete) deletes those rows before it reads the bucket,
// so read_committed consumers see each message once
// (gormrelay's TestStrictTakeoverDeletesCommittedRows and
// TestStrictFailedDeleteNotRepublished check it on every database,
// against kfake or the Apache Kafka of KAFKA_BROKERS). This relies on
// store ids never being reused: the relay deletes the ids the publisher
// names, and only when they are all in the bucket and hold the messages
// the record's digest names (MessagesDigest), so a record that is not
// this store's deletes nothing (TestStrictSharedPrefixLosesNothing).
// A store that replays a log from a restart point rather than deleting
// rows (WAL mode) sets Message.Position; the publisher records the
// batch's last message's position and digest (Committed.Position,
// LastDigest), and the store skips, before the engine reads the bucket,
// the replayed messages up to that message (package pgwal,
// docs/strict-mode.md "WAL mode"). The engine itself ignores them.
//
// # Buckets and ordering
//
// Writers put each message in one of BucketCount buckets, by key (or by
// pinned partition). BucketCount is set once, on the writers' outbox
// configuration; a store that knows it (BucketCounter) gives it to the
// relay, and a relay.Config value that disagrees is refused by New.
// Within a bucket, the store's row id is the submission
// order. One relay at a time drains a bucket, in id order, one batch at a
// time (or several in flight with a Pipeliner, acknowledged and deleted
// in order), and deletes exactly the contiguous prefix the publisher
// acknowledged, by id list. If the publisher acknowledges 2 of 5 messages
// and fails on the third, the first two are deleted and the next attempt
// starts again at the third: order is kept, nothing is skipped.
//
// The relay keeps no id cursor. Row ids are assigned at insert, but rows
// become visible at commit, so a slow transaction can commit a smaller id
// after larger ones were already published. Every batch is read afresh from
// the start of the bucket, and deletion names ids, never a range, so such
// a row is published on the next read rather than skipped. A store with
// the BatchAdvancer capability deletes a batch and reads the next one
// from the head of the bucket in one round trip; the relay uses it after
// a full batch and publishes that read ahead as the bucket's next batch
// when it hands the bucket back rather than go on with it (The batch
// cycle).
//
// # Leases and terms
//
// Each bucket has one lease row: owner, term and expiry (Unix milliseconds).
// All coordination is one primitive, a guarded conditional UPDATE:
//
//   - acquire: set owner = me, term = term + 1, expiry = now + LeaseDuration
//     where the lease is free or expired (and its term is the one just read);
//   - renew: set expiry = now + LeaseDuration, unless it is later already,
//     where owner = me and term = my term and expiry > now (the relay's
//     acquisition and renewal run concurrently and may land in either
//     order: an expiry never moves back);
//   - release: clear the owner where owner = me and term = my term;
//   - delete published rows: delete by id where, in the same statement, the
//     bucket's lease has owner = me, term = my term and expiry > now.
//
// The term grows on every acquisition by any relay, so the pair (owner,
// term) names one tenure. A relay whose lease expired and was taken over, or
// that released a bucket and acquired it again, still holds the old term:
// its renewals and deletes match no row and are refused (ErrLeaseLost). It
// drops the bucket and leaves the rows to the current owner. No transaction
// or row lock is held while the publisher runs.
//
// An operator can revoke a tenure without ending the ownership: the GORM
// store's admin API advances the term of a bucket whose dead letters it
// requeues, purges or discards, and the row still names the relay. The old
// term is refused like any lost one, the error wraps ErrLeaseRevoked too,
// and the relay takes the bucket under the new term at its next
// acquisition. It logs that at Info and reports it to a RevocationObserver,
// not as an expired lease.
//
// The first relay of an outbox creates the lease rows of every bucket in an
// empty lease table; from then on the table defines BucketCount, and a
// relay with another count is refused before it writes anything.
//
// # Trusting a lease locally
//
// The database is the authority, but a relay also bounds how long it
// believes its last answer. After each successful acquisition or renewal
// it trusts its leases until
//
//	attempt start + LeaseDuration - (LeaseDuration - LeaseRenewInterval)/2
//
// measured on the monotonic clock from before the call, so the local
// deadline always ends before the stored expiry. The relay reads and
// publishes a bucket only inside that window. When the window ends without
// a renewal (database unreachable, process stalled) it stops publishing,
// cancels any publish in flight, and only resumes after acquiring again.
//
// # Renewal during a slow publish
//
// Leases are renewed every LeaseRenewInterval by the acquisition, and
// whenever the acquisition is late (it waits for the batches in flight) by
// the keeper's renewal goroutine through the store's LeaseRenewer
// capability, concurrently with the publishers, so a healthy publish that
// takes longer than LeaseDuration (Kafka retrying a slow broker) keeps its
// buckets. If the renewal reports the bucket lost, or the trust window
// ends, the lease's context ends and with it the publish; the relay waits for
// the publisher to return, deletes what was acknowledged if the term guard
// still allows it, and leaves the rest to the new owner. It never starts
// another publish for a bucket it no longer trusts. A store without a
// LeaseRenewer gets no renewal during publish: the publish is bounded by
// the trust window instead.
//
// Renewal cannot outlast a stall longer than the remaining lease (a frozen
// process, a database outage): another relay may take over while records of
// the stale publish are still in flight to the sink. That produces
// duplicates, and possibly an older copy after a newer message of the same
// key, never loss. Consumers deduplicate on the message id.
//
// # Fair share
//
// Every relay writes a heartbeat at each acquisition. A relay is live while
// its heartbeat is younger than LeaseDuration. Each relay aims for
// FairShare = ceil(BucketCount / live relays): at every acquisition
// (about every LeaseRenewInterval) it renews what it holds, releases leases
// above its share, and claims free or expired leases up to its share. The
// shares add up to at least BucketCount, so every bucket has an owner once
// the relays have converged, and a relay that dies without releasing loses
// its buckets to the others when its leases expire. A relay that stops
// cleanly releases its leases and removes its heartbeat, so the others take
// its buckets over at their next acquisition, not after LeaseDuration.
// That includes leases it stopped trusting before the stop (a late
// renewal, a publish that found its lease lost): the store may still
// record them as its own, and its owner + term guard leaves alone any a
// peer has taken since. The renewal is stopped and awaited before the
// release, but a statement the relay abandoned on its cancelled context
// may still run on the database after the release: the GORM store's
// heartbeat then updates no row (the release deleted it), and its claim
// claims nothing (the release advanced the terms the claim names)
// (gormrelay TestReleaseFencesLateStatements, on every database).
// A bucket is released only between its batches, never while its publish
// is in flight. BucketCount bounds the parallelism: extra relays stay
// live, own nothing and wait.
//
// # Wake-ups
//
// Ready buckets wait in a FIFO queue and each turn drains one batch, so a
// busy bucket cannot starve the others: a bucket whose batch came back
// full goes to the back of the queue and is read again without a
// discovery query; one that came back short is done until something says
// otherwise (a hint that arrived during its batch makes it ready again).
// Three things make a bucket ready:
//
//   - a hint: Config.Hints (the outbox's after-commit Notifier) names the
//     buckets that received committed messages and wakes the relay at
//     once; an owned hinted bucket is read directly, a hint for a bucket
//     owned elsewhere is ignored, an unknown-bucket hint forces discovery;
//   - discovery: every PollInterval a relay owning buckets asks the store
//     which of them hold rows (one index probe per bucket), of those
//     neither ready nor in flight. A bucket in flight is not probed but
//     read again after its batch, as if a probe had found rows. This is the
//     correctness floor for writers in other processes, lost hints and
//     restarts. Acquiring new leases triggers a discovery at once. It
//     runs beside the control loop, which goes on taking hints meanwhile;
//     a discovery asked for while one runs follows it.
//
// Hints only shorten latency; they never bypass ownership, backoff or
// ordering. A relay owning no buckets does not poll: it sleeps until its
// next acquisition.
//
// # Failures
//
// A failed publish (an error, or fewer messages acknowledged than sent)
// deletes the acknowledged prefix, records the attempt on the first
// unacknowledged message if the store implements FailureRecorder, calls the
// FailureHandler (Config.FailureHandler, else the store's) if any, and
// backs the bucket off exponentially with
// jitter (BackoffMin doubling to BackoffMax). The same messages are retried
// in the same order; other buckets keep flowing. A success resets the
// backoff. Store errors are retried with the same backoff. Stop and
// cancellation are not failures.
//
// A database outage does not leave the relay asleep once it is over.
// After a failed acquisition or discovery, or a failed store call of a
// drainer (a read, a delete, the delete of reconciled rows, the failure
// handler's filter, which the GORM store's policy runs on its database),
// a store that
// can be probed (Prober; the GORM store runs SELECT 1) is probed every
// max(BackoffMin, ProbeIntervalMin) beside the control loop, one probe at
// a time, while the call or the bucket waits for its retry; the first
// probe that answers after the store was seen down (a failed call, or a
// failed probe since) retries at once the acquisition, the discovery and
// the batches of the buckets backing off after a store call, instead of
// after a backoff of up to BackoffMax (30s). The buckets keep their
// failure counts, so one that fails again backs off longer. A call that
// fails while the probe answers (a missing privilege, a lock timeout)
// keeps its plain backoff: after an early retry, a probe must fail
// before an answer ends a backoff again. The end of an outage is logged
// once at Info ("relay: the store answers again; retrying now", with
// down_for); the probes log nothing. The store and the sink (below) are
// watched alike, by one type (watch.go), each retrying only the buckets
// that failed on it. Tests: gormrelay TestRelayResumesWhenDatabaseAnswers
// and TestRelayRetriesBucketsWhenDatabaseAnswers (a TCP gate in front of
// PostgreSQL cuts the relay off until its backoff reaches BackoffMax),
// relay TestProbeEndsTheBackoffWhenTheStoreAnswers,
// TestProbeEndsTheBackoffOfDrainersStoreFailures (only the drainers'
// reads or deletes fail; the loop's own calls succeed),
// TestProbeRetriesBucketsAfterTheLoopsCallsAnswered (the loop's
// acquisition answers again before a probe does, the bucket still backs
// off) and
// TestProbeAnsweringKeepsTheBackoffOfAFailureItDoesNotSee. In the two
// gormrelay tests the first publish after the database answered again
// began 0.11s after it (medians of 3), against 2.98s and 2.57s (the
// backoffs slept out) with the engine of ccd5529, runs interleaved, load
// average 8 to 11: CI=true go test -race -count=1 -v -run
// 'TestRelay(Resumes|RetriesBuckets)WhenDatabaseAnswers' ./gormrelay/.
//
// A sink outage does not either. After a publish failed as unavailable
// (IsUnavailable, below), a publisher that can be probed (SinkProber; the
// Kafka publishers open a new connection to a bootstrap broker and send
// it an ApiVersions request) is probed every max(BackoffMin,
// ProbeIntervalMin) while buckets back off for that reason; the first
// probe that answers after the sink was seen down (the failed publish, or
// a failed probe since) retries those buckets at once instead of after
// their backoff. As with the store, the buckets keep their failure
// counts, and a publish that fails again while the probe answers keeps
// its plain backoff until a probe fails; a failure that is not
// unavailable (a message refused for good, an unknown topic) is never
// probed for. ReadyChecker is no probe: it reads the publisher's own
// state. A Kafka publisher whose probe answers first replaces its
// producers that kept failing (publisher.ReplaceBrokersBack): sarama's
// circuit breakers open during an outage and would fail the first
// publishes after it for up to 10s more. The end of an outage is logged
// once at Info ("relay: the sink answers again; retrying now", with
// down_for). Tests: relay TestSinkProbeEndsTheBackoffWhenTheSinkAnswers,
// TestSinkProbeAnsweringKeepsTheBackoffOfAFailureItDoesNotSee,
// TestSinkProbeIgnoresFailuresAboutTheMessage, TestSinkProbeSecondOutage;
// publisher TestProbeSinkSeesTheBrokersGoAndReturn,
// TestProbeSinkKeepsAProducerFailingWhileBrokersAnswer,
// TestKafkaNoReplacementForUnknownTopic; gormrelay
// TestKafkaReturnEndsTheBackoff (every database; kfake drops every
// connection until four publishes failed, BackoffMin 2s, so the bucket
// still backs off at least 8s: the message is published before that).
// From the brokers answering again to the first publish, runs
// alternating without the probe (the publisher's SinkProber hidden:
// the relay before it) and with it, three of each, on SQLite: on kfake
// (TestMeasureKafkaReturn, BackoffMin 2s, the outage held until four
// publishes failed) 10.00 / 11.61 / 12.10s without (median 11.61s)
// against 0.49 / 0.67 / 0.97s with (median 0.67s), load average 21.0 at
// the start, 17.3 at the end: OUTBOX_MEASURE_SINK_PROBE=1 CI=true go test
// -count=1 -run 'TestMeasureKafkaReturn$' -v ./gormrelay/.
// On a one-node Apache Kafka 4.4 (scripts/kafka.sh) killed and started
// again once seven publishes failed, with the default backoff
// (TestMeasureKafkaNodeReturn, timed from the node's first ApiVersions
// answer): 0.37 / 7.21 / 26.22s without (median 7.21s; what is left of a
// 15 to 30s backoff when the node is back varies with its start) against
// 0.63 / 0.69 / 0.72s with (median 0.69s; the probe interval is 500ms),
// load average 17.3 at the start, 13.7 at the end:
// OUTBOX_KAFKA_DIR=... OUTBOX_KAFKA_PORT=... KAFKA_BROKERS=...
// OUTBOX_MEASURE_KAFKA_NODE=1 CI=true go test -count=1 -timeout 30m -run
// TestMeasureKafkaNodeReturn -v ./gormrelay/. A probe costs a new
// connection: 5.17 / 8.06 / 0.72ms (median 5.17ms) against 1.74 / 1.09 /
// 1.07ms (median 1.09ms) for publishing one message, on the same node,
// alternating, load average 15.4 to 17.3: KAFKA_BROKERS=... go test
// -run '^$' -bench ProbeSink -benchtime 300x -count 1 ./publisher/, three
// times.
//
// Two kinds of failure are not held against the message:
//
//   - IsUnavailable: the sink could not take the write (connection
//     refused, brokers down, timeouts, no leader), or the publish outlasted
//     Config.PublishTimeout (ErrPublishTimeout). The bucket backs off and
//     retries; no attempt is recorded and the FailureHandler is not called,
//     so an outage of any length dead-letters nothing.
//   - IsBatchRejected: the sink refused several messages at once for what
//     one of them may have caused. The relay publishes the first half of
//     the rest on its own, at once, halving until the refused batch is one
//     message, which then meets the failure path above.
//
// Problems that retrying cannot fix are a *MisconfigurationError: rows in
// buckets at or above BucketCount (a writer configured with more buckets),
// relays or stores disagreeing on BucketCount, outbox tables that do not
// exist. Start and Run return them when the store can check them up front
// (StartChecker; the GORM store can: a writer's rows in buckets 8..63 next
// to an 8-bucket relay fail Start with the highest bucket and both
// counts), and a publisher that cannot publish at all when it can tell
// (ReadyChecker; the Kafka publishers can: one never started fails Start
// with an error wrapping publisher.ErrNotStarted); found later, for example rows a
// writer with more buckets committed after the start (the GORM store
// checks at every discovery poll), they stop the relay, which releases its
// leases, reported by Err and Stopped. The relay never spins on them
// silently. A *MisconfigurationError from the publisher (Publish, or
// LeasesAcquired of a relay.LeaseAware one), such as a Kafka publisher
// that was never started, stops the relay the same way; nothing is
// recorded against the message. Invalid Config values are refused by
// New with a *ConfigError, including LeaseRenewInterval >= LeaseDuration.
//
// # Clocks
//
// Lease expiries and heartbeats are written from the relay hosts' clocks
// (Unix milliseconds) and compared on the database server, identically on
// every database. Relay clocks must therefore agree. The tolerated skew
// depends on whether the owner's renewals succeed:
//
//   - While they succeed it is the renewal slack, LeaseDuration -
//     LeaseRenewInterval (20s with the defaults): the owner renews about
//     every LeaseRenewInterval, so its stored expiry always reaches at least
//     that far ahead of its own clock, and a peer whose clock runs ahead by
//     less still sees the lease as live.
//   - While they fail (database unreachable from the owner only, a stalled
//     process) it is half that, (LeaseDuration - LeaseRenewInterval)/2 (10s
//     with the defaults): the owner stops publishing at the end of its
//     trust window, which ends that long before the stored expiry by its
//     own clock, and a peer takes the bucket over at the stored expiry by
//     the peer's clock. A peer running ahead by more than the margin takes
//     over while the old owner may still be publishing.
//
// Larger skew lets a fast-clocked relay take over a peer's buckets early,
// so two relays can publish a bucket at once. Even then the
// term guard keeps the stale relay from deleting or renewing anything; the
// cost is duplicate deliveries and a possibly broken order per key, not
// loss. Ordinary NTP is far inside the
// tolerance.
//
// # Lifecycle
//
// Run is the recommended form: it starts the relay with Start's checks,
// blocks, and returns nil after a graceful stop at the end of its context
// (bounded by Config.ShutdownTimeout, default 10s) or the relay's fatal
// error as soon as it stops on one. Under errgroup, beside an HTTP server,
// a relay that fails ends the group instead of stopping unnoticed:
//
//	g, ctx := errgroup.WithContext(ctx)
//	g.Go(func() error { return r.Run(ctx) })
//	g.Go(func() error { return serveHTTP(ctx) })
//	return g.Wait()
//
// Start is the backgrounding form. It runs the same checks synchronously
// (the store's StartChecker, the publisher's ReadyChecker) and runs the
// relay in the background; watch Stopped and Err. Stop is synchronous: it
// stops handing out batches, lets the in-flight batches finish within the
// context's deadline (cancelling them after), and releases the leases
// under context.WithoutCancel, bounded by Config.ReleaseTimeout (5s); it
// returns at most StopOverrun (5s) after
// its context ended, the relay finishing in the background if a publisher
// or the database ignores cancellation. Stop tolerates being called before
// Start and twice. Stopped is closed when the relay has stopped, and Err
// tells why. DrainOnce is the one-shot alternative for jobs and tests:
// acquire, drain every owned bucket until empty, acquire again if a lease
// lapsed meanwhile, release; pending rows in buckets it could not own are
// reported as a *NotOwnedError. A misconfiguration DrainOnce meets is
// reported by Err like a failed start's, and a DrainOnce that ran
// without one clears such an error.
//
// With Config.OwnPublisher the relay owns the publisher's lifecycle
// (PublisherService, which publisher.Kafka and publisher.Transactional
// implement; gormrelay.NewKafka sets it): Start and Run start the
// publisher after the store's check and fail if it cannot connect, and the
// relay stops it after it stopped, bounded by ShutdownTimeout, before
// Stopped is closed. Without it the caller starts the publisher before the
// relay and stops it after.
//
// Every publish is bounded by Config.PublishTimeout (default 1m), far above
// what a healthy sink needs; a publish past it is cancelled, counted as a
// failure wrapping ErrPublishTimeout and backed off.
//
// Several outboxes (different tables) in one process are independent:
// give each its own Store and Relay.
//
// # Writing a store
//
// Package relay/storetest is the conformance suite of the Store contract
// and of each optional capability: run storetest.Run from a test of your
// store with a Harness that creates an empty outbox and inserts messages.
// The GORM store and the engine's own in-memory test store pass it.
package relay
