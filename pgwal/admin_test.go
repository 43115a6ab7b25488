package pgwal_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/ops/opsui"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// getJSON GETs path from srv and decodes the JSON answer into v; it
// returns the status code.
func getJSON(t *testing.T, srv *httptest.Server, path string, v any) int {
	t.Helper()
	return call(t, srv, http.MethodGet, path, "", v)
}

func postJSON(t *testing.T, srv *httptest.Server, path, body string, v any) int {
	t.Helper()
	return call(t, srv, http.MethodPost, path, body, v)
}

func call(t *testing.T, srv *httptest.Server, method, path, body string, v any) int {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if v != nil {
		require.NoError(t, json.Unmarshal(b, v), "%s: %s", path, b)
	}
	return resp.StatusCode
}

// TestAdminOperatorSurface: the admin API and UI of an outbox in WAL mode
// show the slot, its reader, its positions and lags; its dead letters
// list like table mode's and a requeue through the API emits them again:
// Kafka receives the key in order, later writes included.
func TestAdminOperatorSurface(t *testing.T) {
	e := setup(t)
	var (
		poison  atomic.Bool
		blocked atomic.Bool
	)
	poison.Store(true)
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		if blocked.Load() {
			return 0, relay.Unavailable(errors.New("broker down"))
		}
		return e.publishPoisoned(ctx, msgs, poison.Load())
	})
	r := e.reader(t, pub, "reader-a")
	admin, err := r.Admin(e.plugin)
	require.NoError(t, err)
	stop := run(r)
	e.write(t, 2, 0, 10)

	api := httptest.NewServer(opshttp.NewHandler(admin, opshttp.Options{AllowMutations: true}))
	defer api.Close()
	slot := r.Config().Slot

	// k0:3 failed, k0:4..9 parked; k1 published.
	var counts ops.DeadLetterCounts
	require.Eventually(t, func() bool {
		return getJSON(t, api, "/dead-letters/count", &counts) == http.StatusOK && counts.Total() == 7
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, ops.DeadLetterCounts{Failed: 1, Parked: 6}, counts)
	var page ops.DeadLetterPage
	require.Equal(t, http.StatusOK, getJSON(t, api, "/dead-letters?key=k0&state=failed", &page))
	require.Len(t, page.Items, 1)
	require.Less(t, page.Items[0].ID, int64(0), "a WAL mode dead letter")
	require.Contains(t, page.Items[0].LastError, "poison k0:3")
	var one ops.DeadLetter
	require.Equal(t, http.StatusOK, getJSON(t, api, "/dead-letters/"+strconv.FormatInt(page.Items[0].ID, 10), &one))
	require.Equal(t, "k0:3", string(one.Value))

	// The slot in /status and /wal: active, read by reader-a, confirmed
	// as far as the current position once everything was handled.
	var st ops.Status
	require.Eventually(t, func() bool {
		return getJSON(t, api, "/status", &st) == http.StatusOK && st.WAL != nil && st.WAL.Active && st.WAL.Reader.Held &&
			st.WAL.ConfirmedLSN != "" && st.WAL.Reader.ConfirmedLSN == st.WAL.ConfirmedLSN
	}, 30*time.Second, 50*time.Millisecond, "status: %+v", &st)
	w := st.WAL
	require.Equal(t, slot, w.Slot)
	require.True(t, w.Exists)
	require.False(t, w.Lost)
	require.Equal(t, "reader-a", w.Reader.Owner)
	require.Positive(t, w.Reader.Term)
	require.Equal(t, int64(1500), w.LeaseDurationMs)
	require.Equal(t, "reader", w.LagSource)
	require.Equal(t, int64(7), st.DeadLetters.Total())

	// The lag in time: messages the reader holds while the broker is down.
	blocked.Store(true)
	before := time.Now()
	e.write(t, 1, 100, 101) // k0:100, parked behind the dead letter: not held
	e.write(t, 2, 200, 201) // k1:200 is held
	var ws ops.WALStatus
	require.Eventually(t, func() bool {
		return getJSON(t, api, "/wal", &ws) == http.StatusOK && !ws.Oldest.IsZero()
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, "reader", ws.LagSource)
	require.False(t, ws.Oldest.Before(before.Add(-time.Second)), "the oldest held message is the one just written")
	require.Eventually(t, func() bool {
		return getJSON(t, api, "/wal", &ws) == http.StatusOK && ws.LagAgeMs >= 200 && ws.RetainedBytes > 0
	}, 30*time.Second, 20*time.Millisecond, "the lag grows while the broker is down: %+v", &ws)
	// Readiness reads the held message's age as the backlog's.
	ready := opshttp.Health{Operator: admin, Relay: r, MaxAge: 100 * time.Millisecond, MaxRetainedWALBytes: -1}.Handler()
	rec := httptest.NewRecorder()
	ready.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	require.Equal(t, http.StatusServiceUnavailable, rec.Code, rec.Body.String())
	require.Contains(t, rec.Body.String(), `"status":"unhealthy"`)
	require.Contains(t, rec.Body.String(), `"wal_slot":"`+slot+`"`)
	blocked.Store(false)

	// The UI's overview shows the slot.
	ui := httptest.NewServer(opsui.New(admin, opsui.Options{AllowMutations: true}))
	defer ui.Close()
	resp, err := http.Get(ui.URL + "/")
	require.NoError(t, err)
	page0, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	html := string(page0)
	require.Contains(t, html, `id="wal"`)
	require.Contains(t, html, `<td class="slot">`+slot+`</td>`)
	require.Contains(t, html, "reader-a")
	require.Regexp(t, `class="wal-state ">active</td>`, html)
	require.NotContains(t, html, `action="actions/pause"`, "no per-bucket pause in WAL mode")
	require.NotContains(t, html, "Lease owner", "bucket leases are table mode's")
	require.NotContains(t, html, "No relay has a heartbeat", "relays are table mode's")

	// No pause in WAL mode.
	var bad map[string]string
	require.Equal(t, http.StatusBadRequest, postJSON(t, api, "/buckets/0/pause", "", &bad))
	require.Contains(t, bad["error"], "WAL mode has no per-bucket pause")

	// Requeue through the API: the dead letters (and k0:100, parked
	// meanwhile) are emitted again in order.
	poison.Store(false)
	require.Eventually(t, func() bool {
		return getJSON(t, api, "/dead-letters/count", &counts) == http.StatusOK && counts.Total() == 9
	}, 30*time.Second, 50*time.Millisecond, "k0:100 and k0:200 parked behind the dead letter")
	var res ops.RequeueResult
	require.Equal(t, http.StatusOK, postJSON(t, api, "/dead-letters/requeue", `{"key":"k0"}`, &res))
	require.Equal(t, int64(9), res.Requeued)
	e.write(t, 1, 101, 103) // k0:101, k0:102 after the requeue
	want := []string{}
	for i := range 10 {
		want = append(want, "k0:"+strconv.Itoa(i))
	}
	want = append(want, "k0:100", "k0:200", "k0:101", "k0:102")
	// At least once, in order: the first appearance of each value follows
	// the key's order (a reader that loses its lease under load replays
	// what it had not confirmed, after what it had published).
	var k0 []string
	require.Eventually(t, func() bool {
		k0 = k0[:0]
		seen := map[string]bool{}
		for _, rec := range e.kafka.ReadLog(t, e.topic, 30*time.Second) {
			if v := string(rec.Value); string(rec.Key) == "k0" && !seen[v] {
				seen[v] = true
				k0 = append(k0, v)
			}
		}
		return len(k0) >= len(want)
	}, 60*time.Second, 100*time.Millisecond, "k0 in Kafka: %v", &k0)
	require.Equal(t, want, k0, "the key in order, the requeued dead letters first")
	require.Equal(t, http.StatusOK, getJSON(t, api, "/dead-letters/count", &counts))
	require.Zero(t, counts.Total())
	require.NoError(t, stop())
}

// TestAdminRequeueByIDAndAll: requeueing one id of a key requeues the
// whole key in order; RequeueAll requeues keyless dead letters too; ids
// that are no dead letters are reported. The emitted messages are read
// back from the slot.
func TestAdminRequeueByIDAndAll(t *testing.T) {
	e := setup(t)
	admin, err := pgwal.NewAdmin(e.db.DB, e.plugin, pgwal.Config{})
	require.NoError(t, err)
	created, err := admin.EnsureSlot(context.Background())
	require.NoError(t, err)
	require.True(t, created)
	t.Cleanup(func() { _, _ = admin.DropSlot(context.Background(), true) })
	dl := e.plugin.Config().Tables.DeadLettersTable()
	now := time.Now().UnixMilli()
	row := func(id int64, key []byte, value, state string) outbox.DeadLetterRow {
		return outbox.DeadLetterRow{ID: id, MessageID: "m" + strconv.FormatInt(-id, 10), Topic: e.topic, Key: key, Value: []byte(value),
			CreatedAtMs: now, DeadAtMs: now, State: state}
	}
	// WAL ids are negated positions: -100 was written before -200.
	rows := []outbox.DeadLetterRow{
		row(-300, []byte("a"), "a:2", "parked"), row(-100, []byte("a"), "a:0", "failed"), row(-200, []byte("a"), "a:1", "parked"),
		row(-400, nil, "nokey", "failed"),
	}
	require.NoError(t, e.db.Table(dl).Create(&rows).Error)

	res, err := admin.RequeueIDs(context.Background(), -200, 12345)
	require.NoError(t, err)
	require.Equal(t, int64(3), res.Requeued, "the whole key")
	require.Equal(t, []int64{12345}, res.NotFound)
	res, err = admin.RequeueAll(context.Background(), "")
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Requeued)
	var left int64
	require.NoError(t, e.db.Table(dl).Count(&left).Error)
	require.Zero(t, left)

	u, err := admin.Unconfirmed(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(4), u.Messages)
	require.Equal(t, int64(1), u.Keys)

	// Read them: the key in its original order.
	var got []string
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		for _, m := range msgs {
			got = append(got, string(m.Value))
		}
		return len(msgs), nil
	})
	r := e.reader(t, pub, "r")
	stop := run(r)
	require.Eventually(t, func() bool { return r.Stats().Published == 4 }, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, stop())
	var a []string
	for _, v := range got {
		if strings.HasPrefix(v, "a:") {
			a = append(a, v)
		}
	}
	require.Equal(t, []string{"a:0", "a:1", "a:2"}, a)
	require.Contains(t, got, "nokey")
}

