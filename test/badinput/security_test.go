package badinput_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/publisher/publishertest"
	"github.com/gorm-outbox/outbox/relay"
)

// hostileNames are table and schema names that must never reach SQL.
var hostileNames = []string{
	"x; DROP TABLE users; --",
	`outbox"; DROP TABLE t; --`,
	"outbox`; DROP TABLE t; --",
	"outbox' OR '1'='1",
	"outbox]",
	"a b",
	"a-b",
	"public.outbox",
	"1abc",
	"a/*x*/b",
	"${table}",
	"tbl\x00",
	"tbl\n",
	"tä",
	"ｔａｂｌｅ",
	strings.Repeat("a", 64),
}

// TestHostileNamesRefusedBeforeSQL checks every entry point that takes
// table or schema names: a hostile name is refused with a *ConfigError
// and not one SQL statement reaches the database, on every dialect.
func TestHostileNamesRefusedBeforeSQL(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, base *dbtest.DB) {
		rec := &sqlRecorder{}
		db, err := dbtest.OpenGorm(base.Dialect, base.DSN, &gorm.Config{Logger: rec})
		require.NoError(t, err)
		sqlDB, err := db.DB()
		require.NoError(t, err)
		t.Cleanup(func() { sqlDB.Close() })
		ctx := context.Background()

		// The recorder sees statements: a legal configuration migrates.
		rec.reset()
		legal := outbox.Config{Tables: outbox.WithPrefix(dbtest.Name("legal") + "_")}.WithDefaults()
		require.NoError(t, legal.Tables.AutoMigrate(ctx, db))
		require.NotEmpty(t, rec.statements(), "the recorder sees SQL")

		for _, name := range hostileNames {
			for _, field := range []string{"Tables.Messages", "Tables.Leases", "Tables.Relays", "Tables.DeadLetters", "Tables.Schema"} {
				var tables outbox.Tables
				switch field {
				case "Tables.Messages":
					tables.Messages = name
				case "Tables.Leases":
					tables.Leases = name
				case "Tables.Relays":
					tables.Relays = name
				case "Tables.DeadLetters":
					tables.DeadLetters = name
				case "Tables.Schema":
					tables = outbox.Tables{Schema: name}
				}
				cfg := outbox.Config{Tables: tables}
				rec.reset()
				what := fmt.Sprintf("%s = %q", field, name)

				requireConfigError(t, field, outbox.ValidateIdentifier(field, name), "ValidateIdentifier %s", what)
				_, err := outbox.NewPlugin(cfg)
				requireConfigError(t, field, err, "NewPlugin %s", what)
				_, err = gormrelay.NewStore(db, cfg)
				requireConfigError(t, field, err, "NewStore %s", what)
				_, err = gormrelay.NewAdmin(db, cfg)
				requireConfigError(t, field, err, "NewAdmin %s", what)
				_, err = outbox.SchemaSQL(base.Dialect, tables)
				requireConfigError(t, field, err, "SchemaSQL %s", what)
				require.Empty(t, rec.statements(), "SQL ran for %s", what)
			}
		}

		// Tables.AutoMigrate is exported on its own and takes names
		// directly. Only on SQLite, whose database is a file of this
		// test: on the shared servers a name that is not refused would
		// run against them (a schema-qualified name escapes the test's
		// schema).
		if base.Dialect != dbtest.SQLite {
			return
		}
		var ran []string
		for _, name := range hostileNames {
			tables := outbox.Config{Tables: outbox.Tables{Messages: name}}.WithDefaults().Tables
			rec.reset()
			err := tables.AutoMigrate(ctx, db)
			var ce *outbox.ConfigError
			if !errors.As(err, &ce) || len(rec.statements()) > 0 {
				ran = append(ran, fmt.Sprintf("%q (%d statements, err %v)", name, len(rec.statements()), err))
			}
		}
		require.Empty(t, ran, "Tables.AutoMigrate ran SQL with unvalidated table names (model.go, Tables.AutoMigrate: no Validate)")
	})
}

// TestTablesAutoMigrateInjection shows what an unvalidated name does in
// Tables.AutoMigrate: GORM takes a table name with a space as a raw SQL
// expression, so a crafted name runs a statement of its own. SQLite's
// driver executes every statement of an Exec, so the victim table is
// dropped. NewPlugin, NewStore and NewAdmin validate; Tables.AutoMigrate,
// exported on its own, must too.
func TestTablesAutoMigrateInjection(t *testing.T) {
	t.Parallel()
	base := dbtest.Open(t, dbtest.SQLite)
	require.NoError(t, base.Exec("CREATE TABLE victims (id INTEGER)").Error)
	tables := outbox.Config{Tables: outbox.Tables{Messages: "t (id INTEGER); DROP TABLE victims; CREATE TABLE z"}}.WithDefaults().Tables
	err := tables.AutoMigrate(context.Background(), base.DB)
	var n int64
	require.NoError(t, base.Raw("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'victims'").Scan(&n).Error)
	require.Equal(t, int64(1), n, "a table name passed to Tables.AutoMigrate dropped another table (AutoMigrate error: %v)", err)
	requireConfigError(t, "Tables.Messages", err, "Tables.AutoMigrate with an injected name")
}

func requireConfigError(t *testing.T, field string, err error, format string, args ...any) {
	t.Helper()
	what := fmt.Sprintf(format, args...)
	var ce *outbox.ConfigError
	require.ErrorAs(t, err, &ce, "%s: want a *outbox.ConfigError", what)
	require.Equal(t, field, ce.Field, what)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig, what)
}

