package badinput_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// badCase is one row of the bad-input table.
type badCase struct {
	name string
	// only restricts the case to one dialect ("" for all).
	only string
	// cfg is the writer's outbox configuration; zero fields take the
	// defaults, and the tables get a prefix of their own.
	cfg outbox.Config
	// noMigrate leaves the outbox tables uncreated.
	noMigrate bool
	run       func(t *testing.T, e *env)
}

var badCases = []badCase{
	{name: "oversized message", run: oversized},
	{name: "invalid topic", run: invalidTopic},
	{name: "nil and empty keys and values are stored and published faithfully", run: nilAndEmpty},
	{name: "header with an empty name or a huge value", run: badHeaders},
	{name: "partition out of range", run: partitionOutOfRange},
	{name: "bucket count mismatch between writer and relay", cfg: outbox.Config{BucketCount: 32}, run: bucketMismatch},
	{name: "relay started before AutoMigrate", noMigrate: true, run: relayBeforeMigrate},
	{name: "write outside a transaction", run: outsideTransaction},
	{name: "payload over max_allowed_packet", only: dbtest.MySQL, cfg: outbox.Config{MaxMessageBytes: -1}, run: overMaxAllowedPacket},
	{name: "database closed mid-batch", run: databaseClosedMidBatch},
	{name: "database backend terminated mid-batch", run: backendKilledMidBatch},
	{name: "context cancelled mid-publish", run: cancelledMidPublish},
}

// TestBadInput runs every bad-input case on every database.
func TestBadInput(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		cluster := kafkatest.Start(t)
		for _, c := range badCases {
			t.Run(c.name, func(t *testing.T) {
				if c.only != "" && c.only != db.Dialect {
					t.Skipf("%s only", c.only)
				}
				c.run(t, newEnv(t, db, cluster, c.cfg, !c.noMigrate))
			})
		}
	})
}

// oversized: a message over MaxMessageBytes is refused with a
// *TooLargeError and its transaction rolls back; one exactly at the limit
// is accepted. Key, value and headers all count.
func oversized(t *testing.T, e *env) {
	limit := e.cfg.MaxMessageBytes
	require.Equal(t, outbox.MaxMessageBytesDefault, limit)

	atLimit := &outbox.Message{Topic: "t", Key: []byte("k"), Headers: []outbox.Header{{Key: "h", Value: []byte("v")}}}
	atLimit.Value = make([]byte, limit-atLimit.Size())
	require.Equal(t, limit, atLimit.Size())
	require.NoError(t, e.write(atLimit), "a message of exactly MaxMessageBytes is accepted")

	items, pending := e.itemRows(), e.pending()
	for _, m := range []*outbox.Message{
		{Topic: "t", Value: make([]byte, limit+1)},
		{Topic: "t", Key: make([]byte, limit), Value: []byte("v")},
		{Topic: "t", Key: []byte("k"), Value: make([]byte, limit-1), Headers: []outbox.Header{{Key: "h"}}},
	} {
		err := e.write(msg("t", "ok", "fine"), m)
		var tl *outbox.TooLargeError
		require.ErrorAs(t, err, &tl)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		require.Equal(t, m.Size(), tl.Size)
		require.Equal(t, limit, tl.Limit)
		require.Equal(t, "t", tl.Topic)
		e.requireRolledBack(items, pending)
	}
}

// invalidTopic: every topic Kafka would refuse is refused at enqueue.
func invalidTopic(t *testing.T, e *env) {
	items, pending := e.itemRows(), e.pending()
	for _, topic := range []string{"", ".", "..", "a b", "a/b", "ä", "a\x00", "orders;DROP", strings.Repeat("x", 250)} {
		err := e.write(msg("good", "k", "v"), msg(topic, "k", "v"))
		var me *outbox.MessageError
		require.ErrorAs(t, err, &me, "topic %q", topic)
		require.Equal(t, "Topic", me.Field)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		e.requireRolledBack(items, pending)
	}
}

