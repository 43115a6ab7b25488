package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// walDatabase creates a schema on the PostgreSQL server with
// wal_level=logical (OUTBOX_TEST_POSTGRES_WAL_DSN, by default the one
// scripts/services.sh starts on port 5434) and returns the service's URL
// for it, a name of the test's own for the slot and the outbox (a slot
// decodes the WAL messages of the whole database: tests sharing the
// server tell theirs apart by the outbox name) and the admin connection. The
// slot, its publication and the schema are dropped when the test ends.
func walDatabase(t *testing.T) (url, slot string, admin *sql.DB) {
	t.Helper()
	admin, err := sql.Open("pgx", getenv("OUTBOX_TEST_POSTGRES_WAL_DSN", "host=127.0.0.1 port=5434 user=postgres dbname=test sslmode=disable"))
	require.NoError(t, err)
	t.Cleanup(func() { admin.Close() })
	name := randomName()
	if _, err := admin.Exec("CREATE SCHEMA " + name); err != nil {
		if inCI() {
			t.Fatalf("the WAL mode PostgreSQL server is required in CI: %v", err)
		}
		t.Skipf("the WAL mode PostgreSQL server is unreachable: %v", err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1", name)
		_, _ = admin.Exec("DROP PUBLICATION IF EXISTS " + name)
		_, _ = admin.Exec("DROP SCHEMA " + name + " CASCADE")
	})
	return getenv("GIN_ORDERS_TEST_POSTGRES_WAL_URL", "postgres://postgres@127.0.0.1:5434/test?sslmode=disable") + "&search_path=" + name, name, admin
}

