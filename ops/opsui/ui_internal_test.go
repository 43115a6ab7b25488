package opsui

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opsmem"
	"github.com/gorm-outbox/outbox/relay"
)

func TestShowBytes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		in   []byte
		kind string
		text string
	}{
		{"nil", nil, "none", ""},
		{"json object", []byte(`{"id":7,"items":[1,2]}`), "json", "{\n  \"id\": 7,\n  \"items\": [\n    1,\n    2\n  ]\n}"},
		{"json string", []byte(`"x"`), "json", `"x"`},
		{"text", []byte("order 7 <b>shipped</b>\n"), "text", "order 7 <b>shipped</b>\n"},
		{"empty", []byte{}, "text", ""},
		{"whitespace is not json", []byte("  "), "text", "  "},
		{"binary", []byte{0xff, 0x00, 'a'}, "hex", "00000000  ff 00 61                                          |..a|\n"},
		{"control characters", []byte("a\x1bb"), "hex", "00000000  61 1b 62                                          |a.b|\n"},
	} {
		got := showBytes(c.in)
		require.Equal(t, c.kind, got.Kind, c.name)
		require.Equal(t, c.text, got.Text, c.name)
		require.Equal(t, len(c.in), got.Size, c.name)
		require.False(t, got.Truncated, c.name)
	}

	// A long text is cut at a rune boundary.
	long := strings.Repeat("é", uiBytesMax) // two bytes each
	got := showBytes([]byte(long))
	require.Equal(t, "text", got.Kind)
	require.True(t, got.Truncated)
	require.Len(t, got.Text, uiBytesMax)
	require.Equal(t, 2*uiBytesMax, got.Size)
}

func TestUIToken(t *testing.T) {
	t.Parallel()
	u := New(nil, Options{CSRFSecret: []byte("0123456789abcdef0123456789abcdef")})
	other := New(nil, Options{})
	now := time.Unix(time.Now().Unix(), 0) // tokens carry whole seconds
	tok := u.token(now)
	require.NoError(t, u.checkToken(tok, now))
	require.NoError(t, u.checkToken(tok, now.Add(TokenLifetime)))
	require.ErrorContains(t, u.checkToken(tok, now.Add(TokenLifetime+time.Second)), "expired")
	require.ErrorContains(t, u.checkToken(u.token(now.Add(time.Hour)), now), "expired", "issued in the future")
	require.ErrorContains(t, u.checkToken("", now), "no token")
	require.ErrorContains(t, other.checkToken(tok, now), "invalid", "another UI's secret")
	ts, sig, _ := strings.Cut(tok, ".")
	require.ErrorContains(t, u.checkToken(ts+"1."+sig, now), "invalid", "a changed time")
	require.ErrorContains(t, u.checkToken(ts+"."+sig[1:], now), "invalid")
	require.ErrorContains(t, u.checkToken("garbage", now), "invalid")

	// The same secret on two replicas: tokens of one pass on the other.
	replica := New(nil, Options{CSRFSecret: []byte("0123456789abcdef0123456789abcdef")})
	require.NoError(t, replica.checkToken(tok, now))
}

func TestUIRates(t *testing.T) {
	t.Parallel()
	var published float64
	var mu sync.Mutex
	u := New(nil, Options{Published: func() float64 { mu.Lock(); defer mu.Unlock(); return published }})
	t0 := time.Now()
	r, _ := u.sample(ops.Status{SampledAt: t0, Pending: 100})
	require.Zero(t, r.Window, "one reading has no rate")
	require.True(t, r.HasPublished)
	mu.Lock()
	published = 50
	mu.Unlock()
	r, _ = u.sample(ops.Status{SampledAt: t0.Add(10 * time.Second), Pending: 80})
	require.Equal(t, 10*time.Second, r.Window)
	require.InDelta(t, 5.0, r.Published, 1e-9)
	require.InDelta(t, -2.0, r.BacklogChange, 1e-9)
	// Readings older than the window are dropped.
	r, _ = u.sample(ops.Status{SampledAt: t0.Add(ThroughputWindow + 5*time.Second), Pending: 80})
	require.Equal(t, ThroughputWindow-5*time.Second, r.Window, "compared with the reading at 10s; the one at 0s is too old")
	require.InDelta(t, 0, r.BacklogChange, 1e-9)
	require.InDelta(t, 0, r.Published, 1e-9)

	// Concurrent readings (the overview of several operators) are safe.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 50 {
				u.sample(ops.Status{SampledAt: t0.Add(time.Duration(i*50+j) * time.Millisecond), Pending: int64(j)})
			}
		})
	}
	wg.Wait()
}

// The charts keep one point per ChartStep over ChartWindow however
// often the overview is read, and their last point follows the newest
// reading.
func TestUIChartReadings(t *testing.T) {
	t.Parallel()
	u := New(nil, Options{})
	t0 := time.Now()
	var got []uiSample
	for i := range 20_000 { // a reading every 100ms for 33 minutes
		_, got = u.sample(ops.Status{SampledAt: t0.Add(time.Duration(i) * 100 * time.Millisecond), Pending: int64(i)})
		require.LessOrEqual(t, len(got), int(ChartWindow/ChartStep)+1)
		require.Equal(t, int64(i), got[len(got)-1].pending, "the last point is the newest reading")
	}
	require.GreaterOrEqual(t, len(got), int(ChartWindow/ChartStep))
	require.LessOrEqual(t, got[len(got)-1].at.Sub(got[0].at), ChartWindow)
	for i := 1; i < len(got)-1; i++ {
		require.GreaterOrEqual(t, got[i].at.Sub(got[i-1].at), ChartStep)
	}
}

