package ui_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opsui"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// mount is the path the tests mount the UI under: every link in it must
// work below a prefix.
const mount = "/ops/outbox"

var testSecret = []byte("ui-test-secret-0123456789abcdef0123456789")

type bundle struct {
	be    *opstest.Backend
	admin ops.Operator
	srv   *httptest.Server
	root  string // the UI's URL, ending in "/"
}

// setup serves the UI of be's outbox under mount.
func setup(t *testing.T, be *opstest.Backend, opts opsui.Options) *bundle {
	t.Helper()
	b := &bundle{be: be, admin: be.Op}
	b.srv = b.serve(t, opts)
	b.root = b.srv.URL + mount + "/"
	return b
}

// serve starts another server with a UI of the same outbox.
func (b *bundle) serve(t *testing.T, opts opsui.Options) *httptest.Server {
	if opts.CSRFSecret == nil {
		opts.CSRFSecret = testSecret
	}
	if opts.Logger == nil {
		opts.Logger = dbtest.Logger(t)
	}
	mux := http.NewServeMux()
	mux.Handle(mount+"/", http.StripPrefix(mount, opsui.New(b.admin, opts)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

const (
	hour = time.Hour
	min  = time.Minute
)

// seed writes a backlog in buckets 0 to 2, a relay holding leases, a
// silent relay, a paused bucket and five dead letters:
//
//	1001 orders   "order-1"  failed  JSON value, two headers   died 2h ago   bucket 1
//	1002 orders   "order-1"  parked  JSON value                died 2h ago   bucket 1
//	1003 payments keyless    failed  binary value              died 30m ago  bucket 2
//	1004 orders   "order-9"  failed  text value                died 10m ago  bucket 0
//	1005 payments "p-5"      failed  text value                died 100h ago bucket 2
func (b *bundle) seed(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	var msgs []relay.Message
	for i, m := range []struct {
		bucket int
		key    string
		age    time.Duration
	}{{0, "a", 5 * min}, {0, "a", 4 * min}, {0, "b", 3 * min}, {1, "c", hour}, {1, "c", 50 * min}, {2, "d", 20 * time.Second}} {
		msgs = append(msgs, relay.Message{MessageID: fmt.Sprintf("m-%d", i), Bucket: m.bucket, Topic: "orders",
			Key: []byte(m.key), Value: []byte(`{"n":` + strconv.Itoa(i) + `}`), CreatedAt: now.Add(-m.age)})
	}
	b.be.Insert(t, msgs...)
	for bucket := range b.be.Config.BucketCount {
		b.be.SetLease(t, bucket, "relay-a", now.Add(time.Hour))
	}
	b.be.Heartbeat(t, "relay-a", now, now.Add(-hour))
	b.be.Heartbeat(t, "relay-gone", now.Add(-10*min), now.Add(-3*hour))
	require.NoError(t, b.admin.PauseBucket(ctx, 3))

	b.insertDead(t,
		ops.DeadLetter{ID: 1001, Bucket: 1, Topic: "orders", Key: []byte("order-1"), Value: []byte(`{"order":1,"lines":[{"sku":"A-1","qty":2}]}`),
			Headers:  []relay.Header{{Key: "trace-id", Value: []byte("4bf92f3577b34da6")}, {Key: "bin", Value: []byte{0xff, 0x00, 0x41}}},
			Attempts: 10, LastError: tooLargeError(), DeadAt: now.Add(-2 * hour)},
		ops.DeadLetter{ID: 1002, Bucket: 1, Topic: "orders", Key: []byte("order-1"), Value: []byte(`{"order":1,"status":"paid"}`), State: "parked", DeadAt: now.Add(-2 * hour),
			LastError: parkedNote},
		ops.DeadLetter{ID: 1003, Bucket: 2, Topic: "payments", Value: []byte{0xde, 0xad, 0xbe, 0xef, 0x00}, Attempts: 3, DeadAt: now.Add(-30 * min)},
		ops.DeadLetter{ID: 1004, Bucket: 0, Topic: "orders", Key: []byte("order-9"), Value: []byte("not json: order 9 shipped"), Attempts: 1, DeadAt: now.Add(-10 * min)},
		ops.DeadLetter{ID: 1005, Bucket: 2, Topic: "payments", Key: []byte("p-5"), Value: []byte("old"), Attempts: 10, DeadAt: now.Add(-100 * hour)},
	)
}

// tooLargeCause is how the publisher's error for an oversized record
// begins (tooLargeError); the dead-letter list shows it whole.
const tooLargeCause = `record too large: 1,234,567 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic orders, partition 3; message id "d-1001", key "order-1"`

// tooLargeError is the error text the Kafka publisher records for an
// oversized record.
func tooLargeError() string {
	part := int32(3)
	cause := sarama.ConfigurationError("Attempt to produce message larger than configured Producer.MaxMessageBytes: 1234567 > 1000000")
	return (&publisher.Error{MessageID: "d-1001", Topic: "orders", Key: []byte("order-1"), Partition: &part, Size: 1234567, Limit: 1000000,
		Err: relay.Permanent(fmt.Errorf("%w: %w", publisher.ErrTooLarge, cause))}).Error()
}

// parkedNote is what the store records on a message the broker
// acknowledged after an earlier message of its batch failed.
const parkedNote = `may have been delivered: it was sent in a batch whose earlier message "d-1001" failed; the broker acknowledged it or did not answer, and the relay publishes it again`

func (b *bundle) insertDead(t *testing.T, dead ...ops.DeadLetter) {
	t.Helper()
	for i := range dead {
		d := &dead[i]
		d.MessageID = fmt.Sprintf("d-%d", d.ID)
		if d.State == "" {
			d.State = ops.DeadLetterFailed
		}
		d.CreatedAt = d.DeadAt.Add(-min)
	}
	b.be.InsertDead(t, dead...)
}

// deadExists reports whether dead letter id exists.
func (b *bundle) deadExists(t *testing.T, id int64) bool {
	t.Helper()
	_, err := b.admin.DeadLetter(context.Background(), id)
	if errors.Is(err, ops.ErrNotFound) {
		return false
	}
	require.NoError(t, err)
	return true
}

// pendingMessageIDs lists the message ids of the pending messages.
func (b *bundle) pendingMessageIDs(t *testing.T) []string {
	t.Helper()
	var ids []string
	for _, m := range b.be.Pending(t) {
		ids = append(ids, m.MessageID)
	}
	return ids
}

func (b *bundle) paused(t *testing.T, bucket int) bool {
	t.Helper()
	st, err := b.admin.Status(context.Background())
	require.NoError(t, err)
	return st.Buckets[bucket].Lease.Paused
}

// ------------------------------------------------------------ browser helpers

func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	require.NoError(t, chromedp.Do(ctx, steps...))
}

func eval[T any](t *testing.T, ctx context.Context, js string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](js))
	require.NoError(t, err, js)
	return v
}