// nilAndEmpty: nil and empty keys, values and header values survive the
// database and the Kafka publisher unchanged: a nil key is a null key
// (keyless), an empty key an empty one; a nil value is a tombstone, an
// empty value an empty record.
func nilAndEmpty(t *testing.T, e *env) {
	topic := e.cluster.Topic(t, 3)
	cases := []*outbox.Message{
		{Topic: topic, Key: nil, Value: nil},
		{Topic: topic, Key: []byte{}, Value: []byte{}},
		{Topic: topic, Key: nil, Value: []byte{}},
		{Topic: topic, Key: []byte{}, Value: nil},
		{Topic: topic, Key: []byte("k"), Value: []byte("v"),
			Headers: []outbox.Header{{Key: "nil", Value: nil}, {Key: "empty", Value: []byte{}}, {Key: "dup", Value: []byte("1")}, {Key: "dup", Value: []byte("2")}}},
	}
	require.NoError(t, e.write(cases...))

	// Stored faithfully: NULL is NULL, empty is empty.
	type stored struct {
		MessageID string
		KeyNull   bool
		KeyLen    int
		ValueNull bool
		ValueLen  int
	}
	var rows []stored
	require.NoError(t, e.db.Raw(`SELECT message_id,
		CASE WHEN msg_key IS NULL THEN 1 ELSE 0 END AS key_null, COALESCE(LENGTH(msg_key), 0) AS key_len,
		CASE WHEN msg_value IS NULL THEN 1 ELSE 0 END AS value_null, COALESCE(LENGTH(msg_value), 0) AS value_len
		FROM `+e.db.Statement.Quote(e.cfg.Tables.MessagesTable())).Scan(&rows).Error)
	require.Len(t, rows, len(cases))
	byID := map[string]stored{}
	for _, r := range rows {
		byID[r.MessageID] = r
	}
	for i, m := range cases {
		r := byID[m.ID]
		assert.Equal(t, m.Key == nil, r.KeyNull, "message %d: key NULL", i)
		assert.Equal(t, len(m.Key), r.KeyLen, "message %d: key length", i)
		assert.Equal(t, m.Value == nil, r.ValueNull, "message %d: value NULL", i)
		assert.Equal(t, len(m.Value), r.ValueLen, "message %d: value length", i)
	}

	// Read back by the relay as written.
	var (
		seenMu sync.Mutex // buckets are published concurrently
		seen   []relay.Message
	)
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		seenMu.Lock()
		seen = append(seen, msgs...)
		seenMu.Unlock()
		return 0, errors.New("only looking")
	})
	r, err := relay.New(e.store(nil, 0), pub, e.relayConfig("look"))
	require.NoError(t, err)
	_, _ = r.DrainOnce(context.Background())
	seenMu.Lock()
	defer seenMu.Unlock()
	require.Len(t, seen, len(cases))
	for _, got := range seen {
		var want *outbox.Message
		for _, m := range cases {
			if m.ID == got.MessageID {
				want = m
			}
		}
		require.NotNil(t, want)
		assert.Equal(t, want.Key == nil, got.Key == nil, "%s: key nil-ness after the database", got.MessageID)
		assert.Equal(t, want.Value == nil, got.Value == nil, "%s: value nil-ness after the database", got.MessageID)
		assert.Equal(t, len(want.Headers), len(got.Headers))
		for i := range min(len(want.Headers), len(got.Headers)) {
			assert.Equal(t, want.Headers[i].Key, got.Headers[i].Key)
			assert.Equal(t, want.Headers[i].Value == nil, got.Headers[i].Value == nil, "header %q nil-ness after the database", want.Headers[i].Key)
			assert.Equal(t, string(want.Headers[i].Value), string(got.Headers[i].Value))
		}
	}

	// Published faithfully.
	pub2 := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: e.cluster.Brokers(), Logger: testLogger(t)})
	r2, err := relay.New(e.store(nil, 0), pub2, e.relayConfig("publish"))
	require.NoError(t, err)
	n, err := r2.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(cases), n)
	require.Zero(t, e.pending())

	recs := e.cluster.ReadAll(t, topic, len(cases), 30*time.Second)
	require.Len(t, recs, len(cases))
	for _, rec := range recs {
		var id string
		for _, h := range rec.Headers {
			if h.Key == publisher.MessageIDHeaderDefault {
				id = string(h.Value)
			}
		}
		var want *outbox.Message
		for _, m := range cases {
			if m.ID == id {
				want = m
			}
		}
		require.NotNil(t, want, "record with message id %q", id)
		assert.Equal(t, want.Key == nil, rec.Key == nil, "%s: null key in Kafka", id)
		assert.True(t, bytes.Equal(want.Key, rec.Key))
		assert.Equal(t, want.Value == nil, rec.Value == nil, "%s: null value (tombstone) in Kafka", id)
		assert.True(t, bytes.Equal(want.Value, rec.Value))
		require.Len(t, rec.Headers, len(want.Headers)+1, "the message's headers, then the id header")
		for i, h := range want.Headers {
			assert.Equal(t, h.Key, rec.Headers[i].Key)
			assert.Equal(t, string(h.Value), string(rec.Headers[i].Value))
			assert.Equal(t, h.Value == nil, rec.Headers[i].Value == nil, "header %q: null value in Kafka", h.Key)
		}
	}
}

