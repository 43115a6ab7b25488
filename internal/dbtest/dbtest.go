// Package dbtest opens isolated databases for tests: a fresh PostgreSQL
// schema, a fresh MariaDB/MySQL database or a fresh SQLite file per call,
// dropped when the test ends, so tests run in parallel without sharing
// tables.
//
// Servers come from OUTBOX_TEST_POSTGRES_DSN and OUTBOX_TEST_MYSQL_DSN,
// with local defaults. When a server cannot be reached the test is skipped,
// except under CI=true, where it fails: CI never passes by skipping.
package dbtest

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	gometrics "github.com/rcrowley/go-metrics"
	"go.uber.org/goleak"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/dbopen"
)

// Dialect names.
const (
	Postgres = dbopen.Postgres
	MySQL    = dbopen.MySQL
	SQLite   = dbopen.SQLite
)

// Dialects lists every dialect the tests run on.
var Dialects = []string{Postgres, MySQL, SQLite}

// PostgresDSN returns the DSN of the PostgreSQL server used by tests.
func PostgresDSN() string {
	if v := os.Getenv("OUTBOX_TEST_POSTGRES_DSN"); v != "" {
		return v
	}
	return "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"
}

// MySQLDSN returns the DSN of the MariaDB/MySQL server used by tests,
// without a database name after the slash being required.
func MySQLDSN() string {
	if v := os.Getenv("OUTBOX_TEST_MYSQL_DSN"); v != "" {
		return v
	}
	return "root:@tcp(127.0.0.1:3306)/test?parseTime=true&multiStatements=false"
}

// InCI reports whether the tests run in CI, where missing servers fail.
func InCI() bool { return os.Getenv("CI") == "true" || os.Getenv("CI") == "1" }

var (
	reachMu sync.Mutex
	reach   = map[string]error{}
)

func reachable(dialect string) error {
	reachMu.Lock()
	defer reachMu.Unlock()
	if err, ok := reach[dialect]; ok {
		return err
	}
	var err error
	switch dialect {
	case Postgres:
		err = ping("pgx", PostgresDSN())
	case MySQL:
		err = ping("mysql", MySQLDSN())
	}
	reach[dialect] = err
	return err
}

func ping(driver, dsn string) error {
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetConnMaxLifetime(time.Second)
	done := make(chan error, 1)
	go func() { done <- db.Ping() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		return fmt.Errorf("ping %s: timed out", driver)
	}
}

// Require skips the test (fails it in CI) when dialect's server is down.
func Require(t testing.TB, dialect string) {
	t.Helper()
	if err := reachable(dialect); err != nil {
		if InCI() {
			t.Fatalf("%s server required in CI but unreachable: %v", dialect, err)
		}
		t.Skipf("%s server unreachable: %v", dialect, err)
	}
}

// Name returns a fresh lowercase identifier with the given prefix.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// DB is an isolated database for one test.
type DB struct {
	*gorm.DB
	Dialect string
	// DSN opens another connection to the same isolated database, as a
	// separate process would.
	DSN string
	// Namespace is the schema (PostgreSQL), database (MySQL) or file
	// (SQLite) created for the test.
	Namespace string
}

// Options tune Open.
type Options struct {
	// Config is the GORM config. Default: logger silenced.
	Config *gorm.Config
}

// Open creates an isolated database of the dialect and returns a GORM
// connection to it, closed and dropped at the end of the test.
func Open(t testing.TB, dialect string, opts ...Options) *DB {
	t.Helper()
	Require(t, dialect)
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	d := &DB{Dialect: dialect, Namespace: Name("t_")}
	switch dialect {
	case Postgres:
		d.postgresSchema(t, PostgresDSN())
	case MySQL:
		admin := mustOpen(t, "mysql", MySQLDSN())
		exec(t, admin, "CREATE DATABASE "+d.Namespace)
		t.Cleanup(func() {
			_, _ = admin.Exec("DROP DATABASE " + d.Namespace)
			admin.Close()
		})
		d.DSN = dbopen.WithMySQLDatabase(MySQLDSN(), d.Namespace)
	case SQLite:
		d.DSN = "file:" + filepath.Join(t.TempDir(), d.Namespace+".db") + "?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate"
	default:
		t.Fatalf("dbtest: unknown dialect %q", dialect)
	}
	d.connect(t, o.Config)
	return d
}

