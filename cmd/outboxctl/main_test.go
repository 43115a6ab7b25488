package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	mysqldrv "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
	)
}

func TestSecretsRedacted(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ dsn, secret string }{
		{"host=db user=app password=s3cr3t dbname=x", "s3cr3t"},
		{"host=db user=app password='s3 cr\\'et' dbname=x", "s3 cr'et"},
		{"postgres://app:p%40ss@db:5432/x?sslmode=disable", "p@ss"},
		{"app:hunter2@tcp(db:3306)/x?parseTime=true", "hunter2"},
		{"mysql://app:hunter2@tcp(db:3306)/x", "hunter2"},
		{"file:x.db?_auth&_auth_user=a&_auth_pass=topsecret", "topsecret"},
	} {
		r := redactor(secrets(c.dsn))
		out := r.redact("error connecting with " + c.dsn + " and " + c.secret)
		require.NotContains(t, out, c.secret, c.dsn)
		require.Contains(t, out, "*****")
	}
	require.Empty(t, secrets("host=db user=app dbname=x"))
}

func TestResolveDriver(t *testing.T) {
	t.Parallel()
	for dsn, want := range map[string]string{
		"host=db user=app":           "postgres",
		"postgres://u@h/db":          "postgres",
		"u:p@tcp(h:3306)/db":         "mysql",
		"file:/tmp/x.db?_fk=1":       "sqlite",
		"/var/lib/outbox/outbox.db":  "sqlite",
		"postgresql://u:p@h:5432/db": "postgres",
	} {
		got, err := resolveDriver("", dsn)
		require.NoError(t, err, dsn)
		require.Equal(t, want, got, dsn)
	}
	_, err := resolveDriver("", "whatever")
	require.Error(t, err)
	got, err := resolveDriver("MariaDB", "whatever")
	require.NoError(t, err)
	require.Equal(t, "mysql", got)
	_, err = resolveDriver("oracle", "")
	require.Error(t, err)
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	env := func(string) string { return "" }
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"status", "--no-such-flag"},
		{"status"}, // no DSN
		{"requeue", "--dsn", "host=x"},
		{"requeue", "1", "--all", "--dsn", "host=x"},
		{"requeue", "--topic", "t", "--key", "k", "--dsn", "host=x"},
		{"purge", "--dsn", "host=x"},
		{"pause", "--dsn", "host=x"},
		{"pause", "x", "--dsn", "host=x"},
		{"dead-letters", "--dsn", "host=x"},
		{"dead-letters", "show", "--dsn", "host=x"},
		{"dead-letters", "show", "abc", "--dsn", "host=x"},
		{"status", "--dsn", "nonsense"},
	} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut, env)
		require.Equal(t, exitUsage, code, "%q: %s", args, errOut.String())
		require.Contains(t, errOut.String(), "outboxctl: ", "%q", args)
	}
	var out, errOut bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &out, &errOut, env))
	require.Contains(t, errOut.String(), "Usage:")
	require.Equal(t, exitOK, run(context.Background(), []string{"requeue", "--help"}, &out, &errOut, env))
}

func TestParseInterleaved(t *testing.T) {
	t.Parallel()
	g := &globals{}
	fs := newFlagSet(g)
	var all bool
	fs.BoolVar(&all, "all", false, "")
	pos, err := parse(fs, []string{"1", "--json", "2", "--all", "--prefix", "p_", "3", "--", "--4"})
	require.NoError(t, err)
	require.Equal(t, []string{"1", "2", "3", "--4"}, pos)
	require.True(t, g.json)
	require.True(t, all)
	require.Equal(t, "p_", g.prefix)
}

// cli is the built binary and the environment it runs with.
type cli struct {
	t   *testing.T
	bin string
	env []string
}

// run runs the binary and returns its exit code, stdout and stderr.
func (c cli) run(args ...string) (int, string, string) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin, args...)
	cmd.Env = append(os.Environ(), c.env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(c.t, err)
	}
	return code, out.String(), errOut.String()
}

// runJSON runs the binary with --json, requires exit 0 and decodes stdout.
func (c cli) runJSON(out any, args ...string) {
	c.t.Helper()
	code, stdout, stderr := c.run(append(args, "--json")...)
	require.Equal(c.t, exitOK, code, "%q: %s", args, stderr)
	require.NoError(c.t, json.Unmarshal([]byte(stdout), out), "%q: %s", args, stdout)
}

