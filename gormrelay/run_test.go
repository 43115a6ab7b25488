package gormrelay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// wiredPlugin is a plugin with the given bucket count and tables, used by
// db and migrated.
func wiredPlugin(t *testing.T, db *gorm.DB, cfg outbox.Config) *outbox.Plugin {
	t.Helper()
	p, err := outbox.NewPlugin(cfg)
	require.NoError(t, err)
	require.NoError(t, db.Use(p))
	require.NoError(t, p.AutoMigrate(t.Context(), db))
	return p
}

// enqueue commits n keyed messages to topic through db's plugin.
func enqueue(t *testing.T, db *gorm.DB, topic string, n int) {
	t.Helper()
	require.NoError(t, db.Transaction(func(tx *gorm.DB) error {
		for i := range n {
			if err := outbox.Enqueue(tx, &outbox.Message{Topic: topic, Key: fmt.Appendf(nil, "k-%d", i), Value: []byte("v")}); err != nil {
				return err
			}
		}
		return nil
	}))
}

// runAsync runs r.Run(ctx) on a goroutine and returns its result channel.
func runAsync(ctx context.Context, r *relay.Relay) <-chan error {
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	return done
}

// NewKafka owns its publisher: Run starts it (the messages reach Kafka),
// and once Run returned nil at the end of its context the publisher is
// stopped (Stopped closed, CheckReady reports it closed).
func TestNewKafkaRunOwnsThePublisher(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		c := kafkatest.Start(t)
		topic := c.Topic(t, 4)
		p := wiredPlugin(t, db.DB, outbox.Config{})
		cfg := fastConfig(t, "owned")
		r, err := gormrelay.NewKafka(db.DB, p, publisher.KafkaConfig{Brokers: c.Brokers(), Logger: dbtest.Logger(t)},
			gormrelay.WithRelayConfig(cfg))
		require.NoError(t, err)
		k, ok := r.Publisher().(*publisher.Kafka)
		require.True(t, ok, "%T", r.Publisher())
		require.ErrorIs(t, k.CheckReady(t.Context()), publisher.ErrNotStarted, "NewKafka starts nothing")

		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		done := runAsync(ctx, r)
		enqueue(t, db.DB, topic, 10)
		require.Len(t, c.ReadAll(t, topic, 10, deliverWithin), 10)
		require.NoError(t, k.CheckReady(t.Context()), "started by Run")
		select {
		case err := <-done:
			t.Fatalf("Run returned while ctx lives: %v", err)
		default:
		}

		cancel()
		require.NoError(t, <-done, "a clean stop")
		select {
		case <-k.Stopped():
		default:
			t.Fatal("the publisher still runs after Run returned")
		}
		err = k.CheckReady(t.Context())
		require.ErrorIs(t, err, publisher.ErrClosed)
		require.True(t, relay.IsMisconfiguration(err))
		require.NoError(t, r.Err())
	})
}

// NewKafkaTransactional owns the strict-mode publisher the same way.
func TestNewKafkaTransactionalRun(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	c := kafkatest.Start(t)
	topic := c.Topic(t, 2)
	p := wiredPlugin(t, db.DB, outbox.Config{})
	r, err := gormrelay.NewKafkaTransactional(db.DB, p, publisher.TransactionalConfig{
		Brokers: c.Brokers(), TransactionalIDPrefix: strictPrefix(t), Configure: strictSaramaConfig, Logger: dbtest.Logger(t),
	}, gormrelay.WithRelayConfig(fastConfig(t, "owned-tx")))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := runAsync(ctx, r)
	enqueue(t, db.DB, topic, 6)
	require.Len(t, c.ReadAll(t, topic, 6, deliverWithin, kafkatest.ReadCommitted()), 6)
	cancel()
	require.NoError(t, <-done)
	tx := r.Publisher().(*publisher.Transactional)
	require.ErrorIs(t, tx.CheckReady(t.Context()), publisher.ErrClosed, "stopped after the relay")
}

// With no broker answering, Run fails at once with the publisher's
// error, before the relay takes a lease.
func TestNewKafkaRunWithoutBroker(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	p := wiredPlugin(t, db.DB, outbox.Config{BucketCount: 4})
	nobody := kafkatest.RefusingAddr(t)
	r, err := gormrelay.NewKafka(db.DB, p, publisher.KafkaConfig{
		Brokers:   []string{nobody},
		Configure: func(c *sarama.Config) error { c.Metadata.Retry.Max = 1; return nil },
		Logger:    dbtest.Logger(t),
	}, gormrelay.WithRelayConfig(fastConfig(t, "nobroker")))
	require.NoError(t, err)
	err = r.Run(t.Context())
	require.ErrorIs(t, err, sarama.ErrOutOfBrokers)
	require.ErrorContains(t, err, "relay: start the publisher")
	require.NoError(t, t.Context().Err())
	var owners int64
	require.NoError(t, db.DB.Table(outbox.Config{}.WithDefaults().Tables.LeasesTable()).Where("owner IS NOT NULL").Count(&owners).Error)
	require.Zero(t, owners, "no lease taken")

	_, err = gormrelay.NewKafka(db.DB, p, publisher.KafkaConfig{})
	var ce *relay.ConfigError
	require.ErrorAs(t, err, &ce, "no brokers")
}