func slotCount(t *testing.T, admin *sql.DB, slot string) int {
	t.Helper()
	var n int
	require.NoError(t, admin.QueryRow("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&n))
	return n
}

// In WAL mode the service creates its slot at start, an order's event
// reaches the consumer through the slot with no row in the messages
// table, SIGINT stops it with status 0, and a restart after the slot was
// lost exits with status 1 and says so.
func TestProcessWALMode(t *testing.T) {
	t.Parallel()
	url, slot, admin := walDatabase(t)
	args := []string{"-addr", "127.0.0.1:0", "-kafka-brokers=", "-outbox-mode", "wal", "-wal-slot", slot, "-outbox-name", slot, "-database-url", url}

	s := startService(t, args...)
	s.waitLog(`msg="WAL mode: reading the replication slot instead of the messages table"`, "slot="+slot)
	require.Equal(t, 1, slotCount(t, admin, slot), "the slot exists once the service started")
	postOrder(t, s.addr())
	s.waitLog(`msg="consumer received event"`, "event_type=OrderPlaced", "key=1 ")
	var rows int
	require.NoError(t, admin.QueryRow("SELECT count(*) FROM "+slot+".outbox_messages").Scan(&rows))
	require.Zero(t, rows, "no row in the messages table in WAL mode")
	require.NotContains(t, s.log(), `msg="relay: leases changed"`, "no table relay runs")

	s.signal(syscall.SIGINT)
	require.Equal(t, 0, s.waitExit(), "clean exit")
	s.waitLog("msg=stopped")
	// The reader owned its producer: once it closed, the lease was
	// released, so a restarted service reads at once.
	var expires int64
	require.NoError(t, admin.QueryRow("SELECT expires_at_ms FROM "+slot+".outbox_leases_wal WHERE slot = $1", slot).Scan(&expires))
	require.Zero(t, expires, "the slot's lease is released by a clean exit")

	// The slot is lost (dropped here) while the service is down: the
	// service does not start again over the gap.
	_, err := admin.Exec("SELECT pg_drop_replication_slot($1)", slot)
	require.NoError(t, err)
	again := startService(t, args...)
	require.Equal(t, 1, again.waitExit(), "a lost slot is a failed process")
	again.waitLog(`msg="stopped on error"`, "the slot does not exist any more")
	require.Zero(t, slotCount(t, admin, slot), "the lost slot is not created again silently")
}

// In WAL mode (in process) an order's events reach Kafka in write order,
// the health probes answer, and /metrics has the reader's series.
func TestOrdersFlowInWALMode(t *testing.T) {
	t.Parallel()
	url, slot, _ := walDatabase(t)
	app, err := Start(context.Background(), Config{Addr: "127.0.0.1:0", DatabaseURL: url, Topic: "orders_wal",
		Mode: ModeWAL, WALSlot: slot, OutboxName: slot, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	runApp(t, app)
	c := client{t: t, base: "http://" + app.Addr()}
	o := c.do("POST", "/orders", map[string]any{"customer": "ada", "total": 4200}, http.StatusCreated)
	id := fmt.Sprint(o["id"])
	c.do("PATCH", "/orders/"+id, map[string]any{"status": "paid"}, http.StatusOK)
	c.do("PATCH", "/orders/"+id, map[string]any{"status": "shipped"}, http.StatusOK)
	c.do("DELETE", "/orders/"+id, nil, http.StatusNoContent)

	events := readEvents(t, app.Brokers(), "orders_wal", 4)
	sort.Slice(events, func(i, j int) bool { return events[i].Offset < events[j].Offset })
	var types []string
	for _, e := range events {
		require.Equal(t, id, e.Key)
		types = append(types, e.Type)
	}
	require.Equal(t, []string{"OrderPlaced", "OrderStatusChanged", "OrderStatusChanged", "OrderCancelled"}, types, "%+v", events)

	requireProbesOK(t, app.Addr(), "/livez", "/readyz", "/healthz")
	// The admin API is the slot's: its reader holds the lease and has
	// confirmed a position.
	var wal map[string]any
	require.Eventually(t, func() bool {
		wal = c.do("GET", "/admin/outbox/wal", nil, http.StatusOK)
		reader, _ := wal["reader"].(map[string]any)
		lsn, _ := wal["confirmed_lsn"].(string)
		return wal["slot"] == slot && reader["held"] == true && lsn != ""
	}, 30*time.Second, 20*time.Millisecond, "/admin/outbox/wal: %v", &wal)
	// At least 4: a reader term restarted under load publishes again.
	publishedRE := regexp.MustCompile(`(?m)^outbox_wal_published_total\{outbox="` + slot + `",slot="` + slot + `"\} (\d+)$`)
	var metrics string
	require.Eventually(t, func() bool {
		var ok bool
		if metrics, ok = metricsText(app.Addr()); !ok {
			return false
		}
		m := publishedRE.FindStringSubmatch(metrics)
		if m == nil {
			return false
		}
		n, err := strconv.Atoi(m[1])
		return err == nil && n >= 4 && strings.Contains(metrics, "outbox_wal_slot_lost{")
	}, 30*time.Second, 20*time.Millisecond, "metrics show the reader's series: %s", lazy(func() string { return metrics }))
	// The collector is the reader's Observer: the acknowledged events
	// (the UI's throughput) and the backlog as table mode's; the Admin's
	// series: a reader holds the lease, and the lag in time.
	for _, re := range []string{
		`(?m)^outbox_messages_acknowledged_total\{outbox="` + slot + `"\} ([4-9]|\d\d+)$`,
		`(?m)^outbox_pending_available\{outbox="` + slot + `"\} 1$`,
		`(?m)^outbox_wal_lease_held\{outbox="` + slot + `",slot="` + slot + `"\} 1$`,
		`(?m)^outbox_wal_lag_age_seconds\{outbox="` + slot + `",slot="` + slot + `"\} `,
	} {
		require.Eventually(t, func() bool {
			var ok bool
			metrics, ok = metricsText(app.Addr())
			return ok && regexp.MustCompile(re).MatchString(metrics)
		}, 30*time.Second, 20*time.Millisecond, "metrics match %s: %s", re, lazy(func() string { return metrics }))
	}
}

// lazy is a message argument formatted when the message is: %s of it
// calls it.
type lazy func() string

func (l lazy) String() string { return l() }

// requireProbesOK checks that each probe answers 200.
func requireProbesOK(t *testing.T, addr string, probes ...string) {
	t.Helper()
	for _, probe := range probes {
		resp, err := http.Get("http://" + addr + probe)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, probe)
	}
}

// metricsText returns the service's /metrics page.
func metricsText(addr string) (string, bool) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return "", false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err == nil
}