func buildCLI(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "outboxctl")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())
	return bin
}

// The CLI end to end against PostgreSQL: status, dead letters, requeue,
// purge, pause and resume, with exit codes and --json output, and the
// DSN's password never printed.
func TestCLIEndToEnd(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.Postgres)
	ctx := context.Background()
	cfg := outbox.Config{Tables: outbox.WithPrefix("ctl_"), BucketCount: 4}.WithDefaults()
	require.NoError(t, cfg.Tables.AutoMigrate(ctx, db.DB))
	bin := buildCLI(t)

	now := time.Now()
	dead := db.DB.Table(cfg.Tables.DeadLettersTable())
	require.NoError(t, dead.Create([]outbox.DeadLetterRow{
		{ID: 1, MessageID: "m1", Bucket: 1, Topic: "orders", Key: []byte("order-7"), Value: []byte(`{"id":7}`), CreatedAtMs: now.UnixMilli(),
			Attempts: 10, LastError: ptr("broker said no"), DeadAtMs: now.Add(-72 * time.Hour).UnixMilli(), State: "failed"},
		{ID: 2, MessageID: "m2", Bucket: 1, Topic: "orders", Key: []byte("order-7"), Value: []byte(`{"id":7,"v":2}`), CreatedAtMs: now.UnixMilli(),
			DeadAtMs: now.Add(-72 * time.Hour).UnixMilli(), State: "parked"},
		{ID: 3, MessageID: "m3", Bucket: 2, Topic: "payments", Value: []byte("x"), CreatedAtMs: now.UnixMilli(),
			DeadAtMs: now.Add(-time.Hour).UnixMilli(), State: "failed"},
	}).Error)
	require.NoError(t, db.DB.Table(cfg.Tables.MessagesTable()).Create([]outbox.MessageRow{
		{ID: 10, MessageID: "p1", Bucket: 1, Topic: "orders", Key: []byte("order-7"), Value: []byte("pending"), CreatedAtMs: now.Add(-time.Minute).UnixMilli()},
		// Bucket 3 is held back by message 11, whose publish failed twice;
		// 12 behind it failed once.
		{ID: 11, MessageID: "p2", Bucket: 3, Topic: "payments-x", Key: []byte("k3"), Value: []byte("v"), CreatedAtMs: now.UnixMilli(),
			Attempts: 2, LastError: ptr(`unknown topic "payments-x"`)},
		{ID: 12, MessageID: "p3", Bucket: 3, Topic: "payments-x", Key: []byte("k3"), Value: []byte("v"), CreatedAtMs: now.UnixMilli(),
			Attempts: 1, LastError: ptr("later")},
	}).Error)

	// The trust-authenticated server ignores the password: it is there to
	// check that it is never printed.
	const password = "pw-do-not-print-8c1f"
	dsn := db.DSN + " password=" + password
	c := cli{t: t, bin: bin, env: []string{"OUTBOX_DSN=" + dsn, "OUTBOX_PREFIX=ctl_", "OUTBOX_BUCKETS=4"}}

	var st gormrelay.Status
	c.runJSON(&st, "status")
	require.EqualValues(t, 3, st.Pending)
	require.Equal(t, gormrelay.DeadLetterCounts{Failed: 2, Parked: 1}, st.DeadLetters)
	require.Len(t, st.Buckets, 4)
	require.GreaterOrEqual(t, st.OldestAgeMs, int64(time.Minute/time.Millisecond))
	for _, b := range st.Buckets[:3] {
		require.Nil(t, b.Retrying, "bucket %d has no failed message", b.Bucket)
	}
	require.NotNil(t, st.Buckets[3].Retrying)
	require.Equal(t, ops.RetryingMessage{ID: 11, MessageID: "p2", Topic: "payments-x", Key: []byte("k3"),
		CreatedAt: time.UnixMilli(now.UnixMilli()).UTC(), Attempts: 2, LastError: `unknown topic "payments-x"`}, *st.Buckets[3].Retrying)

	code, out, errOut := c.run("status")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "BUCKET")
	require.Contains(t, out, "3 pending")
	require.Contains(t, out, `bucket 3 retries message 11 (topic payments-x, key k3, written `)
	require.Contains(t, out, `after 2 failed attempt(s); last error: unknown topic "payments-x"`)
	// The rest of the test counts bucket 1's rows only.
	require.NoError(t, db.DB.Table(cfg.Tables.MessagesTable()).Where("bucket = ?", 3).Delete(&outbox.MessageRow{}).Error)
	require.Contains(t, out, "no relay heartbeats")
	t.Logf("outboxctl status:\n%s", out)

	var page struct {
		Items []map[string]any `json:"items"`
		Next  string           `json:"next"`
	}
	c.runJSON(&page, "dead-letters", "list", "--topic", "orders")
	require.Len(t, page.Items, 2)
	require.Equal(t, "order-7", page.Items[0]["key"])
	c.runJSON(&page, "dead-letters", "list", "--limit", "1")
	require.Len(t, page.Items, 1)
	require.EqualValues(t, 3, page.Items[0]["id"])
	require.NotEmpty(t, page.Next)
	code, out, _ = c.run("dead-letters", "list", "--state", "parked")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "order-7")
	require.Contains(t, out, "parked")
	code, out, _ = c.run("dead-letters", "list")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "Whole error, key and value: outboxctl dead-letters show ID")
	require.NotContains(t, out, "DELIVERED maybe", "no row is maybe delivered: no footer explains it")
	t.Logf("outboxctl dead-letters list:\n%s", out)

	var one map[string]any
	c.runJSON(&one, "dead-letters", "show", "1")
	require.Equal(t, "broker said no", one["last_error"])
	code, out, _ = c.run("dead-letters", "show", "1")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, `{"id":7}`)
	t.Logf("outboxctl dead-letters show 1:\n%s", out)
	// A parked row names the failed dead letter of its key it waits
	// behind, and the command that requeues them together.
	code, out, _ = c.run("dead-letters", "show", "2")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "It waits behind the failed dead letter(s) of its key in bucket 1:\n  1 (message m1, topic orders): broker said no\n")
	require.Contains(t, out, "outboxctl requeue 1\n")
	t.Logf("outboxctl dead-letters show 2:\n%s", out)

	// An unknown id fails with exit 1 and a JSON error under --json.
	code, out, errOut = c.run("dead-letters", "show", "99", "--json")
	require.Equal(t, exitFail, code)
	require.Empty(t, out)
	var e map[string]string
	require.NoError(t, json.Unmarshal([]byte(errOut), &e), errOut)
	require.Contains(t, e["error"], "not found")

	// Requeue a key: the failed and parked messages come back in order,
	// before the key's pending message.
	var res gormrelay.RequeueResult
	c.runJSON(&res, "requeue", "--key", "order-7")
	require.Equal(t, gormrelay.RequeueResult{Requeued: 2, Moved: 1, Buckets: []int{1}}, res)
	var values []string
	require.NoError(t, db.DB.Table(cfg.Tables.MessagesTable()).Order("id").Pluck("msg_value", &values).Error)
	require.Equal(t, []string{`{"id":7}`, `{"id":7,"v":2}`, "pending"}, values)

	code, _, errOut = c.run("requeue", "424242")
	require.Equal(t, exitFail, code, "no id was a dead letter")
	require.Contains(t, errOut, "not found")

	// Purge only touches dead letters.
	var purged map[string]any
	c.runJSON(&purged, "purge", "--older-than", "24h")
	require.EqualValues(t, 0, purged["purged"])
	c.runJSON(&purged, "purge", "--older-than", "30m")
	require.EqualValues(t, 1, purged["purged"])
	var n int64
	require.NoError(t, db.DB.Table(cfg.Tables.MessagesTable()).Count(&n).Error)
	require.EqualValues(t, 3, n)

	// Pause and resume; an invalid bucket fails.
	code, out, _ = c.run("pause", "3")
	require.Equal(t, exitOK, code)
	require.Contains(t, out, "bucket 3 paused")
	c.runJSON(&st, "status")
	require.True(t, st.Buckets[3].Lease.Paused)
	code, out, _ = c.run("pause", "3")
	require.Equal(t, exitOK, code)
	require.Equal(t, "bucket 3 was already paused\n", out)
	var resumed map[string]any
	c.runJSON(&resumed, "resume", "3")
	require.Equal(t, map[string]any{"bucket": 3.0, "paused": false, "changed": true}, resumed)
	c.runJSON(&st, "status")
	require.False(t, st.Buckets[3].Lease.Paused)
	code, out, _ = c.run("resume", "3")
	require.Equal(t, exitOK, code)
	require.Equal(t, "bucket 3 was not paused; nothing changed\n", out)
	code, _, errOut = c.run("pause", "4")
	require.Equal(t, exitFail, code)
	require.Contains(t, errOut, "outside 0..3")

	// Read with another count than the relays': the lease table's count
	// is shown, with its rows beyond --buckets; the name the metrics use
	// labels the outbox.
	require.Equal(t, 4, st.LeaseBuckets)
	code, out, errOut = c.run("status", "--buckets", "2", "--name", "orders")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "outbox orders (table ctl_outbox_messages): 2 buckets")
	require.Contains(t, out, "WARNING: table ctl_outbox_leases defines 4 buckets (rows up to bucket 3), not --buckets 2")
	require.Regexp(t, `(?m)^3\s+-\s+\d+\s+-\s+no$`, out, "the lease row of bucket 3")
	c.runJSON(&st, "status", "--buckets", "2")
	require.Equal(t, 4, st.LeaseBuckets)
	require.Len(t, st.LeasesBeyond, 2)
	require.Equal(t, 3, st.LeasesBeyond[1].Bucket)
	t.Logf("outboxctl status --buckets 2:\n%s", out)

	// Flags instead of the environment, and the driver spelled out.
	flags := cli{t: t, bin: bin, env: []string{"OUTBOX_DSN=", "OUTBOX_PREFIX="}}
	flags.runJSON(&st, "--driver", "postgres", "--dsn", dsn, "--prefix", "ctl_", "--buckets", "4", "status")
	require.EqualValues(t, 3, st.Pending)

	// Failures never print the password: a missing table, an unreachable
	// server.
	var outputs []string
	code, out, errOut = c.run("status", "--prefix", "missing_")
	require.Equal(t, exitFail, code)
	outputs = append(outputs, out, errOut)
	bad := strings.Replace(dsn, "port=5432", "port=1", 1)
	if bad == dsn {
		bad = dsn + " port=1"
	}
	code, out, errOut = c.run("status", "--dsn", bad)
	require.Equal(t, exitFail, code, errOut)
	outputs = append(outputs, out, errOut)
	code, out, errOut = c.run("status", "--dsn", "postgres://postgres:"+password+"@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.Equal(t, exitFail, code, errOut)
	outputs = append(outputs, out, errOut)
	code, out, errOut = c.run("status", "--dsn", "root:"+password+"@tcp(127.0.0.1:1)/test", "--driver", "mysql")
	require.Equal(t, exitFail, code, errOut)
	outputs = append(outputs, out, errOut)
	for _, o := range outputs {
		require.NotContains(t, o, password)
	}
}