// A writer with BucketCount 64 next to a relay with 8: the writer's rows
// in buckets 8..63 make Start and Run fail at once with a typed error
// naming the highest bucket and both counts; nothing is published or
// deleted.
func TestRunRefusesAWritersLargerBucketCount(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		writerDB := openWriter(t, db)
		wide := wiredPlugin(t, writerDB, outbox.Config{BucketCount: 64})
		enqueue(t, writerDB, "orders", 200)
		var maxBucket int
		require.NoError(t, writerDB.Table(wide.Config().Tables.MessagesTable()).Select("MAX(bucket)").Scan(&maxBucket).Error)
		require.GreaterOrEqual(t, maxBucket, 8, "200 keys reach beyond bucket 7")

		narrow := wiredPlugin(t, db.DB, outbox.Config{BucketCount: 8})
		published := 0
		pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
			published += len(msgs)
			return len(msgs), nil
		})
		r, err := gormrelay.New(db.DB, narrow, pub, gormrelay.WithRelayConfig(fastConfig(t, "narrow")))
		require.NoError(t, err)
		for name, err := range map[string]error{"Start": r.Start(t.Context()), "Run": r.Run(t.Context())} {
			var me *relay.MisconfigurationError
			require.ErrorAs(t, err, &me, name)
			require.Equal(t, "BucketCount", me.Setting, name)
			require.ErrorContains(t, err, fmt.Sprintf("holds messages in bucket %d, outside 0..7", maxBucket), name)
			require.ErrorContains(t, err, fmt.Sprintf("a writer uses a BucketCount of at least %d and this relay 8", maxBucket+1), name)
		}
		require.Zero(t, published)
		var n int64
		require.NoError(t, db.DB.Table(narrow.Config().Tables.MessagesTable()).Count(&n).Error)
		require.EqualValues(t, 200, n, "nothing deleted")
	})
}

// openWriter opens a second connection to db's database, as another
// service writing to the same outbox would; it is closed with t.
func openWriter(t *testing.T, db *dbtest.DB) *gorm.DB {
	t.Helper()
	writerDB, err := dbtest.OpenGorm(db.Dialect, db.DSN, &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlW, err := writerDB.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlW.Close() })
	return writerDB
}

func probe(t *testing.T, h http.Handler, path string) (int, map[string]any) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequestWithContext(t.Context(), http.MethodGet, path, nil))
	var body map[string]any
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body), rec.Body.String())
	return rec.Code, body
}

// A relay that stops on an error (a writer with a larger BucketCount
// started after it) fails the liveness and readiness probes at once with
// its error, although the backlog is far younger than MaxAge; until then
// both pass. A database outage fails readiness only.
func TestHealthReportsTheRelaysEnd(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		p := wiredPlugin(t, db.DB, outbox.Config{BucketCount: 8})
		rec := newRecorder()
		r, err := gormrelay.New(db.DB, p, rec.publisher("health", nil), gormrelay.WithRelayConfig(fastConfig(t, "health")))
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		done := runAsync(ctx, r)
		h := gormrelay.Health{Admin: gormrelay.PluginAdmin(db.DB, p), Relay: r, MaxAge: time.Hour}.Handler()
		for _, path := range []string{"/livez", "/readyz", "/healthz"} {
			code, body := probe(t, h, path)
			require.Equal(t, http.StatusOK, code, path)
			require.Equal(t, "ok", body["status"], path)
		}

		writerDB := openWriter(t, db)
		wiredPlugin(t, writerDB, outbox.Config{BucketCount: 64})
		enqueue(t, writerDB, "orders", 200)

		var runErr error
		select {
		case runErr = <-done:
		case <-time.After(deliverWithin):
			t.Fatal("the relay did not stop on the misconfiguration")
		}
		require.True(t, relay.IsMisconfiguration(runErr), "%v", runErr)
		for _, path := range []string{"/livez", "/readyz", "/healthz"} {
			code, body := probe(t, h, path)
			require.Equal(t, http.StatusServiceUnavailable, code, path)
			require.Equal(t, "failed", body["status"], path)
			require.Equal(t, runErr.Error(), body["error"], path)
		}
		other := httptest.NewRecorder()
		h.ServeHTTP(other, httptest.NewRequestWithContext(t.Context(), http.MethodGet, "/other", nil))
		require.Equal(t, http.StatusNotFound, other.Code)

		// Readiness alone reads the database.
		sqlDB, err := db.DB.DB()
		require.NoError(t, err)
		require.NoError(t, sqlDB.Close())
		live := gormrelay.Health{Admin: gormrelay.PluginAdmin(db.DB, p), MaxAge: time.Hour}
		code, _ := probe(t, live.Liveness(), "/livez")
		require.Equal(t, http.StatusOK, code)
		code, body := probe(t, live.Readiness(), "/readyz")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, "error", body["status"])
	})
}

