package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/relay"
)

func inCI() bool { return os.Getenv("CI") == "true" || os.Getenv("CI") == "1" }

func getenv(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func randomName() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return "gin_" + hex.EncodeToString(b[:])
}

// databaseURL creates a fresh database for the test and returns the URL
// the service takes.
func databaseURL(t *testing.T, kind string) string {
	t.Helper()
	unreachable := func(err error) {
		if inCI() {
			t.Fatalf("%s required in CI: %v", kind, err)
		}
		t.Skipf("%s unreachable: %v", kind, err)
	}
	name := randomName()
	switch kind {
	case "sqlite":
		return filepath.Join(t.TempDir(), "orders.db")
	case "postgres":
		admin, err := sql.Open("pgx", getenv("OUTBOX_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"))
		require.NoError(t, err)
		t.Cleanup(func() { admin.Close() })
		if _, err := admin.Exec("CREATE SCHEMA " + name); err != nil {
			unreachable(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + name + " CASCADE") })
		return getenv("GIN_ORDERS_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable") + "&search_path=" + name
	case "mysql":
		admin, err := sql.Open("mysql", getenv("OUTBOX_TEST_MYSQL_DSN", "root:@tcp(127.0.0.1:3306)/test"))
		require.NoError(t, err)
		t.Cleanup(func() { admin.Close() })
		if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
			unreachable(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE " + name) })
		return getenv("GIN_ORDERS_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306") + "/" + name
	}
	t.Fatalf("unknown database %s", kind)
	return ""
}

type client struct {
	t    *testing.T
	base string
}

func (c client) do(method, path string, body any, want int) map[string]any {
	c.t.Helper()
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.base+path, r)
	require.NoError(c.t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	require.Equal(c.t, want, resp.StatusCode, "%s %s: %s", method, path, raw)
	out := map[string]any{}
	if len(raw) > 0 {
		require.NoError(c.t, json.Unmarshal(raw, &out))
	}
	return out
}

type event struct {
	Key, Type, MessageID string
	Partition            int32
	Offset               int64
	Body                 map[string]any
}

// readEvents consumes the topic until want records arrived.
func readEvents(t *testing.T, brokers []string, topic string, want int) []event {
	t.Helper()
	cfg := sarama.NewConfig()
	c, err := sarama.NewConsumer(brokers, cfg)
	require.NoError(t, err)
	defer c.Close()
	parts, err := c.Partitions(topic)
	require.NoError(t, err)
	ch := make(chan event, 1024)
	for _, p := range parts {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		require.NoError(t, err)
		defer pc.Close()
		go func() {
			for m := range pc.Messages() {
				e := event{Key: string(m.Key), Partition: m.Partition, Offset: m.Offset}
				for _, h := range m.Headers {
					switch string(h.Key) {
					case MessageIDHeader:
						e.MessageID = string(h.Value)
					case "event-type":
						e.Type = string(h.Value)
					}
				}
				_ = json.Unmarshal(m.Value, &e.Body)
				ch <- e
			}
		}()
	}
	var out []event
	deadline := time.After(20 * time.Second)
	for len(out) < want {
		select {
		case e := <-ch:
			out = append(out, e)
		case <-deadline:
			t.Fatalf("got %d of %d events: %+v", len(out), want, out)
		}
	}
	return out
}

// runApp runs app until the test ends, then checks that Run returns nil
// and Close returns, each within processDeadline.
func runApp(t *testing.T, app *App) {
	t.Helper()
	runCtx, stop := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- app.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-ran:
			require.NoError(t, err, "a clean stop at the end of Run's context")
		case <-time.After(processDeadline):
			t.Errorf("Run did not return within %v", processDeadline)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		closed := make(chan struct{})
		go func() {
			app.Close(ctx)
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(processDeadline):
			t.Errorf("Close did not return within %v", processDeadline)
		}
	})
}

