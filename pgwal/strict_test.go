package pgwal_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// strictPublisher starts a strict-mode publisher with prefix, stopped when
// the test ends.
func (e *env) strictPublisher(t *testing.T, prefix string) *publisher.Transactional {
	t.Helper()
	tx, err := publisher.NewTransactional(publisher.TransactionalConfig{
		Brokers: e.kafka.Brokers(), TransactionalIDPrefix: prefix, Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	require.NoError(t, tx.Start(t.Context()))
	t.Cleanup(func() { _ = tx.Stop(context.Background()) })
	return tx
}

// dieAfterCommits is a strict-mode publisher whose reader dies after its
// n-th committed Kafka transaction (counting those of at least minBatch
// messages), before the reader learns of it: the reader's context is
// cancelled and the publish reports a failure, so nothing of the batch is
// marked published or confirmed. Every later publish fails without
// reaching Kafka.
type dieAfterCommits struct {
	*publisher.Transactional
	left     atomic.Int64
	minBatch int
	dead     atomic.Bool
	die      context.CancelFunc
	killed   atomic.Int64 // the size of the batch committed last
}

func (d *dieAfterCommits) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	if d.dead.Load() {
		return 0, errors.New("test: the reader is dead")
	}
	n, err := d.Transactional.Publish(ctx, msgs)
	if err == nil && n > 0 && n >= d.minBatch && d.left.Add(-1) == 0 {
		d.dead.Store(true)
		d.killed.Store(int64(n))
		d.die()
		return 0, errors.New("test: the reader died after the Kafka commit")
	}
	return n, err
}

// checkExactlyOnce waits until a read_committed consumer of e's topic sees
// every value 0..n-1 of every key, then requires each exactly once and in
// order per key.
func (e *env) checkExactlyOnce(t *testing.T, keys, n int) {
	t.Helper()
	var recs []kafkatest.Record
	require.Eventually(t, func() bool {
		recs = e.kafka.ReadLog(t, e.topic, 30*time.Second, kafkatest.ReadCommitted())
		return len(recs) >= keys*n
	}, 60*time.Second, 100*time.Millisecond, "every message reaches Kafka")
	next := map[string]int{}
	for _, r := range recs { // ordered by partition, then offset: per-key order
		key, seqText, _ := strings.Cut(string(r.Value), ":")
		seq, err := strconv.Atoi(seqText)
		require.NoError(t, err)
		require.Equal(t, next[key], seq, "key %s: %d follows %d (a duplicate or a gap)", key, seq, next[key]-1)
		next[key]++
	}
	for k := range keys {
		require.Equal(t, n, next["k"+strconv.Itoa(k)], "key k%d", k)
	}
	require.Len(t, recs, keys*n, "nothing twice")
}

// TestStrictTakeoverPublishesNothingTwice: a strict-mode reader dies
// after a Kafka transaction committed and before its position was
// confirmed; the reader that takes the slot over replays those messages
// and publishes none of them again: a read_committed consumer sees every
// message once, in order per key.
func TestStrictTakeoverPublishesNothingTwice(t *testing.T) {
	e := setup(t)
	prefix := fmt.Sprintf("wal-strict-%d-", time.Now().UnixNano())
	ctx, die := context.WithCancel(t.Context())
	first := &dieAfterCommits{Transactional: e.strictPublisher(t, prefix), die: die}
	first.left.Store(3)
	r1 := e.reader(t, first, "first")
	e.write(t, 4, 0, 60)
	go func() { _ = r1.Run(ctx) }()
	<-r1.Stopped()
	require.NoError(t, r1.Err())
	require.True(t, first.dead.Load(), "the reader died after its third commit")

	r2 := e.reader(t, e.strictPublisher(t, prefix), "second")
	stop := run(r2)
	e.write(t, 4, 60, 80)
	e.checkExactlyOnce(t, 4, 80)
	require.GreaterOrEqual(t, r2.Stats().Reconciled, uint64(first.killed.Load()), "the batch committed last was replayed and skipped")
	// A record is read from Kafka before the reader marks it published.
	require.Eventually(t, func() bool {
		st := r2.Stats()
		return st.Received == st.Published+st.Reconciled
	}, 30*time.Second, 10*time.Millisecond, "every replayed message published or skipped")
	require.NoError(t, stop())
}

// TestStrictForeignRecordDropsNothing: two outboxes (two databases of one
// server) share a TransactionalIDPrefix. The second one's messages were
// written before the first one's last Kafka transaction, whose record the
// second one's reader finds for its buckets: it names messages that are
// not in its replay, so the reader skips nothing and publishes every
// message of its own.
func TestStrictForeignRecordDropsNothing(t *testing.T) {
	a := setup(t)
	b := a.sibling(t)
	prefix := fmt.Sprintf("wal-foreign-%d-", time.Now().UnixNano())
	ra := a.reader(t, a.strictPublisher(t, prefix), "a")
	rb := b.reader(t, b.strictPublisher(t, prefix), "b")
	b.write(t, 4, 0, 30) // before a's records' positions
	stopA := run(ra)
	a.write(t, 4, 0, 30)
	a.checkExactlyOnce(t, 4, 30)
	require.NoError(t, stopA())

	stopB := run(rb)
	b.checkExactlyOnce(t, 4, 30)
	require.Zero(t, rb.Stats().Reconciled)
	require.NoError(t, stopB())
}

// sibling is another WAL-mode outbox, in its own database of the same
// server, publishing to its own topic of e's Kafka cluster.
func (e *env) sibling(t *testing.T) *env {
	t.Helper()
	dbt, p := pgwal.OpenWALOutbox(t)
	return &env{db: dbt, plugin: p, kafka: e.kafka, topic: e.kafka.Topic(t, 4), pub: e.pub}
}

// loseCommitOutcome is a strict-mode publisher whose n-th committed
// Kafka transaction is reported as failed (an outage): the commit's
// outcome is lost, as when the connection breaks during EndTxn.
type loseCommitOutcome struct {
	*publisher.Transactional
	left atomic.Int64
	lost atomic.Int64 // the size of the batch reported failed
}

func (l *loseCommitOutcome) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	n, err := l.Transactional.Publish(ctx, msgs)
	if err == nil && n > 0 && l.left.Add(-1) == 0 {
		l.lost.Store(int64(n))
		return 0, relay.Unavailable(errors.New("test: the commit's outcome is lost"))
	}
	return n, err
}