// unmigratedRelay returns an 8-bucket plugin on db whose tables were
// never created, and a relay id on it.
func unmigratedRelay(t *testing.T, db *dbtest.DB, id string) (*outbox.Plugin, *relay.Relay) {
	t.Helper()
	p, err := outbox.NewPlugin(outbox.Config{BucketCount: 8})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	r, err := gormrelay.New(db.DB, p, newRecorder().publisher(id, nil), gormrelay.WithRelayConfig(fastConfig(t, id)))
	require.NoError(t, err)
	return p, r
}

// A relay whose Run fails at start (its tables are missing, or a writer
// uses a larger BucketCount) never runs, so Stopped is not closed; the
// liveness and readiness probes, served over HTTP, still fail at once with
// the error Run returned. Once the tables exist a second Run starts, and
// the probes pass again.
func TestHealthReportsAFailedStart(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		p, r := unmigratedRelay(t, db, "start")
		srv := httptest.NewServer(opshttp.Health{Operator: gormrelay.PluginAdmin(db.DB, p), Relay: r, MaxAge: time.Hour, Logger: dbtest.Logger(t)}.Handler())
		defer srv.Close()

		runErr := r.Run(t.Context())
		require.ErrorIs(t, runErr, outbox.ErrSchemaOutdated)
		select {
		case <-r.Stopped():
			t.Fatal("a relay that never ran reports Stopped")
		default:
		}
		require.Equal(t, runErr, r.Err())
		code, body := opstest.GetJSON(t, srv, "/livez")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, "failed", body["status"])
		require.Equal(t, runErr.Error(), body["error"])
		code, body = opstest.GetJSON(t, srv, "/readyz")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, "failed", body["status"])

		// The tables made, the relay starts and the probes pass.
		require.NoError(t, p.AutoMigrate(t.Context(), db.DB))
		ctx, cancel := context.WithCancel(t.Context())
		done := runAsync(ctx, r)
		require.Eventually(t, func() bool { return r.Err() == nil }, deliverWithin, 10*time.Millisecond)
		for _, path := range []string{"/livez", "/readyz"} {
			code, body := opstest.GetJSON(t, srv, path)
			require.Equal(t, http.StatusOK, code, path)
			require.Equal(t, "ok", body["status"], path)
		}
		cancel()
		require.NoError(t, <-done)

		// A writer with a larger BucketCount: a fresh relay's Run fails at
		// start on the misconfiguration, and so does liveness.
		writerDB := openWriter(t, db)
		wiredPlugin(t, writerDB, outbox.Config{BucketCount: 64})
		enqueue(t, writerDB, "orders", 200)
		r2, err := gormrelay.New(db.DB, p, newRecorder().publisher("start2", nil), gormrelay.WithRelayConfig(fastConfig(t, "start2")))
		require.NoError(t, err)
		runErr = r2.Run(t.Context())
		require.True(t, relay.IsMisconfiguration(runErr), "%v", runErr)
		live := httptest.NewServer(opshttp.Health{Relay: r2}.Liveness())
		defer live.Close()
		code, body = opstest.GetJSON(t, live, "/livez")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, runErr.Error(), body["error"])
	})
}

// A relay whose Run failed at start (its tables missing) reports that
// error through Err and liveness until it runs: a DrainOnce that drains
// the outbox once the tables exist clears it, and one that meets a
// misconfiguration (a writer with a larger BucketCount) reports it in
// turn.
func TestDrainOnceClearsAFailedStart(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		p, r := unmigratedRelay(t, db, "drain")
		srv := httptest.NewServer(opshttp.Health{Relay: r}.Liveness())
		defer srv.Close()

		runErr := r.Run(t.Context())
		require.ErrorIs(t, runErr, outbox.ErrSchemaOutdated)
		require.Equal(t, runErr, r.Err())
		code, _ := opstest.GetJSON(t, srv, "/livez")
		require.Equal(t, http.StatusServiceUnavailable, code)

		require.NoError(t, p.AutoMigrate(t.Context(), db.DB))
		enqueue(t, db.DB, "orders", 10)
		n, err := r.DrainOnce(t.Context())
		require.NoError(t, err)
		require.Equal(t, 10, n)
		require.NoError(t, r.Err(), "the relay ran: the failed start is over")
		code, body := opstest.GetJSON(t, srv, "/livez")
		require.Equal(t, http.StatusOK, code)
		require.Equal(t, "ok", body["status"])

		writerDB := openWriter(t, db)
		wiredPlugin(t, writerDB, outbox.Config{BucketCount: 64})
		enqueue(t, writerDB, "orders", 200)
		_, err = r.DrainOnce(t.Context())
		require.True(t, relay.IsMisconfiguration(err), "%v", err)
		require.Equal(t, err, r.Err())
		code, body = opstest.GetJSON(t, srv, "/livez")
		require.Equal(t, http.StatusServiceUnavailable, code)
		require.Equal(t, err.Error(), body["error"])
	})
}