// badHeaders: a header with an empty name is refused; header names and
// values count towards MaxMessageBytes.
func badHeaders(t *testing.T, e *env) {
	items, pending := e.itemRows(), e.pending()
	err := e.write(&outbox.Message{Topic: "t", Value: []byte("v"), Headers: []outbox.Header{{Key: "ok", Value: []byte("1")}, {Key: "", Value: []byte("x")}}})
	var me *outbox.MessageError
	require.ErrorAs(t, err, &me)
	require.Equal(t, "Headers", me.Field)
	e.requireRolledBack(items, pending)

	limit := e.cfg.MaxMessageBytes
	huge := &outbox.Message{Topic: "t", Value: []byte("v"), Headers: []outbox.Header{{Key: "big", Value: make([]byte, limit)}}}
	err = e.write(huge)
	var tl *outbox.TooLargeError
	require.ErrorAs(t, err, &tl, "a huge header value counts in the size")
	require.Equal(t, huge.Size(), tl.Size)
	require.Greater(t, tl.Size, 1+3+limit)
	e.requireRolledBack(items, pending)

	longName := &outbox.Message{Topic: "t", Value: make([]byte, limit-10), Headers: []outbox.Header{{Key: strings.Repeat("n", 11)}}}
	require.ErrorAs(t, e.write(longName), &tl, "header names count in the size")
	e.requireRolledBack(items, pending)
}

// partitionOutOfRange: a negative partition is refused at enqueue. A
// partition the topic does not have is accepted by the outbox (it does not
// know the topic), refused by the Kafka publisher with a permanent error
// (publisher/doc.go: "an index the topic does not have is a permanent
// error"), and so dead-lettered at once by the default failure policy,
// while the rest of the bucket flows.
func partitionOutOfRange(t *testing.T, e *env) {
	items, pending := e.itemRows(), e.pending()
	neg := int32(-1)
	err := e.write(&outbox.Message{Topic: "t", Value: []byte("v"), Partition: &neg})
	var me *outbox.MessageError
	require.ErrorAs(t, err, &me)
	require.Equal(t, "Partition", me.Field)
	e.requireRolledBack(items, pending)

	topic := e.cluster.Topic(t, 3)
	pub := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: e.cluster.Brokers(), Logger: testLogger(t)})

	// The publisher's own answer.
	p99 := int32(99)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	acked, err := pub.Publish(ctx, []relay.Message{{MessageID: "m1", Topic: topic, Value: []byte("v"), Partition: &p99}})
	require.Error(t, err)
	require.Zero(t, acked)
	require.True(t, relay.IsPermanent(err), "out-of-range partition is permanent: %v", err)
	var pe *publisher.Error
	require.ErrorAs(t, err, &pe)
	require.Equal(t, 0, pe.Index)

	// Through the relay: the pinned message and a keyed one in the same
	// bucket (partition 99 and the key share bucket 99 mod 8 = 3).
	bad := &outbox.Message{Topic: topic, Value: []byte("pinned"), Partition: &p99}
	var key string
	for i := 0; ; i++ {
		key = fmt.Sprintf("k%d", i)
		if outbox.Bucket([]byte(key), nil, "", e.cfg.BucketCount) == outbox.Bucket(nil, &p99, "", e.cfg.BucketCount) {
			break
		}
	}
	good := msg(topic, key, "after")
	require.NoError(t, e.write(bad, good))
	e.startRelay(e.store(nil, 0), pub, e.relayConfig("r"))
	e.waitPending(0, 30*time.Second)
	require.Equal(t, int64(1), e.dead(), "the out-of-range message is dead-lettered")
	var lastErr string
	require.NoError(t, e.db.Raw("SELECT last_error FROM "+e.db.Statement.Quote(e.cfg.Tables.DeadLettersTable())+" WHERE message_id = ?", bad.ID).Scan(&lastErr).Error)
	require.Contains(t, strings.ToLower(lastErr), "partition", "the dead letter says why")
	// The later message was in flight with the refused one and was
	// written; the batch counted as unacknowledged, so it is published
	// again after the dead-lettering: the documented partial-failure
	// duplicate (publisher/doc.go). Never lost, and nothing else.
	recs := e.cluster.ReadAll(t, topic, 1, 30*time.Second)
	n := e.cluster.RecordCount(t, topic)
	recs = e.cluster.ReadAll(t, topic, int(n), 30*time.Second)
	require.NotEmpty(t, recs)
	for _, rec := range recs {
		require.Equal(t, []byte("after"), rec.Value, "only the rest of the bucket reaches the topic")
	}
	t.Logf("the message after the refused one was written %d time(s)", len(recs))
}