// waitJS polls a JavaScript condition until it holds, or until ctx ends
// (see tab: the test's deadline). chromedp's own 30 s bound is off: the
// overview serves a reading again for 10 times the time it took, so on a
// busy machine a reading of 3 s keeps the page's numbers for 30 s.
func waitJS(t *testing.T, ctx context.Context, cond string) {
	t.Helper()
	_, err := chromedp.Run(ctx, chromedp.Poll[bool](cond,
		chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(0)))
	if err != nil {
		// What the page showed, for the failure's message.
		look, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		shown, _ := chromedp.Run(look, chromedp.Evaluate[string](
			`(document.getElementById('live-status') || document.body).textContent.trim().slice(0, 500)`))
		require.NoError(t, err, "waiting for %s; the page shows: %s", cond, shown)
	}
}

// open loads a page of the UI and returns its HTTP status.
func open(t *testing.T, ctx context.Context, u string) int64 {
	t.Helper()
	resp, err := chromedp.Run(ctx, chromedp.NavigateResponse(u))
	require.NoError(t, err, u)
	return resp.Status
}

// click clicks an element that submits a form or follows a link, waits
// for the next page and returns its HTTP status.
func click(t *testing.T, ctx context.Context, sel string) int64 {
	t.Helper()
	resp, err := chromedp.RunResponse(ctx, chromedp.Click(chromedp.CSS(sel)))
	require.NoError(t, err, "click %s", sel)
	return resp.Status
}

// text returns the text of the first element sel matches, waiting for one
// to appear. It finds and reads the element in one evaluation: a page that
// refreshes itself (the overview) may replace the element between a
// lookup and a read in two round trips.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	js := `(() => { const e = document.querySelector(` + strconv.Quote(sel) + `); return e ? {Text: e.textContent} : null })()`
	v, err := chromedp.Run(ctx, chromedp.Poll[struct{ Text string }](js,
		chromedp.WithPollingInterval(20*time.Millisecond), chromedp.WithPollingTimeout(0)))
	require.NoError(t, err, sel)
	return strings.TrimSpace(v.Text)
}

// screenshot takes a PNG of the whole page and writes it to
// $OUTBOX_UI_SCREENSHOTS/name when that is set (see docs/ui.md).
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.True(t, len(png) > 8 && string(png[1:4]) == "PNG", "a PNG")
	if dir := os.Getenv("OUTBOX_UI_SCREENSHOTS"); dir != "" {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), png, 0o644))
	}
}

// ------------------------------------------------------------ overview

// shownOverview is what the overview page shows, read from its cells.
type shownOverview struct {
	Pending, OldestMs, Failed, Parked, LiveRelays, Paused string
	Buckets                                               []struct {
		Bucket, Pending, OldestMs, Oldest, Failed, Parked, Owner, Term, Expires, State string
	}
	Relays []struct{ ID, SeenMs, Buckets, Live string }
}

const readOverview = `(() => {
  const txt = (el, s) => el.querySelector(s).textContent.trim();
  const d = document;
  return {
    Pending: txt(d, '#total-pending'), OldestMs: d.querySelector('#total-oldest').dataset.oldestMs,
    Failed: txt(d, '#total-failed'), Parked: txt(d, '#total-parked'), LiveRelays: txt(d, '#live-relays'), Paused: txt(d, '#paused'),
    Buckets: [...d.querySelectorAll('#buckets tbody tr')].map(tr => ({
      Bucket: tr.dataset.bucket, Pending: txt(tr, '.pending'), OldestMs: tr.dataset.oldestMs, Oldest: txt(tr, '.oldest'),
      Failed: txt(tr, '.failed'), Parked: txt(tr, '.parked'), Owner: txt(tr, '.owner'), Term: txt(tr, '.term'),
      Expires: txt(tr, '.expires'), State: txt(tr, '.state')})),
    Relays: [...d.querySelectorAll('#relays tbody tr')].map(tr => ({
      ID: txt(tr, '.id'), SeenMs: tr.querySelector('.seen').dataset.seenMs, Buckets: txt(tr, '.buckets'), Live: txt(tr, '.live')})),
  };
})()`

func ms(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return strconv.FormatInt(t.UnixMilli(), 10)
}