func TestOrdersFlowToKafka(t *testing.T) {
	for _, kind := range []string{"sqlite", "postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			topic := "orders_" + kind
			if brokers := os.Getenv("KAFKA_BROKERS"); brokers != "" {
				topic = createTopic(t, brokers, topic)
			}
			ctx := context.Background()
			app, err := Start(ctx, Config{
				Addr:         "127.0.0.1:0",
				DatabaseURL:  databaseURL(t, kind),
				KafkaBrokers: os.Getenv("KAFKA_BROKERS"),
				Topic:        topic,
				Consume:      true, // the demo consumer too: Close must stop it
				Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
			})
			require.NoError(t, err)
			runApp(t, app)
			c := client{t: t, base: "http://" + app.Addr()}

			const orders = 5
			ids := make([]string, orders)
			for i := range ids {
				o := c.do("POST", "/orders", map[string]any{"customer": fmt.Sprintf("c%d", i), "total": 100 * i}, http.StatusCreated)
				ids[i] = fmt.Sprint(o["id"])
			}
			for _, id := range ids {
				c.do("PATCH", "/orders/"+id, map[string]any{"status": "paid"}, http.StatusOK)
				c.do("PATCH", "/orders/"+id, map[string]any{"status": "paid"}, http.StatusOK) // no change: no event
				c.do("PATCH", "/orders/"+id, map[string]any{"status": "shipped"}, http.StatusOK)
			}
			c.do("DELETE", "/orders/"+ids[0], nil, http.StatusNoContent)
			c.do("GET", "/orders/"+ids[0], nil, http.StatusNotFound)
			got := c.do("GET", "/orders/"+ids[1], nil, http.StatusOK)
			require.Equal(t, "shipped", got["status"])
			c.do("PATCH", "/orders/"+ids[1], map[string]any{"status": "bogus"}, http.StatusBadRequest)

			want := orders*3 + 1
			events := readEvents(t, app.Brokers(), topic, want)

			seen := map[string]bool{}
			perKey := map[string][]event{}
			for _, e := range events {
				require.Len(t, e.MessageID, 36, "every record carries the message id header")
				require.False(t, seen[e.MessageID], "duplicate %s", e.MessageID)
				seen[e.MessageID] = true
				perKey[e.Key] = append(perKey[e.Key], e)
			}
			for _, id := range ids {
				evs := perKey[id]
				sort.Slice(evs, func(i, j int) bool { return evs[i].Offset < evs[j].Offset })
				var types []string
				for _, e := range evs {
					types = append(types, e.Type)
					require.Equal(t, evs[0].Partition, e.Partition, "one key, one partition")
				}
				wantTypes := []string{"OrderPlaced", "OrderStatusChanged", "OrderStatusChanged"}
				if id == ids[0] {
					wantTypes = append(wantTypes, "OrderCancelled")
				}
				require.Equal(t, wantTypes, types, "order %s: events in write order", id)
				require.Equal(t, "new", evs[1].Body["from"])
				require.Equal(t, "paid", evs[1].Body["to"])
				require.Equal(t, "paid", evs[2].Body["from"])
				require.Equal(t, "shipped", evs[2].Body["to"])
			}

			requireProbesOK(t, app.Addr(), "/healthz", "/livez", "/readyz")
			// The relay's metrics count every acknowledged event.
			ackLine := fmt.Sprintf("outbox_messages_acknowledged_total{outbox=\"outbox_messages\"} %d", want)
			require.Eventually(t, func() bool {
				body, ok := metricsText(app.Addr())
				return ok && strings.Contains(body, ackLine)
			}, 5*time.Second, 20*time.Millisecond, "metrics show %s", ackLine)

			// The admin API answers read-only requests and refuses mutations.
			resp, err := http.Get("http://" + app.Addr() + "/admin/outbox/status")
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			resp, err = http.Post("http://"+app.Addr()+"/admin/outbox/dead-letters/requeue", "application/json", strings.NewReader(`{"all":true}`))
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusForbidden, resp.StatusCode)

			// The web UI shows the same outbox, and refuses changes too.
			resp, err = http.Get("http://" + app.Addr() + "/admin/outbox-ui")
			require.NoError(t, err)
			page, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode, "%s", page)
			require.Equal(t, "/admin/outbox-ui/", resp.Request.URL.Path, "the prefix redirects to its trailing slash")
			require.Contains(t, string(page), `<span class="mode ro" id="mode">read-only</span>`)
			require.Contains(t, string(page), `id="total-pending">0<`, "every event was published")
			resp, err = http.Get("http://" + app.Addr() + "/admin/outbox-ui/static/ui.css")
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			resp, err = http.PostForm("http://"+app.Addr()+"/admin/outbox-ui/actions/requeue", url.Values{"all": {"true"}, "confirm": {"yes"}})
			require.NoError(t, err)
			resp.Body.Close()
			require.Equal(t, http.StatusForbidden, resp.StatusCode)
		})
	}
}