// bucketMismatch: writers with 32 buckets, a relay with 8. The relay stops
// with a *relay.MisconfigurationError and deletes nothing; a relay with
// the writers' count delivers everything.
func bucketMismatch(t *testing.T, e *env) {
	var msgs []*outbox.Message
	high := 0
	for i := 0; i < 64 || high == 0; i++ {
		m := msg("t", fmt.Sprintf("key-%d", i), "v")
		if outbox.Bucket(m.Key, nil, "", 32) >= 8 {
			high++
		}
		msgs = append(msgs, m)
	}
	require.NoError(t, e.write(msgs...))
	total := int64(len(msgs))

	// Store and relay both at 8: rows in buckets 8..31 nobody can own.
	cfg := e.relayConfig("eight")
	cfg.BucketCount = 8
	_, err := e.startErr(e.store(nil, 8), &sink{}, cfg)
	var mis *relay.MisconfigurationError
	require.ErrorAs(t, err, &mis, "Start refuses rows outside the relay's buckets")
	require.True(t, relay.IsMisconfiguration(err))
	require.Equal(t, "BucketCount", mis.Setting)
	require.Equal(t, total, e.pending(), "nothing deleted by the misconfigured relay")

	// A relay configured with a count other than its store's is refused
	// by New, with a typed error naming both counts.
	cfg = e.relayConfig("mixed")
	cfg.BucketCount = 8
	_, err = relay.New(e.store(nil, 32), &sink{}, cfg)
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce, "relay 8 vs store 32: %v", err)
	require.Equal(t, "BucketCount", ce.Field)
	require.ErrorContains(t, err, "uses 8 buckets but the store's outbox is configured with 32")
	require.Equal(t, total, e.pending())

	// The right count delivers all, nothing lost.
	good := &sink{}
	r3, err := relay.New(e.store(nil, 32), good, e.relayConfig("right"))
	require.NoError(t, err)
	n, err := r3.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(msgs), n)
	require.Zero(t, e.pending())
	got := good.ids()
	for _, m := range msgs {
		require.Equal(t, 1, got[m.ID], "message %s delivered once", m.ID)
	}
}