// requireShows checks that the page shows the numbers of st.
func requireShows(t *testing.T, st ops.Status, got shownOverview) {
	t.Helper()
	i64 := func(n int64) string { return strconv.FormatInt(n, 10) }
	require.Equal(t, i64(st.Pending), got.Pending)
	require.Equal(t, ms(st.Oldest), got.OldestMs)
	require.Equal(t, i64(st.DeadLetters.Failed), got.Failed)
	require.Equal(t, i64(st.DeadLetters.Parked), got.Parked)
	require.Equal(t, strconv.Itoa(st.LiveRelays), got.LiveRelays)
	var paused []string
	require.Len(t, got.Buckets, len(st.Buckets))
	for i, b := range st.Buckets {
		g := got.Buckets[i]
		require.Equal(t, strconv.Itoa(b.Bucket), g.Bucket)
		require.Equal(t, i64(b.Pending), g.Pending, "bucket %d", b.Bucket)
		require.Equal(t, ms(b.Oldest), g.OldestMs, "bucket %d", b.Bucket)
		if b.Pending > 0 {
			require.NotEqual(t, "–", g.Oldest, "bucket %d shows its oldest age", b.Bucket)
		}
		require.Equal(t, i64(b.DeadLetters.Failed), g.Failed, "bucket %d", b.Bucket)
		require.Equal(t, i64(b.DeadLetters.Parked), g.Parked, "bucket %d", b.Bucket)
		require.Equal(t, b.Lease.Owner, g.Owner, "bucket %d", b.Bucket)
		require.Equal(t, i64(b.Lease.Term), g.Term, "bucket %d", b.Bucket)
		if b.Lease.Owner != "" {
			require.Equal(t, b.Lease.ExpiresAt.UTC().Format("2006-01-02 15:04:05.000 UTC"), g.Expires, "bucket %d", b.Bucket)
		}
		state := "free"
		switch {
		case b.Lease.Paused:
			state = "paused"
			paused = append(paused, strconv.Itoa(b.Bucket))
		case b.Lease.Held:
			state = "held"
		}
		require.Equal(t, state, g.State, "bucket %d", b.Bucket)
	}
	if len(paused) == 0 {
		paused = []string{"none"}
	}
	require.Equal(t, strings.Join(paused, ", "), got.Paused)
	require.Len(t, got.Relays, len(st.Relays))
	for i, r := range st.Relays {
		g := got.Relays[i]
		require.Equal(t, r.ID, g.ID)
		require.Equal(t, ms(r.LastSeen), g.SeenMs)
		require.Equal(t, strconv.Itoa(r.Buckets), g.Buckets, r.ID)
		live := "silent"
		if r.Live {
			live = "live"
		}
		require.Equal(t, live, g.Live, r.ID)
	}
}

// TestOverviewMatchesAdmin loads the overview and checks every number
// against Admin.Status, then changes the outbox and waits for the page to
// refresh itself to the new numbers.
func TestOverviewMatchesAdmin(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		var published atomic.Int64
		b := setup(t, be, opsui.Options{RefreshInterval: 300 * time.Millisecond,
			Published: func() float64 { return float64(published.Load()) }})
		b.seed(t)
		ctx := tab(t)
		ctx0 := context.Background()

		require.EqualValues(t, http.StatusOK, open(t, ctx, b.root))
		st, err := b.admin.Status(ctx0)
		require.NoError(t, err)
		require.EqualValues(t, 6, st.Pending, "the seed")
		requireShows(t, st, eval[shownOverview](t, ctx, readOverview))
		require.Equal(t, "read-only", text(t, ctx, "#mode"))
		require.Zero(t, eval[int](t, ctx, `document.querySelectorAll('form[method=post]').length`), "a read-only UI offers no action")

		// The outbox changes: the page follows without a reload.
		now := time.Now()
		more := []relay.Message{}
		for i := range 5 {
			more = append(more, relay.Message{MessageID: fmt.Sprintf("n-%d", i), Bucket: 3, Topic: "orders", Key: []byte("z"), CreatedAt: now.Add(-7 * min)})
		}
		b.be.Insert(t, more...)
		b.insertDead(t, ops.DeadLetter{ID: 2001, Bucket: 3, Topic: "orders", Key: []byte("z"), DeadAt: now})
		require.NoError(t, b.admin.ResumeBucket(ctx0, 3))
		published.Add(42)
		st, err = b.admin.Status(ctx0)
		require.NoError(t, err)
		waitJS(t, ctx, `document.getElementById('total-pending').textContent.trim() === "11" &&
			document.getElementById('total-failed').textContent.trim() === "5" &&
			document.getElementById('paused').textContent.trim() === "none"`)
		requireShows(t, st, eval[shownOverview](t, ctx, readOverview))
		// Rates appear once two readings are a second apart.
		waitJS(t, ctx, `/\/s published/.test(document.getElementById('throughput').textContent)`)
		require.Contains(t, text(t, ctx, "#live-status"), "updated")
	})
}

// shownChart is what a chart of the overview shows: its last value (the
// figure's data-last), its caption and its line's points.
type shownChart struct {
	Last, Now string
	Points    [][2]float64
}

func readChart(t *testing.T, ctx context.Context, id string) shownChart {
	t.Helper()
	return eval[shownChart](t, ctx, `(() => {
  const f = document.getElementById('chart-`+id+`');
  const l = f.querySelector('polyline');
  return {Last: f.dataset.last, Now: f.querySelector('.now').textContent.trim(),
    Points: l ? l.getAttribute('points').trim().split(' ').map(p => p.split(',').map(Number)) : []};
})()`)
}