// connect opens d.DB on d.DSN with cfg (default: logger silenced), closed
// at the end of the test.
func (d *DB) connect(t testing.TB, cfg *gorm.Config) {
	t.Helper()
	if cfg == nil {
		cfg = &gorm.Config{Logger: logger.Discard}
	}
	db, err := OpenGorm(d.Dialect, d.DSN, cfg)
	if err != nil {
		t.Fatalf("dbtest: open %s: %v", d.Dialect, err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		t.Fatalf("dbtest: %v", err)
	}
	t.Cleanup(func() { sqlDB.Close() })
	d.DB = db
}

// OpenGorm opens a GORM connection for the dialect and DSN (one
// connection for SQLite).
func OpenGorm(dialect, dsn string, cfg *gorm.Config) (*gorm.DB, error) {
	return dbopen.Open(dialect, dsn, cfg)
}

// postgresSchema creates d.Namespace on the server of dsn, dropped at the
// end of the test, and points d.DSN at it.
func (d *DB) postgresSchema(t testing.TB, dsn string) {
	t.Helper()
	admin := mustOpen(t, "pgx", dsn)
	exec(t, admin, "CREATE SCHEMA "+d.Namespace)
	t.Cleanup(func() {
		_, _ = admin.Exec("DROP SCHEMA " + d.Namespace + " CASCADE")
		admin.Close()
	})
	d.DSN = dsn + " search_path=" + d.Namespace
}

func mustOpen(t testing.TB, driver, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatalf("dbtest: open %s: %v", driver, err)
	}
	return db
}

func exec(t testing.TB, db *sql.DB, q string) {
	t.Helper()
	if _, err := db.Exec(q); err != nil {
		t.Fatalf("dbtest: %s: %v", q, err)
	}
}

// ForEach runs fn as a parallel subtest on every dialect.
func ForEach(t *testing.T, fn func(t *testing.T, db *DB)) {
	t.Helper()
	for _, dialect := range Dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			fn(t, Open(t, dialect))
		})
	}
}

// Logger is the logger for the services a test starts: it keeps the last
// loggerLines lines at Info and above and prints them in the test's log if
// the test fails; with OUTBOX_TEST_LOG set it writes everything, Debug
// included, to stderr tagged with the test's name.
func Logger(t testing.TB) *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") == "" {
		// Keep the last lines at Info and above, and print them if the
		// test fails: what the relay said is often the cause.
		r := &ringWriter{max: loggerLines}
		t.Cleanup(func() {
			if t.Failed() {
				if lines := r.lines(); len(lines) > 0 {
					t.Logf("the last %d log line(s) at Info and above:\n%s", len(lines), strings.Join(lines, ""))
				}
			}
		})
		return slog.New(slog.NewTextHandler(r, &slog.HandlerOptions{Level: slog.LevelInfo}))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
}

// loggerLines is how many log lines Logger keeps for a failed test.
const loggerLines = 200

// ringWriter keeps the last max lines written to it (slog's handlers write
// one line per call).
type ringWriter struct {
	mu   sync.Mutex
	max  int
	buf  []string
	next int
}

func (r *ringWriter) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	line := string(p)
	if len(r.buf) < r.max {
		r.buf = append(r.buf, line)
	} else {
		r.buf[r.next] = line
		r.next = (r.next + 1) % r.max
	}
	return len(p), nil
}

// lines returns the kept lines, oldest first.
func (r *ringWriter) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append(append([]string(nil), r.buf[r.next:]...), r.buf[:r.next]...)
}

// VerifyTestMain runs the tests of a package that opens databases and
// Kafka clients, then fails the binary on leaked goroutines, except the
// ones no caller can stop:
//   - database/sql keeps one opener goroutine per pool until Close; the
//     pools are closed in t.Cleanup, but the check runs after them;
//   - GORM's prepared-statement cache (PrepareStmt) starts an expiry
//     goroutine that has no way to be stopped.
//
// sarama's go-metrics meters start one process-wide goroutine that is
// never stopped either; the outbox reads no sarama metric, so they are
// switched off before any test runs.
func VerifyTestMain(m *testing.M) {
	gometrics.UseNilMetrics = true
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		goleak.IgnoreTopFunction("gorm.io/gorm/internal/lru.NewLRU[...].func1"),
		// An open circuit breaker of a sarama producer (a topic that does
		// not exist) sleeps out its 10s open period on a goroutine of its
		// own, even after the producer closed; it then ends.
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
	)
}