// createTopic creates a topic unique to this run on the real cluster in
// brokers (clusters usually refuse to create topics on demand) and returns
// its name once every partition's leader answers for it: the service's
// consumer reads each partition's offsets at its start, which a partition
// still electing its leader refuses (NotLeaderForPartition).
func createTopic(t *testing.T, brokers, base string) string {
	t.Helper()
	name := fmt.Sprintf("%s_%d", base, time.Now().UnixNano())
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0
	admin, err := sarama.NewClusterAdmin(strings.Split(brokers, ","), cfg)
	require.NoError(t, err)
	defer admin.Close()
	const partitions = 3
	require.NoError(t, admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: -1}, false))
	client, err := sarama.NewClient(strings.Split(brokers, ","), cfg)
	require.NoError(t, err)
	defer client.Close()
	var lastErr error
	require.Eventually(t, func() bool {
		if lastErr = client.RefreshMetadata(name); lastErr != nil {
			return false
		}
		for p := range int32(partitions) {
			if _, lastErr = client.GetOffset(name, p, sarama.OffsetOldest); lastErr != nil {
				return false
			}
		}
		return true
	}, time.Minute, 50*time.Millisecond, "every partition of %s has a leader that answers", name)
	return name
}

// serveInBackground runs Serve with cfg on a goroutine and returns the
// service once it is up, and the channel of Serve's result.
func serveInBackground(t *testing.T, ctx context.Context, cfg Config) (*App, <-chan error) {
	t.Helper()
	up := make(chan *App, 1)
	served := make(chan error, 1)
	go func() { served <- Serve(ctx, cfg, func(a *App) { up <- a }) }()
	select {
	case app := <-up:
		return app, served
	case err := <-served:
		t.Fatalf("Serve: %v", err)
		return nil, nil
	}
}

// A relay that stops on an error ends the service: here a writer with a
// larger BucketCount (64, the service's relay has 8) commits to the same
// outbox, the relay stops on the misconfiguration, and Serve returns its
// error after shutting the rest down, instead of serving on while events
// pile up.
func TestRelayFailureEndsTheService(t *testing.T) {
	t.Parallel()
	dbPath := filepath.Join(t.TempDir(), "orders.db")
	app, served := serveInBackground(t, context.Background(), Config{
		Addr: "127.0.0.1:0", DatabaseURL: dbPath, Topic: "orders_fail",
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	c := client{t: t, base: "http://" + app.Addr()}
	c.do("POST", "/orders", map[string]any{"customer": "c1", "total": 100}, http.StatusCreated)

	writeWithBucketCount64(t, dbPath, "orders_fail")

	var err error
	select {
	case err = <-served:
	case <-time.After(processDeadline):
		t.Fatalf("Serve did not return within %v of the relay's misconfiguration", processDeadline)
	}
	require.Error(t, err)
	require.True(t, relay.IsMisconfiguration(err), "%v", err)
	require.ErrorContains(t, err, "a writer uses a BucketCount of at least")
	_, err = http.Get("http://" + app.Addr() + "/healthz")
	require.Error(t, err, "the HTTP server was shut down too")
}

// writeWithBucketCount64 commits 100 events to topic in the outbox of the
// SQLite file dbPath as a writer with BucketCount 64 would, next to the
// service's relay with 8: a misconfiguration its relay stops on.
func writeWithBucketCount64(t *testing.T, dbPath, topic string) {
	t.Helper()
	writer, err := openDatabase(dbPath)
	require.NoError(t, err)
	defer func() {
		if sqlDB, err := writer.DB(); err == nil {
			sqlDB.Close()
		}
	}()
	wide, err := outbox.NewPlugin(outbox.Config{BucketCount: 64})
	require.NoError(t, err)
	require.NoError(t, writer.Use(wide))
	require.NoError(t, writer.Transaction(func(tx *gorm.DB) error {
		for i := range 100 {
			if err := outbox.Enqueue(tx, &outbox.Message{Topic: topic, Key: fmt.Appendf(nil, "k-%d", i), Value: []byte("v")}); err != nil {
				return err
			}
		}
		return nil
	}))
}