// TestSecretsNeverLogged runs relays whose publishes fail and whose
// database is unreachable, with every logger of the library (plugin,
// relay, publisher, failure policy, slog.Default) writing to one buffer at
// Debug level, and checks that no payload byte string, header value or DSN
// password appears in the logs or in the errors the relay returns.
//
// It is not parallel: it replaces slog.Default, which the store's default
// failure policy logs to, for its own duration only (parallel tests wait
// until it finished).
func TestSecretsNeverLogged(t *testing.T) {
	buf := &dbtest.LogBuffer{}
	log := slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	prev := slog.Default()
	slog.SetDefault(log)
	t.Cleanup(func() { slog.SetDefault(prev) })

	const (
		payload     = "PAYLOAD-SECRET-7f3a91"
		headerValue = "HEADER-SECRET-c0ffee"
		password    = "DSN-PASSWORD-SECRET-5e2b"
	)
	requireClean := func(t *testing.T, texts ...string) {
		t.Helper()
		all := buf.String() + strings.Join(texts, "\n")
		for _, secret := range []string{payload, headerValue, password} {
			require.NotContains(t, all, secret, "a secret reached the logs or an error")
		}
	}

	dbtest.ForEach(t, func(t *testing.T, base *dbtest.DB) {
		cluster := kafkatest.Start(t)
		fake := cluster.RequireFake(t) // kfake only: the broker refuses the topic on demand
		e := newEnv(t, base, cluster, outbox.Config{Logger: log}, true)

		// A sink that is down, then a broker that refuses the topic
		// (permanent: dead-lettered at once).
		topic := cluster.Topic(t, 1)
		var msgs []*outbox.Message
		for i := range 5 {
			msgs = append(msgs, &outbox.Message{Topic: topic, Key: []byte(fmt.Sprintf("key-%d", i)), Value: []byte(payload),
				Headers: []outbox.Header{{Key: "auth", Value: []byte(headerValue)}}})
		}
		require.NoError(t, e.write(msgs...))

		cfg := e.relayConfig("down")
		cfg.Logger = log
		down := relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
			return 0, errors.New("sink down")
		})
		r, err := relay.New(e.store(nil, 0), down, cfg)
		require.NoError(t, err)
		_, err = r.DrainOnce(context.Background())
		require.Error(t, err)
		requireClean(t, err.Error())

		fake.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topic, Err: kerr.TopicAuthorizationFailed, Count: -1})
		pub := publishertest.StartKafka(t, publisher.KafkaConfig{Brokers: cluster.Brokers(), Logger: log, Configure: func(c *sarama.Config) error {
			c.Producer.Retry.Backoff = 10 * time.Millisecond
			return nil
		}})
		cfg = e.relayConfig("refused")
		cfg.Logger = log
		e.startRelay(e.store(nil, 0), pub, cfg)
		e.waitPending(0, 30*time.Second)
		require.Equal(t, int64(len(msgs)), e.dead(), "refused messages are dead-lettered")
		require.Contains(t, buf.String(), "dead-lettered", "the dead-lettering was logged (the check looks at real log lines)")
		requireClean(t)

		// A database that cannot be reached, with a password in the DSN.
		var dsn string
		switch base.Dialect {
		case dbtest.Postgres:
			dsn = "host=127.0.0.1 port=1 user=postgres password=" + password + " dbname=test sslmode=disable connect_timeout=1"
		case dbtest.MySQL:
			// The real server, which refuses the password.
			dsn = "root:" + password + "@tcp(" + mysqlAddr() + ")/test?timeout=1s"
		case dbtest.SQLite:
			return // no password
		}
		var dialector gorm.Dialector = postgres.Open(dsn)
		if base.Dialect == dbtest.MySQL {
			dialector = mysql.New(mysql.Config{DSN: dsn, SkipInitializeWithVersion: true})
		}
		bad, err := gorm.Open(dialector, &gorm.Config{DisableAutomaticPing: true, Logger: gormSilent()})
		require.NoError(t, err)
		if sqlDB, err := bad.DB(); err == nil {
			t.Cleanup(func() { sqlDB.Close() })
		}
		store, err := gormrelay.NewStore(bad, outbox.Config{Logger: log})
		require.NoError(t, err)
		cfg = e.relayConfig("unreachable")
		cfg.Logger = log
		r3 := e.startRelay(store, &sink{}, cfg) // not a misconfiguration: Start retries in the background
		require.EventuallyWithT(t, func(c *assert.CollectT) { assert.Contains(c, buf.String(), "acquire leases failed") }, 20*time.Second, 20*time.Millisecond,
			"the relay logs its database errors")
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = r3.Stop(ctx)
		var errText string
		if err := r3.Err(); err != nil {
			errText = err.Error()
		}
		r4, err := relay.New(store, &sink{}, cfg)
		require.NoError(t, err)
		_, err = r4.DrainOnce(context.Background())
		require.Error(t, err)
		requireClean(t, errText, err.Error())
	})
}

// mysqlAddr is host:port of the MariaDB server of the tests.
func mysqlAddr() string {
	dsn := dbtest.MySQLDSN()
	if i := strings.Index(dsn, "tcp("); i >= 0 {
		if j := strings.IndexByte(dsn[i:], ')'); j >= 0 {
			return dsn[i+4 : i+j]
		}
	}
	return "127.0.0.1:3306"
}