func TestUIChartDrawing(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	at := []time.Time{t0, t0.Add(time.Minute), t0.Add(2 * time.Minute)}
	count := func(v float64) string { return fmt.Sprint(v) }
	c := drawChart(uiChart{ID: "backlog"}, at, []float64{0, 10, 5}, count)
	require.Equal(t, "0.0,58.0 120.0,2.0 240.0,30.0", c.Line, "0 at the bottom, the highest value at the top")
	require.Equal(t, "0.0,58.0 0.0,58.0 120.0,2.0 240.0,30.0 240.0,58.0", c.Area)
	require.Equal(t, 5.0, c.Last)
	require.Equal(t, "5", c.Now)
	require.Equal(t, "0", c.Low)
	require.Equal(t, "10", c.High)
	require.Equal(t, "2m0s", c.Span)

	c = drawChart(uiChart{ID: "rate"}, at, []float64{-4, 0, 4}, count)
	require.Equal(t, "0.0,58.0 120.0,30.0 240.0,2.0", c.Line, "a negative value lowers the bottom")
	require.Equal(t, "-4", c.Low)

	c = drawChart(uiChart{ID: "backlog"}, at[:1], []float64{0}, count)
	require.Equal(t, "236.0,58.0 240.0,58.0", c.Line, "one reading: a short line ending now")
	c = drawChart(uiChart{ID: "backlog"}, nil, nil, count)
	require.Empty(t, c.Line)
	require.Equal(t, "–", c.Now)
}

func TestUIFormatting(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{
		0: "0s", 850 * time.Millisecond: "850ms", 12300 * time.Millisecond: "12.3s",
		5*time.Minute + 12*time.Second: "5m12s", 3*time.Hour + 4*time.Minute: "3h04m", 53 * time.Hour: "2d05h",
	} {
		require.Equal(t, want, fmtAge(d))
	}
	require.Equal(t, "(keyless)", fmtKey(nil))
	require.Equal(t, "", fmtKey([]byte{}))
	require.Equal(t, "order-1", fmtKey([]byte("order-1")))
	require.Equal(t, "0xff00", fmtKey([]byte{0xff, 0}))
	require.Equal(t, `"order-1"`, quoteKey([]byte("order-1")))
	require.Equal(t, "ab…", truncate(2, "abc"))
	require.Equal(t, "record too large: …", truncate(20, "record too large: 1,234,567 bytes"), "cut at a word boundary")
	require.Equal(t, "abc", truncate(3, "abc"))

	for s, ok := range map[string]bool{
		"dead-letters": true, "./": true, "dead-letters?topic=a": true,
		"": false, "/dead-letters": false, "//evil.example/": false, "https://evil.example/": false,
		"javascript:alert(1)": false, "../../etc": false, `\\evil`: false,
	} {
		require.Equal(t, ok, safeBack(s), s)
	}
}

// The overview's readings are shared: within half a RefreshInterval one
// reading serves every request, concurrent ones included; an action of
// the UI ends the reuse, so its result shows at once; and a reading is
// made again once the interval has passed.
func TestUIStatusShared(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := opsmem.New(4)
	u := New(admin, Options{RefreshInterval: time.Hour, AllowMutations: true})
	first, err := u.status(ctx)
	require.NoError(t, err)
	require.Zero(t, first.Pending)

	admin.Insert(relay.Message{MessageID: "m-1", Bucket: 2, Topic: "orders"})
	var wg sync.WaitGroup
	got := make([]ops.Status, 8)
	for i := range got {
		wg.Go(func() {
			var err error
			got[i], err = u.status(ctx)
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	for _, st := range got {
		require.True(t, st.SampledAt.Equal(first.SampledAt), "the first reading, served again")
		require.Zero(t, st.Pending)
	}

	form := url.Values{"bucket": {"2"}, "confirm": {"yes"}, "token": {u.token(time.Now())}}
	req := httptest.NewRequest(http.MethodPost, "/actions/pause", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	rec := httptest.NewRecorder()
	u.ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	after, err := u.status(ctx)
	require.NoError(t, err)
	require.True(t, after.SampledAt.After(first.SampledAt), "read again after the action")
	require.EqualValues(t, 1, after.Pending)
	require.True(t, after.Buckets[2].Lease.Paused)

	// A reading that began before an action and ended after it is not
	// served again: it may not show the action's result.
	u.mu.Lock()
	before := u.actions
	u.mu.Unlock()
	u.forgetStatus()
	u.keepStatus(first, before, time.Now(), time.Now())
	again, err := u.status(ctx)
	require.NoError(t, err)
	require.True(t, again.SampledAt.After(after.SampledAt), "read again, not the reading begun before the action")

	// Half of the shortest RefreshInterval later, a new reading.
	fast := New(admin, Options{RefreshInterval: 250 * time.Millisecond})
	one, err := fast.status(ctx)
	require.NoError(t, err)
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		st, err := fast.status(ctx)
		assert.NoError(c, err)
		assert.True(c, st.SampledAt.After(one.SampledAt))
	}, time.Minute, 10*time.Millisecond)
}