// TestOverviewChartsFollowTheBacklog checks that the overview's charts
// follow the outbox under the open page: a backlog is inserted, the
// backlog and oldest-age charts rise to it, and when it drains they fall
// back, with the rise still drawn.
func TestOverviewChartsFollowTheBacklog(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		var published atomic.Int64
		b := setup(t, be, opsui.Options{AllowMutations: true, RefreshInterval: 300 * time.Millisecond,
			Published: func() float64 { return float64(published.Load()) }})
		b.seed(t)
		ctx := tab(t)
		open(t, ctx, b.root)
		const top = 2.0 // the line's y at the top of the box

		c := readChart(t, ctx, "backlog")
		require.Equal(t, "6", c.Last, "the seed's backlog")
		require.NotEmpty(t, c.Points)
		require.Equal(t, "Pending", text(t, ctx, "#chart-backlog .label"))
		require.Equal(t, "Published", text(t, ctx, "#chart-rate .label"))

		// A backlog of 200, the oldest 3 hours old.
		now := time.Now()
		var more []relay.Message
		for i := range 200 {
			more = append(more, relay.Message{MessageID: fmt.Sprintf("burst-%d", i), Bucket: i % 4, Topic: "burst", CreatedAt: now.Add(-3 * hour)})
		}
		b.be.Insert(t, more...)
		waitJS(t, ctx, `document.getElementById('chart-backlog').dataset.last === "206"`)
		c = readChart(t, ctx, "backlog")
		require.Equal(t, "206", c.Now)
		require.Equal(t, top, c.Points[len(c.Points)-1][1], "the last point is the highest")
		require.Greater(t, c.Points[0][1], top, "the first point is lower")
		waitJS(t, ctx, `+document.getElementById('chart-oldest').dataset.last >= 3*3600*1000`)
		// The last point follows the newest reading until it is
		// UIChartStep past the one before it; wait until the peak is a
		// point of its own.
		waitJS(t, ctx, `document.querySelector('#chart-backlog polyline').getAttribute('points').split(' ').filter(p => p.endsWith(',2.0')).length >= 2`)

		// It drains (as a relay would delete what it published): the
		// charts fall back, and the rise stays drawn.
		b.be.DeletePending(t, "burst")
		published.Add(200)
		waitJS(t, ctx, `document.getElementById('chart-backlog').dataset.last === "6"`)
		c = readChart(t, ctx, "backlog")
		last := c.Points[len(c.Points)-1][1]
		require.Greater(t, last, top, "the last point fell")
		require.True(t, slices.ContainsFunc(c.Points, func(p [2]float64) bool { return p[1] == top }), "the peak is still drawn: %v", c.Points)
		waitJS(t, ctx, `+document.getElementById('chart-oldest').dataset.last < 2*3600*1000`)
		// The publish rate rose with the 200 published.
		waitJS(t, ctx, `document.querySelector('#chart-rate polyline').getAttribute('points').split(' ').some(p => p.endsWith(',2.0'))`)

		// The charts are drawn by the server as inline SVG: nothing is
		// fetched for them.
		require.Zero(t, eval[int](t, ctx, `document.querySelectorAll('#charts img, #charts canvas, #charts script').length`))
		if be.Name == dbtest.SQLite { // one set of screenshots for the docs
			screenshot(t, ctx, "ui-overview.png")
		}
	})
}

// ------------------------------------------------------------ dead letters

func shownIDs(t *testing.T, ctx context.Context) []int64 {
	t.Helper()
	return eval[[]int64](t, ctx, `[...document.querySelectorAll('#dead-letters tbody tr')].map(tr => +tr.dataset.id)`)
}

func ids(items []ops.DeadLetter) []int64 {
	out := []int64{}
	for _, d := range items {
		out = append(out, d.ID)
	}
	return out
}