func ptr[T any](v T) *T { return &v }

func TestSchemaCommand(t *testing.T) {
	var out, errOut strings.Builder
	code := run(context.Background(), []string{"--driver", "postgres", "--prefix", "billing_", "schema"}, &out, &errOut, func(string) string { return "" })
	require.Equal(t, 0, code, errOut.String())
	want, err := outbox.SchemaSQL("postgres", outbox.WithPrefix("billing_"))
	require.NoError(t, err)
	require.Equal(t, strings.Join(want, ";\n\n")+";\n", out.String())

	dir := t.TempDir()
	out.Reset()
	code = run(context.Background(), []string{"schema", "--driver", "mysql", "--format", "golang-migrate", "--out", dir}, &out, &errOut, func(string) string { return "" })
	require.Equal(t, 0, code, errOut.String())
	files, err := outbox.MigrationFiles("mysql", outbox.WithPrefix(""), outbox.FormatGolangMigrate)
	require.NoError(t, err)
	for _, f := range files {
		got, err := os.ReadFile(filepath.Join(dir, f.Name))
		require.NoError(t, err)
		require.Equal(t, f.Content, got)
	}

	code = run(context.Background(), []string{"schema"}, &out, &errOut, func(string) string { return "" })
	require.Equal(t, 2, code, "no driver is a usage error")
	code = run(context.Background(), []string{"--driver", "oracle", "schema"}, &out, &errOut, func(string) string { return "" })
	require.Equal(t, 2, code)
}