// TestStrictDoubtfulCommitNotRepublished: within a reading term, a batch
// whose commit succeeded but was reported failed is not published again:
// the engine reconciles the bucket before its next batch, and Kafka's
// record takes the batch out of the queue.
func TestStrictDoubtfulCommitNotRepublished(t *testing.T) {
	e := setup(t)
	pub := &loseCommitOutcome{Transactional: e.strictPublisher(t, fmt.Sprintf("wal-doubt-%d-", time.Now().UnixNano()))}
	pub.left.Store(2)
	r := e.reader(t, pub, "doubt")
	e.write(t, 4, 0, 40)
	stop := run(r)
	e.checkExactlyOnce(t, 4, 40)
	require.Positive(t, pub.lost.Load(), "a commit's outcome was lost")
	require.NoError(t, stop())
}

// TestStrictLongReplaySkipped: the replay of a bucket up to Kafka's
// record of its last batch is longer than the taking-over reader's
// MaxPending: it is set aside, not queued, and skipped once the record's
// last message proves the record this outbox's. Every message arrives
// once, in order.
func TestStrictLongReplaySkipped(t *testing.T) {
	e := setup(t)
	prefix := fmt.Sprintf("wal-long-%d-", time.Now().UnixNano())
	ctx, die := context.WithCancel(t.Context())
	// The batch committed last spans at least 4 transactions of one
	// message: its replay is longer than MaxPending 1.
	first := &dieAfterCommits{Transactional: e.strictPublisher(t, prefix), die: die, minBatch: 4}
	first.left.Store(1)
	r1 := e.reader(t, first, "first")
	for i := range 200 {
		require.NoError(t, e.db.Transaction(func(tx *gorm.DB) error {
			return outbox.Enqueue(tx, &outbox.Message{Topic: e.topic, Key: []byte("k0"), Value: []byte("k0:" + strconv.Itoa(i))})
		}))
	}
	go func() { _ = r1.Run(ctx) }()
	<-r1.Stopped()
	require.True(t, first.dead.Load())

	r2 := e.reader(t, e.strictPublisher(t, prefix), "second", func(c *pgwal.Config) { c.BatchSize, c.MaxPending = 1, 1 })
	stop := run(r2)
	e.checkExactlyOnce(t, 1, 200)
	require.GreaterOrEqual(t, r2.Stats().Reconciled, uint64(first.killed.Load()))
	require.NoError(t, stop())
}