// TestDeadLetters lists and filters dead letters through the page's form
// and links, pages through them, and opens the detail views, comparing
// with Admin.DeadLetters and Admin.DeadLetter.
func TestDeadLetters(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		b := setup(t, be, opsui.Options{})
		b.seed(t)
		ctx := tab(t)
		list := func(q ops.DeadLetterQuery) []int64 {
			t.Helper()
			p, err := b.admin.DeadLetters(context.Background(), q)
			require.NoError(t, err)
			return ids(p.Items)
		}

		// From the overview's link.
		open(t, ctx, b.root)
		require.EqualValues(t, http.StatusOK, click(t, ctx, `nav a[href="dead-letters"]`))
		require.Equal(t, list(ops.DeadLetterQuery{}), shownIDs(t, ctx))
		require.Equal(t, []int64{1004, 1003, 1002, 1001, 1005}, shownIDs(t, ctx), "newest first")
		require.Equal(t, "4 failed · 1 parked", text(t, ctx, "h1 .small"))

		// The error cell gives the cause whole, never cut, with a link to
		// the whole error; the parked row says a copy may be out already.
		require.Equal(t, tooLargeCause, text(t, ctx, `tr[data-id="1001"] .last-error .cause`))
		require.True(t, strings.HasPrefix(tooLargeError(), tooLargeCause+"; sink error: "))
		require.NotContains(t, text(t, ctx, "#dead-letters"), "…")
		require.Equal(t, "dead-letters/1001#last-error", eval[string](t, ctx, `document.querySelector('tr[data-id="1001"] a.whole').getAttribute('href')`))
		require.True(t, eval[bool](t, ctx, `(() => { const c = document.querySelector('tr[data-id="1001"] .last-error'); return c.scrollWidth <= c.clientWidth })()`),
			"the cell shows its text without overflowing")
		require.Equal(t, []string{"no", "maybe", "no", "no", "no"}, eval[[]string](t, ctx,
			`[...document.querySelectorAll('#dead-letters tbody tr')].sort((a, b) => a.dataset.id - b.dataset.id).map(tr => tr.querySelector('.delivered').textContent.trim())`))
		require.Equal(t, parkedNote, eval[string](t, ctx, `document.querySelector('tr[data-id="1002"] .delivered span').title`))

		// The filter form: topic and state.
		do(t, ctx, chromedp.SetValue(chromedp.CSS(`#filter input[name=topic]`), "orders"),
			chromedp.SetValue(chromedp.CSS(`#filter select[name=state]`), "failed"))
		require.EqualValues(t, http.StatusOK, click(t, ctx, `#filter button[type=submit]`))
		require.Equal(t, list(ops.DeadLetterQuery{Topic: "orders", State: ops.DeadLetterFailed}), shownIDs(t, ctx))
		require.Equal(t, []int64{1004, 1001}, shownIDs(t, ctx))
		require.Equal(t, "orders", eval[string](t, ctx, `document.querySelector('#filter input[name=topic]').value`), "the form keeps the filter")

		// Key, keyless, bucket and time filters.
		for query, q := range map[string]ops.DeadLetterQuery{
			"key=order-1":       {Key: []byte("order-1")},
			"keyless=true":      {Keyless: true},
			"bucket=2":          {Bucket: new(2)},
			"since=1h":          {Since: time.Now().Add(-time.Hour)},
			"until=24h":         {Until: time.Now().Add(-24 * time.Hour)},
			"state=parked":      {State: ops.DeadLetterParked},
			"topic=nope":        {Topic: "nope"},
			"topic=&key=&since": {},
		} {
			require.EqualValues(t, http.StatusOK, open(t, ctx, b.root+"dead-letters?"+query), query)
			want := list(q)
			require.Equal(t, want, shownIDs(t, ctx), query)
			if len(want) == 0 {
				require.Equal(t, "No dead letters match the filter.", text(t, ctx, "#empty"), query)
			}
		}

		// Paging, two at a time, through the next-page links.
		open(t, ctx, b.root+"dead-letters?limit=2")
		q := ops.DeadLetterQuery{Limit: 2}
		for page := 1; ; page++ {
			p, err := b.admin.DeadLetters(context.Background(), q)
			require.NoError(t, err)
			require.Equal(t, ids(p.Items), shownIDs(t, ctx), "page %d", page)
			hasNext := eval[bool](t, ctx, `!!document.getElementById('next-page')`)
			require.Equal(t, p.Next != "", hasNext, "page %d", page)
			require.Equal(t, page > 1, eval[bool](t, ctx, `!!document.getElementById('first-page')`), "page %d", page)
			if !hasNext {
				require.Equal(t, 3, page)
				break
			}
			click(t, ctx, "#next-page")
			q.Cursor = p.Next
		}

		// Detail: JSON value indented, headers as text or hex.
		require.EqualValues(t, http.StatusOK, click(t, ctx, "#first-page"))
		open(t, ctx, b.root+"dead-letters?topic=orders&state=failed")
		require.EqualValues(t, http.StatusOK, click(t, ctx, `#dead-letters tr[data-id="1001"] a`))
		d, err := b.admin.DeadLetter(context.Background(), 1001)
		require.NoError(t, err)
		require.Equal(t, "d-1001", text(t, ctx, "#message-id"))
		require.Equal(t, d.Topic, text(t, ctx, "#topic"))
		require.Equal(t, "order-1", text(t, ctx, "#key"))
		require.Equal(t, d.LastError, text(t, ctx, "#last-error"))
		require.Equal(t, tooLargeCause, text(t, ctx, "#cause"))
		require.Equal(t, "no earlier copy known", text(t, ctx, "#delivered"))
		require.Equal(t, "json", eval[string](t, ctx, `document.querySelector('#value pre').className`))
		require.Equal(t, "{\n  \"order\": 1,\n  \"lines\": [\n    {\n      \"sku\": \"A-1\",\n      \"qty\": 2\n    }\n  ]\n}",
			eval[string](t, ctx, `document.querySelector('#value pre').textContent`))
		headers := eval[[][2]string](t, ctx, `[...document.querySelectorAll('#headers tbody tr')].map(tr => [tr.querySelector('.hkey').textContent, tr.querySelector('.hvalue').textContent.trim()])`)
		require.Equal(t, [][2]string{{"trace-id", "4bf92f3577b34da6"}, {"bin", "00000000  ff 00 41                                          |..A|"}}, headers)
		screenshot(t, ctx, "ui-dead-letter.png")

		open(t, ctx, b.root+"dead-letters/1002")
		require.Equal(t, "maybe: "+parkedNote+". Requeueing it may deliver it twice.", text(t, ctx, "#delivered"))

		// A binary, keyless value as a hex dump; a text value as text.
		open(t, ctx, b.root+"dead-letters/1003")
		require.Equal(t, "(keyless)", text(t, ctx, "#key"))
		require.Equal(t, "hex", eval[string](t, ctx, `document.querySelector('#value pre').className`))
		require.Contains(t, text(t, ctx, "#value"), "de ad be ef 00")
		open(t, ctx, b.root+"dead-letters/1004")
		require.Equal(t, "text", eval[string](t, ctx, `document.querySelector('#value pre').className`))
		require.Equal(t, "not json: order 9 shipped", text(t, ctx, "#value"))
		require.Zero(t, eval[int](t, ctx, `document.querySelectorAll('form[method=post]').length`), "a read-only UI offers no action")
	})
}

// ------------------------------------------------------------ actions