// runCLI runs the command in process and returns its exit code, stdout and
// stderr.
func runCLI(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, func(string) string { return "" })
	return code, out.String(), errOut.String()
}

// mysqlURLOf turns a go-sql-driver DSN into the mysql:// URL services take.
func mysqlURLOf(t *testing.T, dsn string) string {
	t.Helper()
	cfg, err := mysqldrv.ParseDSN(dsn)
	require.NoError(t, err)
	u := url.URL{Scheme: "mysql", Host: cfg.Addr, Path: "/" + cfg.DBName, User: url.UserPassword(cfg.User, cfg.Passwd)}
	if cfg.Passwd == "" {
		u.User = url.User(cfg.User)
	}
	return u.String()
}

// A driver that does not match the DSN is named, with the driver the DSN
// looks like, before anything connects.
func TestDriverMismatch(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ driver, dsn, looks string }{
		{"postgres", "root:@tcp(127.0.0.1:3306)/test", "mysql"},
		{"mysql", "host=127.0.0.1 port=5432 user=postgres dbname=test", "postgres"},
		{"sqlite", "postgres://postgres@127.0.0.1:5432/test", "postgres"},
		{"postgres", "mysql://root@127.0.0.1:3306/test", "mysql"},
	} {
		code, _, errOut := runCLI("status", "--driver", c.driver, "--dsn", c.dsn)
		require.Equal(t, exitUsage, code, errOut)
		require.Contains(t, errOut, "--driver (or OUTBOX_DRIVER) is "+c.driver+" but the DSN looks like a "+c.looks+" DSN", c.dsn)
	}
}