// TestAdminHealth: readiness fails with a reason for a missing slot, a
// slot retaining too much WAL, a lease nobody holds for longer than the
// lease duration, and a lost slot; liveness fails at once when the reader
// stopped on a SlotLostError.
func TestAdminHealth(t *testing.T) {
	e := setup(t)
	probe := func(h http.Handler, path string) (int, map[string]any) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		var body map[string]any
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &body), rec.Body.String())
		return rec.Code, body
	}

	// Never created: missing.
	missing, err := pgwal.NewAdmin(e.db.DB, e.plugin, pgwal.Config{Slot: "never_" + strings.ToLower(strings.TrimPrefix(e.plugin.Config().Name, "o_"))})
	require.NoError(t, err)
	code, body := probe(opshttp.Health{Operator: missing, MaxAge: time.Hour}.Handler(), "/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "slot_missing", body["reason"])
	require.Contains(t, body["error"], "does not exist")

	r := e.reader(t, e.pub, "a")
	admin, err := r.Admin(e.plugin)
	require.NoError(t, err)
	stop := run(r)
	h := opshttp.Health{Operator: admin, Relay: r, MaxAge: time.Hour, MaxRetainedWALBytes: -1}.Handler()
	require.Eventually(t, func() bool { code, _ := probe(h, "/readyz"); return code == http.StatusOK }, 30*time.Second, 20*time.Millisecond)
	e.write(t, 1, 0, 3)
	e.checkDelivered(t, 1, 3)
	require.NoError(t, stop())
	code, body = probe(h, "/livez")
	require.Equal(t, http.StatusOK, code, "a reader whose context ended is no failure: %v", body)

	// Writes while no reader runs: retained WAL over a small bound.
	e.write(t, 1, 3, 50)
	small := opshttp.Health{Operator: admin, MaxAge: time.Hour, MaxRetainedWALBytes: 1024}.Handler()
	require.Eventually(t, func() bool {
		code, body = probe(small, "/readyz")
		return body["reason"] == "retained_wal"
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body["error"], "retains")
	require.Greater(t, body["wal_retained_bytes"], float64(1024))

	// No reader: the lease lapses (1.5s) and stays free for longer than
	// the lease duration.
	unbounded := opshttp.Health{Operator: admin, MaxAge: time.Hour, MaxRetainedWALBytes: -1}.Handler()
	code, _ = probe(unbounded, "/readyz")
	require.Equal(t, http.StatusOK, code, "the lease is still held or just expired")
	require.Eventually(t, func() bool {
		code, body = probe(unbounded, "/readyz")
		return body["reason"] == "no_reader"
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body["error"], "no reader seen holding the slot's lease since it expired at ")
	require.Contains(t, body["error"], "; last owner a")

	// Lost: dropped behind the readers' back.
	slot := r.Config().Slot
	require.NoError(t, e.db.Exec("SELECT pg_drop_replication_slot(?)", slot).Error)
	code, body = probe(unbounded, "/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "slot_lost", body["reason"])
	require.Contains(t, body["error"], "dropped")

	// A reader started on the lost slot stops with a SlotLostError:
	// liveness fails at once, readiness says failed.
	r2, err := pgwal.New(e.db.DB, e.plugin, e.pub, r.Config())
	require.NoError(t, err)
	h2 := opshttp.Health{Operator: admin, Relay: r2, MaxAge: time.Hour}.Handler()
	code, _ = probe(h2, "/livez")
	require.Equal(t, http.StatusOK, code, "not started yet")
	require.Error(t, r2.Run(context.Background()))
	<-r2.Stopped()
	code, body = probe(h2, "/livez")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "failed", body["status"])
	require.Contains(t, body["error"], "does not exist any more")
	var lost *pgwal.SlotLostError
	require.ErrorAs(t, r2.Err(), &lost)
	code, body = probe(h2, "/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "failed", body["status"])

	// Acknowledging the loss: dropping the missing slot needs force, and
	// then the slot is created afresh instead of being reported lost.
	_, err = admin.DropSlot(context.Background(), false)
	require.ErrorIs(t, err, pgwal.ErrSlotMissing)
	_, err = admin.EnsureSlot(context.Background())
	require.ErrorIs(t, err, pgwal.ErrSlotLost, "still lost")
	_, err = admin.DropSlot(context.Background(), true)
	require.NoError(t, err)
	created, err := admin.EnsureSlot(context.Background())
	require.NoError(t, err)
	require.True(t, created)
	code, body = probe(unbounded, "/readyz")
	require.NotEqual(t, "slot_lost", body["reason"], "the new slot is not lost: %v", body)
}

// TestAdminSlotCreateDrop: DropSlot refuses a slot holding unpublished
// messages and says what they are, drops it with force, and the slot is
// created afresh afterwards (not reported lost); an active slot is not
// dropped.
func TestAdminSlotCreateDrop(t *testing.T) {
	e := setup(t)
	admin, err := pgwal.NewAdmin(e.db.DB, e.plugin, pgwal.Config{})
	require.NoError(t, err)
	slot := admin.WALConfig().Slot
	_, err = admin.DropSlot(context.Background(), false)
	require.ErrorIs(t, err, pgwal.ErrSlotMissing)
	created, err := admin.EnsureSlot(context.Background())
	require.NoError(t, err)
	require.True(t, created)
	created, err = admin.EnsureSlot(context.Background())
	require.NoError(t, err)
	require.False(t, created, "created once")
	require.True(t, slotExists(e.db.DB, slot))
	t.Cleanup(func() {
		_ = e.db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ?", slot).Error
		_ = e.db.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})

	// Nothing written: dropped without force.
	u, err := admin.DropSlot(context.Background(), false)
	require.NoError(t, err)
	require.Zero(t, u.Messages)
	require.False(t, slotExists(e.db.DB, slot))
	created, err = admin.EnsureSlot(context.Background())
	require.NoError(t, err, "a dropped slot's lease went with it: created afresh, not lost")
	require.True(t, created)

	before := time.Now().Add(-time.Second)
	e.write(t, 2, 0, 3) // 6 messages, 2 keys
	_, err = admin.DropSlot(context.Background(), false)
	var has *pgwal.SlotHasMessagesError
	require.ErrorAs(t, err, &has)
	require.ErrorIs(t, err, pgwal.ErrSlotHasMessages)
	require.Equal(t, int64(6), has.Unconfirmed.Messages)
	require.Equal(t, int64(2), has.Unconfirmed.Keys)
	require.True(t, has.Unconfirmed.Oldest.After(before))
	require.Positive(t, has.RetainedBytes)
	require.Contains(t, err.Error(), "refusing to drop slot "+slot+": it holds 6 unpublished message(s) of 2 key(s)")
	require.True(t, slotExists(e.db.DB, slot), "refused: the slot is still there")

	// Active: not dropped, even with force.
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	e.checkDelivered(t, 2, 3)
	var current string
	require.NoError(t, e.db.Raw("SELECT pg_current_wal_lsn()::text").Scan(&current).Error)
	written, err := pglogrepl.ParseLSN(current)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && st.Active && st.Confirmed >= written
	}, 30*time.Second, 20*time.Millisecond, "everything written confirmed")
	_, err = admin.DropSlot(context.Background(), true)
	require.ErrorIs(t, err, pgwal.ErrSlotActive)
	require.NoError(t, stop())

	// With force: dropped although messages wait.
	e.write(t, 1, 3, 5)
	require.Eventually(t, func() bool {
		st, err := r.SlotStatus(context.Background())
		return err == nil && !st.Active
	}, 30*time.Second, 20*time.Millisecond)
	u, err = admin.DropSlot(context.Background(), true)
	require.NoError(t, err)
	require.Equal(t, int64(2), u.Messages, "what was lost")
	require.False(t, slotExists(e.db.DB, slot))
	var leases int64
	require.NoError(t, e.db.Table(admin.WALConfig().LeaseTable).Where("slot = ?", slot).Count(&leases).Error)
	require.Zero(t, leases, "the lease went with the slot")
}

// TestWALAlertRules: every metric name in deploy/prometheus/wal-alerts.yml
// is in the output of a real reader's collector or of the Admin's
// collector of a process without a reader, and promtool (when installed)
// checks the rules and runs their unit tests.
func TestWALAlertRules(t *testing.T) {
	e := setup(t)
	r := e.reader(t, e.pub, "a")
	stop := run(r)
	defer func() { require.NoError(t, stop()) }()
	e.write(t, 1, 0, 2)
	e.checkDelivered(t, 1, 2)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(r.Collector())
	exported := map[string]bool{}
	require.Eventually(t, func() bool {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			exported[mf.GetName()] = true
		}
		return exported[pgwal.NameReading] && len(mfs) == 7
	}, 30*time.Second, 20*time.Millisecond, "every family gathered: %v", exported)
	// The API process's: what the rules read while no reader runs.
	byAdmin := map[string]bool{}
	areg := prometheus.NewPedanticRegistry()
	areg.MustRegister(e.otherProcessAdmin(t, r).Collector())
	require.Eventually(t, func() bool {
		mfs, err := areg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			byAdmin[mf.GetName()] = true
			exported[mf.GetName()] = true
		}
		return len(mfs) == 4
	}, 30*time.Second, 20*time.Millisecond, "every family of the Admin's collector gathered (the lag once the reader recorded it): %v", byAdmin)
	for _, n := range []string{pgwal.NameRetainedBytes, pgwal.NameSlotLost, pgwal.NameLeaseHeld, pgwal.NameLagAge} {
		require.True(t, byAdmin[n], "the Admin's collector exports %s", n)
	}

	const file = "../deploy/prometheus/wal-alerts.yml"
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				For         string            `yaml:"for"`
				Labels      map[string]string `yaml:"labels"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&rules))
	doc, err := os.ReadFile("../docs/observability.md")
	require.NoError(t, err)
	name := regexp.MustCompile(`\boutbox_[a-z_]+\b`)
	var alerts []string
	for _, g := range rules.Groups {
		for _, rule := range g.Rules {
			alerts = append(alerts, rule.Alert)
			used := name.FindAllString(rule.Expr, -1)
			require.NotEmpty(t, used, rule.Alert)
			for _, n := range used {
				require.True(t, exported[n], "%s uses %s, which the collector does not export", rule.Alert, n)
			}
			_, anchor, ok := strings.Cut(rule.Annotations["runbook"], "#")
			require.True(t, ok, rule.Alert)
			require.Regexp(t, `(?mi)^#+ WAL `+strings.ReplaceAll(strings.TrimPrefix(anchor, "wal-"), "-", `[ -]`)+`$`, string(doc), "%s: runbook heading", rule.Alert)
		}
	}
	require.ElementsMatch(t, []string{"OutboxWALSlotLost", "OutboxWALRetainedTooLarge", "OutboxWALRetainedGrowing", "OutboxWALNoReader"}, alerts)

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("OUTBOX_REQUIRE_PROMTOOL") != "" {
			t.Fatal("promtool required (OUTBOX_REQUIRE_PROMTOOL) but not on PATH; apt-get install prometheus")
		}
		t.Log("promtool not on PATH: rules not checked by Prometheus' parser")
		return
	}
	for _, args := range [][]string{{"check", "rules", "wal-alerts.yml"}, {"test", "rules", "wal-alerts_test.yml"}} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = filepath.Dir(file)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}