// TestActionsThroughUI runs every action from the pages, through its
// confirmation, and checks the result on the page and in the database.
func TestActionsThroughUI(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		b := setup(t, be, opsui.Options{AllowMutations: true})
		b.seed(t)
		ctx := tab(t)
		shots := be.Name == dbtest.SQLite // one set of screenshots for the docs
		open(t, ctx, b.root)
		require.Equal(t, "changes enabled", text(t, ctx, "#mode"))

		// Requeue one dead letter from its page: its parked follower comes
		// back with it.
		open(t, ctx, b.root+"dead-letters")
		if shots {
			screenshot(t, ctx, "ui-dead-letters.png")
		}
		click(t, ctx, `#dead-letters tr[data-id="1001"] a`)
		require.EqualValues(t, http.StatusOK, click(t, ctx, "#requeue"))
		require.Equal(t, `Requeue dead letter 1001 (topic orders, key "order-1")?`, text(t, ctx, "#question"))
		if shots {
			screenshot(t, ctx, "ui-confirm.png")
		}
		require.True(t, b.deadExists(t, 1001), "nothing happens before the confirmation")
		require.EqualValues(t, http.StatusOK, click(t, ctx, "#confirm"))
		require.Equal(t, "Requeued 2 dead letter(s).", text(t, ctx, "#result"))
		require.False(t, b.deadExists(t, 1001))
		require.False(t, b.deadExists(t, 1002))
		pending := b.pendingMessageIDs(t)
		require.Equal(t, []string{"d-1001", "d-1002"}, pending[len(pending)-2:], "back in the messages table, in order")
		_, err := b.admin.DeadLetter(context.Background(), 1001)
		require.ErrorIs(t, err, ops.ErrNotFound)
		require.EqualValues(t, http.StatusOK, click(t, ctx, "#back"))
		require.Equal(t, []int64{1004, 1003, 1005}, shownIDs(t, ctx))

		// Cancel leaves everything as it was.
		open(t, ctx, b.root+"dead-letters/1004")
		click(t, ctx, "#discard")
		require.Equal(t, `Delete dead letter 1004 (topic orders, key "order-9") for good?`, text(t, ctx, "#question"))
		click(t, ctx, "#cancel")
		require.True(t, b.deadExists(t, 1004))
		// Discard.
		open(t, ctx, b.root+"dead-letters/1004")
		click(t, ctx, "#discard")
		click(t, ctx, "#confirm")
		require.Equal(t, "Discarded dead letter 1004.", text(t, ctx, "#result"))
		require.False(t, b.deadExists(t, 1004))

		// Purge older than 72h: only 1005 died that long ago.
		open(t, ctx, b.root+"dead-letters")
		do(t, ctx, chromedp.SetValue(chromedp.CSS(`input[name=older_than]`), "72h"))
		click(t, ctx, "#purge")
		require.Contains(t, text(t, ctx, "#question"), "Delete the 1 dead letter(s) that died before")
		click(t, ctx, "#confirm")
		require.Contains(t, text(t, ctx, "#result"), "Purged 1 dead letter(s)")
		require.False(t, b.deadExists(t, 1005))
		require.True(t, b.deadExists(t, 1003))

		// Requeue a topic, from the filtered list.
		open(t, ctx, b.root+"dead-letters?topic=payments")
		click(t, ctx, "#requeue-topic")
		require.Equal(t, "Requeue the 1 dead letter(s) of topic payments?", text(t, ctx, "#question"))
		click(t, ctx, "#confirm")
		require.Equal(t, "Requeued 1 dead letter(s).", text(t, ctx, "#result"))
		require.False(t, b.deadExists(t, 1003))
		require.Contains(t, b.pendingMessageIDs(t), "d-1003")

		// Requeue a key, from the filtered list.
		b.insertDead(t, ops.DeadLetter{ID: 3001, Bucket: 0, Topic: "orders", Key: []byte("k 1"), DeadAt: time.Now()},
			ops.DeadLetter{ID: 3002, Bucket: 0, Topic: "orders", Key: []byte("k 1"), State: "parked", DeadAt: time.Now()})
		open(t, ctx, b.root+"dead-letters?key=k+1")
		click(t, ctx, "#requeue-key")
		require.Equal(t, `Requeue the 2 dead letter(s) of key "k 1"?`, text(t, ctx, "#question"))
		click(t, ctx, "#confirm")
		require.Equal(t, "Requeued 2 dead letter(s).", text(t, ctx, "#result"))
		require.False(t, b.deadExists(t, 3001))

		// Pause bucket 0 and resume bucket 3 from the overview.
		require.False(t, b.paused(t, 0))
		open(t, ctx, b.root)
		require.Equal(t, "Pause", text(t, ctx, `#buckets tr[data-bucket="0"] button`))
		click(t, ctx, `#buckets tr[data-bucket="0"] button`)
		require.Equal(t, "Pause bucket 0?", text(t, ctx, "#question"))
		click(t, ctx, "#confirm")
		require.Equal(t, "Paused bucket 0.", text(t, ctx, "#result"))
		require.True(t, b.paused(t, 0))
		click(t, ctx, "#back")
		require.Equal(t, "Resume", text(t, ctx, `#buckets tr[data-bucket="3"] button`))
		click(t, ctx, `#buckets tr[data-bucket="3"] button`)
		click(t, ctx, "#confirm")
		require.Equal(t, "Resumed bucket 3.", text(t, ctx, "#result"))
		require.False(t, b.paused(t, 3))
		click(t, ctx, "#back")
		require.Equal(t, "0", text(t, ctx, "#paused"))

		// Requeue all that is left.
		open(t, ctx, b.root+"dead-letters")
		require.EqualValues(t, http.StatusOK, click(t, ctx, "#requeue-all"))
		require.Equal(t, "Requeue all 0 dead letter(s)?", text(t, ctx, "#question"))
	})
}

// ------------------------------------------------------------ refusals

var tokenRE = regexp.MustCompile(`name="token" value="([^"]+)"`)