func TestErrorSummary(t *testing.T) {
	t.Parallel()
	tooLarge := sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 2000066 > 1000000")
	part := int32(3)
	for _, c := range []struct {
		text string
		want string
	}{
		// What the publisher records now: the cause and where, whole.
		{(&publisher.Error{Index: 4, MessageID: "01a2b3c4-0000-7000-8000-000000000000", Topic: "orders", Key: []byte("order-7"), Partition: &part,
			Err: relay.Permanent(fmt.Errorf("%w: %w", publisher.ErrTooLarge, tooLarge))}).Error() + "\nmay have been delivered: a publish was attempted and its outcome is unknown",
			`record too large: 2,000,066 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic orders, partition 3; message id "01a2b3c4-0000-7000-8000-000000000000", key "order-7"`},
		{(&publisher.Error{Index: 0, MessageID: `odd "id"`, Topic: "t", Err: relay.Permanent(sarama.ErrTopicAuthorizationFailed)}).Error(),
			`not authorized to write to topic "t"; topic t; message id "odd \"id\""`},
		// What older releases recorded: the innermost cause.
		{`publisher: message 4 (id "01a2b3c4-0000-7000-8000-000000000000", topic "orders"): permanent: publisher: message too large: ` + tooLarge.Error(),
			tooLarge.Error()},
		{`publisher: message 1 (id "m", topic "t"): dial tcp 10.0.0.1:9092: connect: connection refused`,
			"dial tcp 10.0.0.1:9092: connect: connection refused"},
		{"broker said no", "broker said no"},
		{"permanent:", "permanent:"}, // never stripped to nothing
	} {
		require.Equal(t, c.want, errorSummary(c.text), c.text)
	}
}