// relayBeforeMigrate: a relay on tables that do not exist stops with a
// *relay.MisconfigurationError that names the table and the fix.
func relayBeforeMigrate(t *testing.T, e *env) {
	_, err := e.startErr(e.store(nil, 0), &sink{}, e.relayConfig("early"))
	require.True(t, relay.IsMisconfiguration(err), "Start refuses missing tables: %v", err)
	text := err.Error()
	require.True(t, strings.Contains(text, e.cfg.Tables.Messages) || strings.Contains(text, e.cfg.Tables.Leases) ||
		strings.Contains(text, e.cfg.Tables.Relays) || strings.Contains(text, e.cfg.Tables.DeadLetters),
		"the error names a missing table: %s", text)
	require.True(t, strings.Contains(strings.ToLower(text), "migrat"), "the error says to migrate: %s", text)

	r2, err := relay.New(e.store(nil, 0), &sink{}, e.relayConfig("early-once"))
	require.NoError(t, err)
	_, err = r2.DrainOnce(context.Background())
	require.True(t, relay.IsMisconfiguration(err), "DrainOnce: %v", err)

	// Enqueue before the migration fails inside the transaction, which
	// rolls back.
	items := e.itemRows()
	require.Error(t, e.write(msg("t", "k", "v")))
	require.Equal(t, items, e.itemRows())
}

// outsideTransaction: Enqueue outside a transaction writes nothing and
// returns ErrNoTransaction, also with SkipDefaultTransaction.
func outsideTransaction(t *testing.T, e *env) {
	m := msg("t", "k", "v")
	require.ErrorIs(t, e.plugin.Enqueue(e.db, m), outbox.ErrNoTransaction)
	require.ErrorIs(t, outbox.Enqueue(e.db, m), outbox.ErrNoTransaction)
	require.ErrorIs(t, outbox.EnqueueJSON(e.db, "t", []byte("k"), map[string]int{"a": 1}), outbox.ErrNoTransaction)
	skip := e.db.Session(&gorm.Session{SkipDefaultTransaction: true})
	require.ErrorIs(t, e.plugin.Enqueue(skip, m), outbox.ErrNoTransaction)
	require.ErrorIs(t, e.plugin.Enqueue(e.db.WithContext(context.Background()), m), outbox.ErrNoTransaction)
	require.ErrorIs(t, e.plugin.Enqueue(nil, m), outbox.ErrNoTransaction)
	require.Zero(t, e.pending())

	// A committed transaction is over: its handle is not a transaction
	// any more.
	var done *gorm.DB
	require.NoError(t, e.db.Transaction(func(tx *gorm.DB) error { done = tx; return nil }))
	require.Error(t, e.plugin.Enqueue(done, msg("t", "k", "late")))
	require.Zero(t, e.pending())
}

// overMaxAllowedPacket: with the outbox's own size check disabled, a value
// larger than MariaDB's max_allowed_packet is refused with a typed error
// naming the packet limit, and the transaction rolls back.
func overMaxAllowedPacket(t *testing.T, e *env) {
	var maxPacket int64
	require.NoError(t, e.db.Raw("SELECT @@max_allowed_packet").Scan(&maxPacket).Error)
	if maxPacket > 256<<20 {
		t.Skipf("max_allowed_packet is %d bytes: too large to exceed in a test", maxPacket)
	}
	t.Logf("max_allowed_packet = %d", maxPacket)
	items, pending := e.itemRows(), e.pending()
	err := e.write(msg("t", "k", "small"), &outbox.Message{Topic: "t", Key: []byte("k"), Value: bytes.Repeat([]byte("x"), int(maxPacket)+1)})
	t.Logf("error: %v", err)
	// The plugin reads the server's max_allowed_packet once and refuses a
	// message that cannot fit with a typed error, before the server would
	// drop the connection mid-statement (which the driver reports as the
	// misleading "commands out of sync").
	var tl *outbox.TooLargeError
	require.ErrorAs(t, err, &tl)
	require.Equal(t, "max_allowed_packet", tl.Setting)
	require.Less(t, tl.Limit, int(maxPacket))
	require.ErrorIs(t, err, outbox.ErrInvalidMessage)
	e.requireRolledBack(items, pending)

	// The next write works.
	require.NoError(t, e.write(msg("t", "k", "after")))
	require.Equal(t, pending+1, e.pending())
}