// post sends a form as a non-browser client would, with extra headers.
func post(t *testing.T, u string, form url.Values, headers map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// TestForgedPostsRefused sends changes the UI must refuse: to a read-only
// UI (with and without a valid token, from a browser page too), and to a
// UI with changes enabled without a token, with a wrong one, and from
// another origin. The database must not change; a genuine request then
// proves that the refused ones failed for the reason checked.
func TestForgedPostsRefused(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		b := setup(t, be, opsui.Options{}) // read-only
		b.seed(t)
		rw := b.serve(t, opsui.Options{AllowMutations: true})
		rwRoot := rw.URL + mount + "/"
		ctx := tab(t)

		// A token issued by the UI that allows changes, sharing the secret.
		resp, err := http.Get(rwRoot + "dead-letters/1001")
		require.NoError(t, err)
		page, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		m := tokenRE.FindStringSubmatch(string(page))
		require.NotNil(t, m, "the page carries a form token")
		token := m[1]
		requeue := url.Values{"id": {"1001"}, "confirm": {"yes"}, "token": {token}}
		untouched := func() {
			t.Helper()
			require.True(t, b.deadExists(t, 1001), "the dead letter is still there")
			require.NotContains(t, b.pendingMessageIDs(t), "d-1001")
		}

		// Read-only: refused whatever the form holds.
		for name, form := range map[string]url.Values{
			"valid token": requeue,
			"no token":    {"id": {"1001"}, "confirm": {"yes"}},
		} {
			code, body := post(t, b.root+"actions/requeue", form, nil)
			require.Equal(t, http.StatusForbidden, code, name)
			require.Contains(t, body, "changes are disabled", name)
			untouched()
		}
		code, _ := post(t, b.root+"actions/pause", url.Values{"bucket": {"0"}, "confirm": {"yes"}, "token": {token}}, nil)
		require.Equal(t, http.StatusForbidden, code)
		require.False(t, b.paused(t, 0))

		// Changes enabled: no token, a wrong token, another origin.
		for name, c := range map[string]struct {
			form    url.Values
			headers map[string]string
			want    string
		}{
			"no token":               {url.Values{"id": {"1001"}, "confirm": {"yes"}}, nil, "the form has no token"},
			"token of another UI":    {url.Values{"id": {"1001"}, "confirm": {"yes"}, "token": {"1700000000.AAAA"}}, nil, "the form token is invalid"},
			"origin of another":      {requeue, map[string]string{"Origin": "http://evil.example"}, "cross-origin request refused"},
			"cross-site fetch":       {requeue, map[string]string{"Sec-Fetch-Site": "cross-site"}, "cross-origin request refused"},
			"same-site other origin": {requeue, map[string]string{"Sec-Fetch-Site": "same-site"}, "cross-origin request refused"},
		} {
			code, body := post(t, rwRoot+"actions/requeue", c.form, c.headers)
			require.Equal(t, http.StatusForbidden, code, name)
			require.Contains(t, body, c.want, name)
			untouched()
		}

		// In a browser: a page of another origin submits a complete form,
		// valid token included, to both UIs.
		evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html")
			fmt.Fprintf(w, `<!doctype html><form id="f" method="post" action="%s">
<input name="id" value="1001"><input name="confirm" value="yes"><input name="token" value="%s"></form>
<script>document.getElementById('f').submit()</script>`, r.URL.Query().Get("target"), token)
		}))
		t.Cleanup(evil.Close)
		for _, target := range []struct{ url, want string }{
			{rwRoot + "actions/requeue", "cross-origin request refused"},
			{b.root + "actions/requeue", "changes are disabled"},
		} {
			do(t, ctx, chromedp.Navigate(evil.URL+"/?target="+url.QueryEscape(target.url)))
			waitJS(t, ctx, `location.href.includes("/actions/requeue") && !!document.getElementById('error')`)
			require.Contains(t, text(t, ctx, "#error"), target.want)
			require.Equal(t, "403 Forbidden", text(t, ctx, "h1"))
			untouched()
		}

		// The read-only pages offer no action at all.
		for _, p := range []string{"", "dead-letters", "dead-letters/1001"} {
			open(t, ctx, b.root+p)
			require.Zero(t, eval[int](t, ctx, `document.querySelectorAll('form[method=post]').length`), p)
		}

		// The same request with its token, from no browser page: it runs.
		code, body := post(t, rwRoot+"actions/requeue", requeue, nil)
		require.Equal(t, http.StatusOK, code, body)
		require.Contains(t, body, "Requeued 2 dead letter(s).")
		require.False(t, b.deadExists(t, 1001))
	})
}

// ------------------------------------------------------------ escaping

// TestHostilePayloadRendersAsText stores markup in every field a page
// shows and checks that it appears as text and nothing of it runs or
// becomes an element.
func TestHostilePayloadRendersAsText(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		b := setup(t, be, opsui.Options{AllowMutations: true})
		const (
			key    = `<script>window.pwned=1</script>`
			topic  = `<i>t</i>`
			value  = `<img src=x onerror="window.pwned=1"><script>window.pwned=1</script>`
			hkey   = `<b onmouseover="window.pwned=1">h</b>`
			hvalue = `</pre><script>window.pwned=1</script>`
			lerr   = `<svg onload="window.pwned=1"></svg>`
			jsonV  = `{"html":"</pre><script>window.pwned=1</script>"}`
		)
		now := time.Now()
		b.insertDead(t,
			ops.DeadLetter{ID: 1, Bucket: 1, Topic: topic, Key: []byte(key), Value: []byte(value),
				Headers: []relay.Header{{Key: hkey, Value: []byte(hvalue)}}, LastError: lerr, DeadAt: now},
			ops.DeadLetter{ID: 2, Bucket: 1, Topic: topic, Key: []byte(key), Value: []byte(jsonV), State: "parked", DeadAt: now})
		b.be.Insert(t, relay.Message{MessageID: "m", Bucket: 1, Topic: topic, Key: []byte(key), CreatedAt: now})
		for bucket := range 4 {
			b.be.SetLease(t, bucket, key, now.Add(time.Hour))
		}
		b.be.Heartbeat(t, key, now, now)
		ctx := tab(t)

		requireInert := func(page string, literals ...string) {
			t.Helper()
			require.Equal(t, 1, eval[int](t, ctx, `document.querySelectorAll('script').length`), "%s: only the UI's own script", page)
			// The overview's charts are the UI's own SVG, drawn from numbers.
			require.Zero(t, eval[int](t, ctx, `[...document.querySelectorAll('main img, main svg, main b, main i')].filter(e => !e.closest('#charts')).length`),
				"%s: no injected element", page)
			require.True(t, eval[bool](t, ctx, `typeof window.pwned === 'undefined'`), page)
			shown := eval[string](t, ctx, `document.querySelector('main').textContent`)
			for _, l := range literals {
				require.Contains(t, shown, l, "%s shows the markup as text", page)
			}
		}
		open(t, ctx, b.root)
		requireInert("overview", `<script>window.pwned=1</script>`)
		open(t, ctx, b.root+"dead-letters?key="+url.QueryEscape(key))
		require.Equal(t, []int64{2, 1}, shownIDs(t, ctx))
		requireInert("list", key, topic, lerr)
		open(t, ctx, b.root+"dead-letters/1")
		requireInert("detail", key, topic, value, hkey, hvalue, lerr)
		open(t, ctx, b.root+"dead-letters/2")
		requireInert("json detail", `"html": "</pre><script>window.pwned=1</script>"`)
		open(t, ctx, b.root+"dead-letters/1")
		click(t, ctx, "#requeue-key")
		requireInert("confirm", `key "<script>window.pwned=1</script>"`)
		require.Equal(t, key, eval[string](t, ctx, `document.querySelector('#confirm-form input[name=key]').value`), "the key goes through unchanged")
		click(t, ctx, "#confirm")
		require.Equal(t, "Requeued 2 dead letter(s).", text(t, ctx, "#result"))
	})
}