// What an operator meets at 3 a.m., on every database: the dead letters'
// JSON decodes back into gormrelay.DeadLetter, the ERROR column shows the
// cause, an unknown key fails, and missing tables get a hint instead of
// the database's error. MySQL is reached through a mysql:// URL.
func TestCLIOperator(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		cfg := outbox.Config{Tables: outbox.WithPrefix("op_"), BucketCount: 4}.WithDefaults()
		require.NoError(t, cfg.Tables.AutoMigrate(ctx, db.DB))
		part := int32(3)
		cause := sarama.ErrTopicAuthorizationFailed
		lastError := (&publisher.Error{Index: 4, MessageID: "01a2b3c4-0000-7000-8000-000000000000", Topic: "orders", Err: relay.Permanent(cause)}).Error()
		// A long cause, as the publisher records an oversized record, and
		// the note of a copy that may be out already.
		tooLarge := sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 1234567 > 1000000")
		big := int32(3)
		bigError := (&publisher.Error{Index: 1, MessageID: "m5", Topic: "orders", Key: []byte("order-8"), Partition: &big,
			Err: relay.Permanent(fmt.Errorf("%w: %w", publisher.ErrTooLarge, tooLarge))}).Error()
		bigCause := `record too large: 1,234,567 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic orders, partition 3; message id "m5", key "order-8"`
		require.True(t, strings.HasPrefix(bigError, bigCause), bigError)
		parkedError := "may have been delivered: it was sent in a batch whose earlier message \"m5\" failed; the broker acknowledged it or did not answer, and the relay publishes it again"
		now := time.Now().UnixMilli()
		require.NoError(t, db.DB.Table(cfg.Tables.DeadLettersTable()).Create([]outbox.DeadLetterRow{
			{ID: 1, MessageID: "m1", Bucket: 1, Topic: "orders", Key: []byte("order-7"), Value: []byte(`{"id":7}`), Partition: &part,
				Headers:  outbox.EncodeHeaders([]outbox.Header{{Key: "text", Value: []byte("v")}, {Key: "bin", Value: []byte{0xff}}, {Key: "nil"}}),
				Attempts: 10, LastError: &lastError, CreatedAtMs: now, DeadAtMs: now, State: "failed"},
			{ID: 2, MessageID: "m2", Bucket: 1, Topic: "orders", Key: []byte{0xff, 0xfe}, Value: []byte{0, 1}, CreatedAtMs: now, DeadAtMs: now, State: "parked"},
			{ID: 3, MessageID: "m3", Bucket: 2, Topic: "orders", Key: []byte{}, Value: []byte{}, CreatedAtMs: now, DeadAtMs: now, State: "failed"},
			{ID: 4, MessageID: "m4", Bucket: 2, Topic: "orders", CreatedAtMs: now, DeadAtMs: now, State: "failed"},
			{ID: 5, MessageID: "m5", Bucket: 3, Topic: "orders", Key: []byte("order-8"), CreatedAtMs: now, DeadAtMs: now, State: "failed",
				Attempts: 1, LastError: &bigError},
			{ID: 6, MessageID: "m6", Bucket: 3, Topic: "orders", Key: []byte("order-8"), CreatedAtMs: now, DeadAtMs: now, State: "parked",
				LastError: &parkedError},
		}).Error)
		admin, err := gormrelay.NewAdmin(db.DB, cfg)
		require.NoError(t, err)

		dsn := db.DSN
		if db.Dialect == dbtest.MySQL {
			dsn = mysqlURLOf(t, db.DSN)
		}
		flags := []string{"--dsn", dsn, "--prefix", "op_", "--buckets", "4"}
		runOK := func(args ...string) string {
			t.Helper()
			code, out, errOut := runCLI(append(args, flags...)...)
			require.Equal(t, exitOK, code, "%q: %s", args, errOut)
			return out
		}

		want, err := admin.DeadLetters(ctx, gormrelay.DeadLetterQuery{})
		require.NoError(t, err)
		var page gormrelay.DeadLetterPage
		require.NoError(t, json.Unmarshal([]byte(runOK("dead-letters", "list", "--json")), &page))
		require.Equal(t, utcTimes(want.Items...), utcTimes(page.Items...))
		for _, d := range want.Items {
			wantOne, err := admin.DeadLetter(ctx, d.ID)
			require.NoError(t, err)
			var got gormrelay.DeadLetter
			require.NoError(t, json.Unmarshal([]byte(runOK("dead-letters", "show", fmt.Sprint(d.ID), "--json")), &got))
			require.Equal(t, utcTimes(wantOne), utcTimes(got), "dead letter %d", d.ID)
		}

		// The ERROR column gives the cause first and whole, never a batch
		// position; `show` gives everything, the sink's text included.
		list := runOK("dead-letters", "list")
		require.Contains(t, list, `not authorized to write to topic "orders"; topic orders; message id "01a2b3c4-0000-7000-8000-000000000000"`+"\n")
		require.Contains(t, list, bigCause+"\n")
		require.NotContains(t, list, "message 4")
		require.NotContains(t, list, "…")
		require.Contains(t, list, "outboxctl dead-letters show ID")
		require.Contains(t, runOK("dead-letters", "show", "1"), cause.Error())
		show := runOK("dead-letters", "show", "5")
		require.Contains(t, show, bigCause)
		require.Contains(t, show, tooLarge.Error())
		require.Contains(t, show, "delivered   no earlier copy known")

		// A parked row says that an earlier copy may be out already.
		var rows []string
		for line := range strings.SplitSeq(list, "\n") {
			if f := strings.Fields(line); len(f) > 3 && (f[0] == "5" || f[0] == "6") {
				rows = append(rows, f[0]+" "+f[2]+" "+f[3])
			}
		}
		require.ElementsMatch(t, []string{"5 failed no", "6 parked maybe"}, rows)
		require.Contains(t, runOK("dead-letters", "show", "6"), "maybe: it was sent in a batch whose earlier message \"m5\" failed")
		var parked gormrelay.DeadLetter
		require.NoError(t, json.Unmarshal([]byte(runOK("dead-letters", "show", "6", "--json")), &parked))
		require.True(t, parked.MaybeDelivered)

		// An unknown key is an operation that failed.
		code, out, errOut := runCLI(append([]string{"requeue", "--key", "no-such-key"}, flags...)...)
		require.Equal(t, exitFail, code, out)
		require.Contains(t, errOut, "not found: no dead letter has key no-such-key")

		// Tables that are not there: which ones, and the flags that fix it.
		code, _, errOut = runCLI("status", "--dsn", dsn, "--prefix", "missing_")
		require.Equal(t, exitFail, code)
		require.Contains(t, errOut, "outbox table(s) missing_outbox_messages, missing_outbox_leases, missing_outbox_relays, missing_outbox_dead_letters not found")
		require.Contains(t, errOut, "--schema")
		require.Contains(t, errOut, "--prefix")
		for _, raw := range []string{"SQLSTATE", "1146", "no such table", "does not exist"} {
			require.NotContains(t, errOut, raw)
		}
	})
}