// TestRequeueRacesParking: a message of a quarantined key that the reader
// is about to park while a requeue of the key commits is not parked
// behind dead letters that are gone; the requeued messages are published
// after it, and the key flows again. (Parking checks the key's dead
// letters under the same per-key lock the requeue takes; without it the
// message lands in the dead-letter table after the requeue, and the
// requeued copies are parked behind it.)
func TestRequeueRacesParking(t *testing.T) {
	e := setup(t)
	var poison atomic.Bool
	poison.Store(true)
	pub := relay.PublisherFunc(func(ctx context.Context, msgs []relay.Message) (int, error) {
		return e.publishPoisoned(ctx, msgs, poison.Load())
	})
	r := e.reader(t, pub, "r")
	stop := run(r)
	e.write(t, 1, 0, 10)
	dl := e.plugin.Config().Tables.DeadLettersTable()
	count := func(where string, args ...any) int64 {
		var n int64
		require.NoError(t, e.db.Table(dl).Where(where, args...).Count(&n).Error)
		return n
	}
	require.Eventually(t, func() bool { return count("msg_key = ?", []byte("k0")) == 7 }, 30*time.Second, 20*time.Millisecond,
		"k0:3 failed, k0:4..9 parked")
	poison.Store(false)

	// The requeue runs inside a transaction the test commits later.
	tx := e.db.Begin()
	t.Cleanup(func() { tx.Rollback() })
	n, err := pgwal.RequeueKey(context.Background(), tx, e.plugin, []byte("k0"))
	require.NoError(t, err)
	require.Equal(t, 7, n)
	// k0:20 commits meanwhile; the reader finds k0 quarantined and parks
	// it: it waits for the requeue's lock, or (without the lock) writes
	// it to the dead-letter table at once.
	e.write(t, 1, 20, 21)
	require.Eventually(t, func() bool {
		var waiting int64
		require.NoError(t, e.db.Raw("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").Scan(&waiting).Error)
		return waiting > 0 || count("msg_key = ? AND msg_value = ?", []byte("k0"), []byte("k0:20")) > 0
	}, 30*time.Second, 10*time.Millisecond, "the reader tries to park k0:20")
	require.NoError(t, tx.Commit().Error)

	want := []string{"k0:0", "k0:1", "k0:2", "k0:20"}
	for i := 3; i < 10; i++ {
		want = append(want, "k0:"+strconv.Itoa(i))
	}
	var k0 []string
	require.Eventually(t, func() bool {
		k0 = k0[:0]
		seen := map[string]bool{}
		for _, rec := range e.kafka.ReadLog(t, e.topic, 30*time.Second) {
			if v := string(rec.Value); !seen[v] {
				seen[v] = true
				k0 = append(k0, v)
			}
		}
		return len(k0) >= len(want)
	}, 30*time.Second, 50*time.Millisecond, "k0 in Kafka: %v; dead letters of k0: %d", &k0, count("msg_key = ?", []byte("k0")))
	require.Equal(t, want, k0, "k0:20 first, then the requeued messages in order")
	require.Zero(t, count("1 = 1"), "no dead letter left")
	require.NoError(t, stop())
}