// ------------------------------------------------------------ bad input

// TestBadInput gives unknown ids, malformed filters and malformed actions:
// each gets its status and a message that names the problem, never a 500.
func TestBadInput(t *testing.T) {
	t.Parallel()
	opstest.ForEach(t, 4, func(t *testing.T, be *opstest.Backend) {
		b := setup(t, be, opsui.Options{AllowMutations: true})
		b.seed(t)
		ctx := tab(t)
		for _, c := range []struct {
			path string
			code int64
			want string
		}{
			{"dead-letters/999999", 404, "outbox: not found: dead letter 999999"},
			{"dead-letters/abc", 400, `dead letter id "abc" is not a number`},
			{"dead-letters?since=yesterday", 400, `since: "yesterday" is neither an RFC 3339 time nor a duration such as 72h`},
			{"dead-letters?until=-5h", 400, `until: negative duration "-5h"`},
			{"dead-letters?state=lost", 400, `state "lost" is neither "failed" nor "parked"`},
			{"dead-letters?bucket=x", 400, `bucket: strconv.Atoi: parsing "x": invalid syntax`},
			{"dead-letters?limit=5000", 400, "limit 5000 outside 1..1000"},
			{"dead-letters?cursor=zzz", 400, `malformed cursor "zzz"`},
			{"dead-letters?key=a&keyless=true", 400, "Key and Keyless exclude each other"},
			{"dead-letters?key_base64=!!", 400, "key_base64: illegal base64 data"},
			{"nope", 404, "outbox ui: GET /nope: not found"},
		} {
			require.Equal(t, c.code, open(t, ctx, b.root+c.path), c.path)
			msg := text(t, ctx, "#error")
			require.Contains(t, msg, c.want, c.path)
			require.NotContains(t, eval[string](t, ctx, `document.body.textContent`), "goroutine", c.path)
			if strings.HasPrefix(c.path, "dead-letters?") {
				require.True(t, strings.HasPrefix(msg, "Invalid filter: "), c.path)
				// The form comes back with what was typed.
				param, _ := url.ParseQuery(strings.TrimPrefix(c.path, "dead-letters?"))
				for k := range param {
					if k != "keyless" && k != "state" && k != "cursor" {
						require.Equal(t, param.Get(k), eval[string](t, ctx, `document.querySelector('#filter [name=`+k+`]').value`), c.path)
					}
				}
			}
		}

		// Actions with bad input, posted from a page of the UI (so with a
		// token and the same origin).
		open(t, ctx, b.root+"dead-letters/1001")
		for _, c := range []struct {
			action string
			fields map[string]string
			code   int64
			want   string
		}{
			{"requeue", map[string]string{"id": "999999"}, 404, "dead letter 999999"},
			{"requeue", map[string]string{"id": "x"}, 400, `dead letter id "x" is not a number`},
			{"requeue", map[string]string{"id": "1001", "key": "k"}, 400, "give exactly one of id, key, key_base64, topic, all"},
			{"requeue", map[string]string{}, 400, "give exactly one of"},
			{"requeue", map[string]string{"key_base64": "%%"}, 400, "key_base64: illegal base64 data"},
			{"discard", map[string]string{"id": "999999"}, 404, "dead letter 999999"},
			{"purge", map[string]string{"older_than": "soon"}, 400, `older than: "soon" must be an RFC 3339 time or a duration such as 72h`},
			{"purge", map[string]string{}, 400, "older than"},
			{"pause", map[string]string{"bucket": "99"}, 400, "bucket 99 outside 0..3"},
			{"resume", map[string]string{"bucket": "one"}, 400, `bucket "one" is not a number`},
			{"explode", map[string]string{}, 404, `no action "explode"`},
		} {
			// Build and submit a form in the page, as a tampered page would.
			js := `(() => { const f = document.createElement('form'); f.method = 'post'; f.action = 'actions/` + c.action + `';
				const add = (n, v) => { const i = document.createElement('input'); i.type = 'hidden'; i.name = n; i.value = v; f.appendChild(i); };
				add('token', document.querySelector('input[name=token]').value);`
			for _, k := range slices.Sorted(func(yield func(string) bool) {
				for k := range c.fields {
					if !yield(k) {
						return
					}
				}
			}) {
				js += fmt.Sprintf(`add(%q, %q);`, k, c.fields[k])
			}
			js += `document.body.appendChild(f); f.id = 'tampered'; return true; })()`
			require.True(t, eval[bool](t, ctx, js))
			resp, err := chromedp.RunResponse(ctx, chromedp.Submit(chromedp.ID("tampered")))
			require.NoError(t, err)
			require.Equal(t, c.code, resp.Status, "%s %v", c.action, c.fields)
			require.Contains(t, text(t, ctx, "#error"), c.want, "%s %v", c.action, c.fields)
			open(t, ctx, b.root+"dead-letters/1001")
		}
		require.True(t, b.deadExists(t, 1001))
	})
}