// utcTimes makes dead letters comparable after a JSON round trip, which
// keeps the instant but not the *time.Location.
func utcTimes(ds ...gormrelay.DeadLetter) []gormrelay.DeadLetter {
	for i := range ds {
		ds[i].CreatedAt, ds[i].DeadAt = ds[i].CreatedAt.UTC(), ds[i].DeadAt.UTC()
	}
	return ds
}

// TestParseNegativeIDs: an argument of negative ids is positional (WAL
// mode's dead-letter ids), unless it is the value of the flag before it;
// "--" still ends the flags; other dashed arguments are still flags.
func TestParseNegativeIDs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args  []string
		pos   []string
		limit int
		err   string
	}{
		{args: []string{"show", "-8939315240"}, pos: []string{"show", "-8939315240"}},
		{args: []string{"-1,-2", "--limit", "3", "-4"}, pos: []string{"-1,-2", "-4"}, limit: 3},
		{args: []string{"--limit", "-5", "x"}, pos: []string{"x"}, limit: -5},
		{args: []string{"--limit=2", "a", "-7", "b"}, pos: []string{"a", "-7", "b"}, limit: 2},
		{args: []string{"--", "-7", "--limit"}, pos: []string{"-7", "--limit"}},
		{args: []string{"-9", "--", "--limit"}, pos: []string{"-9", "--limit"}},
		{args: []string{"-9x"}, err: "flag provided but not defined: -9x"},
		{args: []string{"-5", "--nope"}, err: "flag provided but not defined: -nope"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		limit := fs.Int("limit", 0, "")
		pos, err := parse(fs, tc.args)
		if tc.err != "" {
			require.ErrorContains(t, err, tc.err, tc.args)
			continue
		}
		require.NoError(t, err, tc.args)
		require.Equal(t, tc.pos, pos, tc.args)
		require.Equal(t, tc.limit, *limit, tc.args)
	}
}

// The dead-letter list explains DELIVERED maybe only when a row is.
func TestDeadLetterListExplainsMaybe(t *testing.T) {
	var b strings.Builder
	page := ops.DeadLetterPage{Items: []ops.DeadLetter{{ID: 1, Topic: "orders", State: ops.DeadLetterFailed}}}
	printDeadLetters(&b, page)
	require.NotContains(t, b.String(), "DELIVERED maybe")
	require.Contains(t, b.String(), "Whole error, key and value: outboxctl dead-letters show ID")

	b.Reset()
	page.Items = append(page.Items, ops.DeadLetter{ID: 2, Topic: "orders", State: ops.DeadLetterParked, MaybeDelivered: true})
	printDeadLetters(&b, page)
	require.Contains(t, b.String(), "DELIVERED maybe: an earlier copy may already have reached consumers.")
	require.Contains(t, b.String(), "(parked: waits behind a failed message of its key; requeue the key)", "a parked row says what it waits for")
}