// databaseClosedMidBatch: the relay's database goes away while a batch is
// being published (its *sql.DB is closed; the publisher acknowledges the
// batch). The delete fails, every row stays, and a new relay on a new
// connection delivers them all: duplicates of the acknowledged batch, no
// loss.
func databaseClosedMidBatch(t *testing.T, e *env) {
	var msgs []*outbox.Message
	for i := range 30 {
		msgs = append(msgs, msg("t", fmt.Sprintf("k%d", i%5), fmt.Sprint(i)))
	}
	require.NoError(t, e.write(msgs...))

	relayDB := e.open(nil)
	relaySQL, err := relayDB.DB()
	require.NoError(t, err)
	first := make(chan struct{})
	dying := &sink{hook: func(_ context.Context, call int, msgs []relay.Message) (int, error) {
		if call == 1 {
			require.NoError(t, relaySQL.Close())
			close(first)
		}
		return len(msgs), nil
	}}
	cfg := e.relayConfig("dying")
	r := e.startRelay(e.store(relayDB, 0), dying, cfg)
	select {
	case <-first:
	case <-time.After(30 * time.Second):
		t.Fatal("no publish")
	}
	// Stop lets the batch in flight finish (its delete fails on the
	// closed database) and returns once the relay can delete nothing more.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = r.Stop(ctx)
	require.Equal(t, int64(len(msgs)), e.pending(), "nothing deleted once the database is gone")

	// A new relay (after the dead one's leases expire) delivers every row.
	fresh := &sink{}
	e.startRelay(e.store(e.open(nil), 0), fresh, e.relayConfig("fresh"))
	e.waitPending(0, 30*time.Second)
	got := fresh.ids()
	for _, m := range msgs {
		require.GreaterOrEqual(t, got[m.ID], 1, "message %s delivered", m.ID)
	}
	require.NotEmpty(t, dying.ids(), "the first batch was acknowledged before the database went away")
}

// backendKilledMidBatch: the server ends the relay's session while a
// batch is being published (PostgreSQL pg_terminate_backend, MariaDB KILL;
// on SQLite the file's connection is closed under the pool). The relay
// recovers on a new connection; nothing is lost.
func backendKilledMidBatch(t *testing.T, e *env) {
	var msgs []*outbox.Message
	for i := range 120 {
		msgs = append(msgs, msg("t", fmt.Sprintf("k%d", i%7), fmt.Sprint(i)))
	}
	require.NoError(t, e.write(msgs...))

	relayDB := e.open(nil)
	relaySQL, err := relayDB.DB()
	require.NoError(t, err)
	relaySQL.SetMaxOpenConns(1) // one session, whose id we know
	var session int64
	switch e.dialect {
	case dbtest.Postgres:
		require.NoError(t, relayDB.Raw("SELECT pg_backend_pid()").Scan(&session).Error)
	case dbtest.MySQL:
		require.NoError(t, relayDB.Raw("SELECT CONNECTION_ID()").Scan(&session).Error)
	}
	// kill runs on a relay's drainer (in the publisher), one call at a
	// time: it records errors for the test goroutine instead of failing
	// there.
	killed := 0
	var killErrs []error
	kill := func() {
		switch e.dialect {
		case dbtest.Postgres:
			// The relay's lease renewals share its one-connection pool and
			// may have replaced the session since it was looked up: end
			// whichever session the pool holds now, until one is ended.
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
				var ok bool
				if err := e.db.Raw("SELECT pg_terminate_backend(?)", session).Scan(&ok).Error; err != nil {
					killErrs = append(killErrs, err)
				}
				if ok {
					killed++
					break
				}
				session = nextSession(t, relayDB, "SELECT pg_backend_pid()", session)
			}
			session = nextSession(t, relayDB, "SELECT pg_backend_pid()", session)
		case dbtest.MySQL:
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
				if e.db.Exec(fmt.Sprintf("KILL %d", session)).Error == nil {
					killed++
					break
				}
				session = nextSession(t, relayDB, "SELECT CONNECTION_ID()", session)
			}
			session = nextSession(t, relayDB, "SELECT CONNECTION_ID()", session)
		case dbtest.SQLite:
			// No server to end the session: drop the pool's idle
			// connection instead, so the next statement reconnects.
			relaySQL.SetMaxIdleConns(0)
			relaySQL.SetMaxIdleConns(2)
			killed++
		}
	}
	var killMu sync.Mutex // the relay's drainers publish concurrently
	s := &sink{hook: func(_ context.Context, call int, msgs []relay.Message) (int, error) {
		if call <= 3 {
			killMu.Lock()
			kill()
			killMu.Unlock()
		}
		return len(msgs), nil
	}}
	cfg := e.relayConfig("victim")
	cfg.BatchSize = 20
	r := e.startRelay(e.store(relayDB, 0), s, cfg)
	e.waitPending(0, 60*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, r.Stop(ctx)) // no publisher call runs any more
	killMu.Lock()
	defer killMu.Unlock()
	require.Empty(t, killErrs, "terminating the relay's database session")
	require.Equal(t, 3, killed, "sessions ended mid-batch")
	got := s.ids()
	for _, m := range msgs {
		require.GreaterOrEqual(t, got[m.ID], 1, "message %s delivered", m.ID)
	}
}

// nextSession returns the id of the session the one-connection pool of db
// opens after session old was ended. The server ends a session
// asynchronously: until it has, the old session may still answer, and the
// first statement after it ended fails; poll until a new id answers.
func nextSession(t *testing.T, db *gorm.DB, query string, old int64) int64 {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var id int64
		if db.Raw(query).Scan(&id).Error == nil && id != old {
			return id
		}
		if time.Now().After(deadline) {
			t.Errorf("no new session replaced session %d within 30 s", old)
			return old
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cancelledMidPublish: cancelling the relay while a publish is in flight
// (Stop's deadline, the Start context, DrainOnce's context) leaves every
// unacknowledged row in place.
func cancelledMidPublish(t *testing.T, e *env) {
	var msgs []*outbox.Message
	for i := range 40 {
		msgs = append(msgs, msg("t", fmt.Sprintf("k%d", i%4), fmt.Sprint(i)))
	}
	require.NoError(t, e.write(msgs...))
	total := int64(len(msgs))

	// Each relay gets a sink of its own: a relay's drainers publish
	// several buckets at once, and a signal left over from one relay's
	// publishes must not cancel the next relay before it publishes.
	blockingSink := func() (*sink, <-chan struct{}) {
		started := make(chan struct{}, 100)
		return &sink{hook: func(ctx context.Context, _ int, _ []relay.Message) (int, error) {
			started <- struct{}{}
			<-ctx.Done()
			return 0, ctx.Err()
		}}, started
	}

	// Stop whose deadline ends during the publish.
	blocking, started := blockingSink()
	r, err := relay.New(e.store(nil, 0), blocking, e.relayConfig("stop"))
	require.NoError(t, err)
	require.NoError(t, r.Start(context.Background()))
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	err = r.Stop(ctx)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded, "Stop reports the abandoned batch")
	require.Equal(t, total, e.pending(), "no row deleted")
	require.NoError(t, r.Err())

	// The Start context cancelled during the publish.
	startCtx, cancelStart := context.WithCancel(context.Background())
	blocking, started = blockingSink()
	r2, err := relay.New(e.store(nil, 0), blocking, e.relayConfig("ctx"))
	require.NoError(t, err)
	require.NoError(t, r2.Start(startCtx))
	<-started
	cancelStart()
	select {
	case <-r2.Stopped():
	case <-time.After(10 * time.Second):
		t.Fatal("the relay did not stop on its context")
	}
	require.Equal(t, total, e.pending())

	// DrainOnce's context cancelled during the publish.
	blocking, started = blockingSink()
	r3, err := relay.New(e.store(nil, 0), blocking, e.relayConfig("once"))
	require.NoError(t, err)
	drainCtx, cancelDrain := context.WithCancel(context.Background())
	go func() { <-started; cancelDrain() }()
	n, err := r3.DrainOnce(drainCtx)
	cancelDrain()
	require.Zero(t, n)
	require.Error(t, err)
	require.Equal(t, total, e.pending())

	// Everything is still deliverable, by a new relay at once: the three
	// relays released their leases when they stopped, also a lease one of
	// them stopped trusting during its cancelled publish (a busy machine's
	// slow renewal).
	ok := &sink{}
	r4, err := relay.New(e.store(nil, 0), ok, e.relayConfig("after"))
	require.NoError(t, err)
	n, err = r4.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, len(msgs), n)
	require.Zero(t, e.pending())
}
