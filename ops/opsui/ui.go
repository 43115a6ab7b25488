// Package opsui is an operator's web interface to an outbox, over the
// operator API (ops.Operator): it works with any store that implements it
// and imports no database code.
package opsui

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/gorm-outbox/outbox/ops"
)

// UI defaults.
const (
	// RefreshIntervalDefault is how often the overview page refreshes
	// itself.
	RefreshIntervalDefault = 2 * time.Second
	// ThroughputWindow is the span over which the overview computes its
	// rates.
	ThroughputWindow = time.Minute
	// ChartWindow is the span the overview's charts cover: its readings
	// of the last ten minutes, one point per ChartStep.
	ChartWindow = 10 * time.Minute
	// ChartStep is the least time between two points of a chart: the
	// chart's last point follows the newest reading until it is a step
	// after the point before it, and the next reading adds a point. So a
	// chart holds at most ChartWindow/ChartStep + 1 points (301)
	// however often the overview is read, and its last point is always
	// the newest reading.
	ChartStep = 2 * time.Second
	// TokenLifetime is how long a form token of the UI stays valid: a
	// form older than that is refused and must be reloaded.
	TokenLifetime = 12 * time.Hour
)

// Options configures NewUI. The zero value is a read-only UI.
type Options struct {
	// AllowMutations enables the actions that change the outbox: requeue,
	// discard, purge, pause and resume. Default false: the pages show no
	// action, and every POST is refused with 403 Forbidden on the server.
	AllowMutations bool
	// Logger receives a line for every request that failed with a server
	// error. Default: slog.Default().
	Logger *slog.Logger
	// RefreshInterval is how often the overview page reloads its numbers
	// in the browser. Default RefreshIntervalDefault (2s); the minimum
	// is 250ms. The open pages share their readings: one runs at a time,
	// and one is reused for half a RefreshInterval, or for 10 times as long
	// as it took when that is longer (counting a large backlog takes
	// seconds), so the overview never keeps the database busy more than a
	// tenth of the time.
	RefreshInterval time.Duration
	// Published, if set, returns a running total of the messages this
	// service's relays published, such as metrics.Collector.Acknowledged;
	// the overview then shows the publish rate over ThroughputWindow.
	// Without it the overview shows only how fast the backlog grows or
	// drains. Default nil.
	Published func() float64
	// CSRFSecret keys the form tokens. Give every replica of a service the
	// same secret (at least 32 bytes) when requests of one operator may
	// reach different replicas. Default: a random secret per UI, so a
	// restart invalidates open forms.
	CSRFSecret []byte
}

//go:embed ui
var uiFiles embed.FS

var uiTemplates = func() map[string]*template.Template {
	funcs := template.FuncMap{
		"ts":       fmtTime,
		"agems":    fmtAgeMs,
		"age":      fmtAge,
		"rate":     func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
		"key":      fmtKey,
		"keyless":  func(k []byte) bool { return k == nil },
		"unixms":   func(t time.Time) int64 { return t.UnixMilli() },
		"truncate": truncate,
		"cause":    ops.ErrorCause,
		"oneline":  func(s string) string { return strings.Join(strings.Fields(s), " ") },
	}
	base := template.Must(template.New("layout.html").Funcs(funcs).ParseFS(uiFiles, "ui/templates/layout.html"))
	pages := map[string]*template.Template{}
	for _, name := range []string{"overview", "dead_letters", "dead_letter", "confirm", "result", "error"} {
		pages[name] = template.Must(template.Must(base.Clone()).ParseFS(uiFiles, "ui/templates/"+name+".html"))
	}
	return pages
}()

// UI is an operator's web interface to an outbox: an overview of the
// backlog, leases and relays that refreshes itself, the dead letters with
// filters and a detail view, and, when enabled, the repairs of the operator API
// (requeue, discard, purge, pause, resume), each confirmed on a page of
// its own before it runs. It is an http.Handler serving HTML from assets
// embedded in the binary: it loads nothing from elsewhere and works
// offline.
//
// Mount it under any path with http.StripPrefix; every link in it is
// relative:
//
//	mux.Handle("/ops/outbox/", http.StripPrefix("/ops/outbox", opsui.New(op, opsui.Options{})))
//
// Like opshttp.NewHandler it does no authentication or authorization of its
// own: it shows message keys, payloads and error texts, and with
// AllowMutations it can requeue and delete dead letters and stop buckets.
// Mount it only behind the service's own authentication, never on a
// public listener. Changes are refused on the server unless
// AllowMutations is set, and even then only with a form token the UI
// issued (HMAC-signed, valid for TokenLifetime) from a same-origin
// request (Sec-Fetch-Site and Origin, see http.CrossOriginProtection).
type UI struct {
	op      ops.Operator
	opts    Options
	mux     *http.ServeMux
	cross   *http.CrossOriginProtection
	secret  []byte
	refresh time.Duration

	reading chan struct{} // holds a token while a Status reading runs

	mu      sync.Mutex
	samples []uiSample // overview readings within ChartWindow, one per ChartStep, oldest first
	last    ops.Status // the last reading, valid while lastAt is set
	lastAt  time.Time  // when it ended; zero before the first and after an action
	lastFor time.Duration
	actions uint64 // the UI's actions so far: a reading begun before one is not kept
}

var _ http.Handler = (*UI)(nil)

// New returns the web interface of op's outbox.
func New(op ops.Operator, opts Options) *UI {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	u := &UI{op: op, opts: opts, mux: http.NewServeMux(), cross: http.NewCrossOriginProtection(),
		refresh: RefreshIntervalDefault, reading: make(chan struct{}, 1)}
	if opts.RefreshInterval > 0 {
		u.refresh = max(opts.RefreshInterval, 250*time.Millisecond)
	}
	u.secret = opts.CSRFSecret
	if len(u.secret) == 0 {
		u.secret = make([]byte, 32)
		_, _ = rand.Read(u.secret) // never fails (crypto/rand)
	}
	static, _ := fs.Sub(uiFiles, "ui/static")
	files := http.FileServerFS(static)
	u.mux.Handle("GET /static/", http.StripPrefix("/static", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=300")
		files.ServeHTTP(w, r)
	})))
	u.mux.HandleFunc("GET /{$}", u.overview)
	u.mux.HandleFunc("GET /live", u.live)
	u.mux.HandleFunc("GET /dead-letters", u.deadLetters)
	u.mux.HandleFunc("GET /dead-letters/{id}", u.deadLetter)
	u.mux.HandleFunc("POST /actions/{action}", u.action)
	return u
}

// uiFormMax bounds a form body.
const uiFormMax = 64 << 10

// ServeHTTP implements http.Handler.
func (u *UI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; base-uri 'self'; frame-ancestors 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	if r.URL.Path == "" {
		// Mounted with StripPrefix and asked for the prefix itself: the
		// relative links need the trailing slash.
		p := "/"
		if req, err := url.ParseRequestURI(r.RequestURI); err == nil {
			p = req.Path + "/"
		}
		http.Redirect(w, r, p, http.StatusMovedPermanently)
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
	default:
		if !u.opts.AllowMutations {
			u.fail(w, r, &uiError{code: http.StatusForbidden,
				msg: "outbox ui: changes are disabled; the service must enable them explicitly with Options.AllowMutations"})
			return
		}
		if err := u.cross.Check(r); err != nil {
			u.fail(w, r, &uiError{code: http.StatusForbidden, msg: "outbox ui: cross-origin request refused: " + err.Error()})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, uiFormMax)
		if err := r.ParseForm(); err != nil {
			u.fail(w, r, &uiError{code: http.StatusBadRequest, msg: "outbox ui: malformed form: " + err.Error()})
			return
		}
		if err := u.checkToken(r.PostForm.Get("token"), time.Now()); err != nil {
			u.fail(w, r, &uiError{code: http.StatusForbidden, msg: "outbox ui: " + err.Error() + "; reload the page and try again"})
			return
		}
	}
	if _, pattern := u.mux.Handler(r); pattern == "" {
		code := http.StatusNotFound
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			code = http.StatusMethodNotAllowed
		}
		u.fail(w, r, &uiError{code: code, msg: fmt.Sprintf("outbox ui: %s %s: %s", r.Method, r.URL.Path, strings.ToLower(http.StatusText(code)))})
		return
	}
	u.mux.ServeHTTP(w, r)
}

// uiError is an error with the HTTP status it is answered with.
type uiError struct {
	code int
	msg  string
}

func (e *uiError) Error() string { return e.msg }

func badInput(format string, args ...any) error {
	return &uiError{code: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// fail answers err as an error page: 400 for bad input, 404 for an
// unknown dead letter, 403 for a refused change, else 500 (logged).
func (u *UI) fail(w http.ResponseWriter, r *http.Request, err error) {
	code := http.StatusInternalServerError
	var ue *uiError
	switch {
	case errors.As(err, &ue):
		code = ue.code
	case errors.Is(err, ops.ErrInvalidRequest):
		code = http.StatusBadRequest
	case errors.Is(err, ops.ErrNotFound):
		code = http.StatusNotFound
	}
	if code == http.StatusInternalServerError && r.Context().Err() == nil {
		u.opts.Logger.Error("outbox ui: request failed", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	u.render(w, r, code, "error", "", uiErrorPage{Code: code, Status: http.StatusText(code), Message: err.Error()})
}

type uiErrorPage struct {
	Code    int
	Status  string
	Message string
}

// uiPage is what every page template gets.
type uiPage struct {
	// Base is the relative URL of the UI's root from the request's path.
	Base      string
	Nav       string
	Mutations bool
	Token     string
	RefreshMs int64
	Data      any
}

func (u *UI) page(r *http.Request, nav string, data any) uiPage {
	p := uiPage{Base: "./", Nav: nav, Mutations: u.opts.AllowMutations, RefreshMs: u.refresh.Milliseconds(), Data: data}
	if n := strings.Count(r.URL.Path, "/") - 1; n > 0 {
		p.Base = strings.Repeat("../", n)
	}
	if p.Mutations {
		p.Token = u.token(time.Now())
	}
	return p
}

// render executes a page (or one of its named templates) into a buffer
// and writes it: a template error is a clean 500, never half a page.
func (u *UI) render(w http.ResponseWriter, r *http.Request, code int, name, sub string, data any) {
	var p uiPage
	if pd, ok := data.(uiPage); ok {
		p = pd
	} else {
		p = u.page(r, "", data)
	}
	t := uiTemplates[name]
	var buf bytes.Buffer
	var err error
	if sub != "" {
		err = t.ExecuteTemplate(&buf, sub, p)
	} else {
		err = t.Execute(&buf, p)
	}
	if err != nil {
		u.opts.Logger.Error("outbox ui: render failed", "page", name, "err", err)
		http.Error(w, "outbox ui: render failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write(buf.Bytes())
}

// ------------------------------------------------------------ tokens

func (u *UI) mac(ts string) []byte {
	m := hmac.New(sha256.New, u.secret)
	m.Write([]byte("gorm-outbox ui form\x00" + ts))
	return m.Sum(nil)
}

// token returns a form token issued at now: the time and its HMAC.
func (u *UI) token(now time.Time) string {
	ts := strconv.FormatInt(now.Unix(), 10)
	return ts + "." + base64.RawURLEncoding.EncodeToString(u.mac(ts))
}

func (u *UI) checkToken(tok string, now time.Time) error {
	if tok == "" {
		return errors.New("the form has no token")
	}
	ts, sig, ok := strings.Cut(tok, ".")
	mac, err := base64.RawURLEncoding.DecodeString(sig)
	if !ok || err != nil || !hmac.Equal(mac, u.mac(ts)) {
		return errors.New("the form token is invalid")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return errors.New("the form token is invalid")
	}
	if issued := time.Unix(sec, 0); now.Sub(issued) > TokenLifetime || issued.Sub(now) > time.Minute {
		return errors.New("the form token has expired")
	}
	return nil
}

// ------------------------------------------------------------ overview

type uiSample struct {
	at        time.Time
	pending   int64
	oldestMs  int64
	published float64
}

// uiRates are the rates the overview shows.
type uiRates struct {
	// Window is the span compared; zero until two readings exist.
	Window time.Duration
	// Published per second; HasPublished without Options.Published is
	// false.
	Published    float64
	HasPublished bool
	// BacklogChange is the pending count's change per second: negative
	// while draining.
	BacklogChange float64
}

// sample records a reading and returns the rates against the oldest
// reading within ThroughputWindow, and the readings the charts draw.
//
// The readings are the overview's own: taken when a page asks for the
// overview (at most one per reading shared by the open pages), kept for
// ChartWindow at one per ChartStep. Nobody looking means no reading:
// the charts start with the first page opened and show a gap as a
// straight line between the readings around it.
func (u *UI) sample(st ops.Status) (uiRates, []uiSample) {
	s := uiSample{at: st.SampledAt, pending: st.Pending, oldestMs: st.OldestAgeMs}
	if u.opts.Published != nil {
		s.published = u.opts.Published()
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.samples = slices.DeleteFunc(u.samples, func(o uiSample) bool { return s.at.Sub(o.at) >= ChartWindow })
	switch n := len(u.samples); {
	case slices.ContainsFunc(u.samples, func(o uiSample) bool { return o.at.Equal(s.at) }):
		// a reading served again is one sample
	case n >= 2 && u.samples[n-1].at.Sub(u.samples[n-2].at) < ChartStep && s.at.After(u.samples[n-1].at):
		// The last point is less than a step after the one before it: it
		// follows the newest reading until it is a step away.
		u.samples[n-1] = s
	default:
		u.samples = append(u.samples, s)
		slices.SortFunc(u.samples, func(a, b uiSample) int { return a.at.Compare(b.at) })
	}
	last := u.samples[len(u.samples)-1]
	first := last
	for _, o := range u.samples {
		if last.at.Sub(o.at) <= ThroughputWindow {
			first = o
			break
		}
	}
	rates := uiRates{HasPublished: u.opts.Published != nil}
	if d := last.at.Sub(first.at); d >= time.Second {
		rates.Window = d.Round(time.Second)
		rates.BacklogChange = float64(last.pending-first.pending) / d.Seconds()
		rates.Published = max(last.published-first.published, 0) / d.Seconds()
	}
	return rates, slices.Clone(u.samples)
}

type uiOverview struct {
	Status ops.Status
	Rates  uiRates
	Charts []uiChart
	Paused []int
}

// uiReadingCost bounds the share of the time the overview's readings may
// keep the database busy: a reading that took d is served for 10 × d.
const uiReadingCost = 10

// status returns a reading of the outbox's status for the overview. The
// reading counts the whole messages table, which takes seconds on a large
// backlog, and every open page asks for one each RefreshInterval. So one
// reading runs at a time, and a reading is served again to the requests
// that come within half a RefreshInterval of it, or within 10 times the
// time it took if that is longer: however many pages are open, the
// readings keep the database busy a tenth of the time at most. An action
// of the UI ends the reuse, so its result shows at once.
func (u *UI) status(ctx context.Context) (ops.Status, error) {
	select {
	case u.reading <- struct{}{}:
	case <-ctx.Done():
		return ops.Status{}, context.Cause(ctx)
	}
	defer func() { <-u.reading }()
	u.mu.Lock()
	last, at, took, actions := u.last, u.lastAt, u.lastFor, u.actions
	u.mu.Unlock()
	if !at.IsZero() && time.Since(at) < max(u.refresh/2, uiReadingCost*took) {
		return last, nil
	}
	start := time.Now()
	st, err := u.op.Status(ctx)
	if err != nil {
		return ops.Status{}, err
	}
	u.keepStatus(st, actions, start, time.Now())
	return st, nil
}

// keepStatus keeps st, a reading that ran from start to end, to be served
// again, unless an action of the UI happened since the reading began
// (actions was u.actions then): it may not show that action's result.
func (u *UI) keepStatus(st ops.Status, actions uint64, start, end time.Time) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.actions != actions {
		return
	}
	u.last, u.lastAt, u.lastFor = st, end, end.Sub(start)
}

// forgetStatus makes the next overview read the database again, also
// when a reading that began before it ends after it.
func (u *UI) forgetStatus() {
	u.mu.Lock()
	u.actions++
	u.lastAt = time.Time{}
	u.mu.Unlock()
}

func (u *UI) readOverview(ctx context.Context) (uiOverview, error) {
	st, err := u.status(ctx)
	if err != nil {
		return uiOverview{}, err
	}
	rates, samples := u.sample(st)
	o := uiOverview{Status: st, Rates: rates, Charts: u.charts(samples)}
	for _, b := range st.Buckets {
		if b.Lease.Paused {
			o.Paused = append(o.Paused, b.Bucket)
		}
	}
	return o, nil
}

func (u *UI) overview(w http.ResponseWriter, r *http.Request) {
	o, err := u.readOverview(r.Context())
	if err != nil {
		u.fail(w, r, err)
		return
	}
	u.render(w, r, http.StatusOK, "overview", "", u.page(r, "overview", o))
}

// live serves the overview's numbers alone, for the page's refresh.
func (u *UI) live(w http.ResponseWriter, r *http.Request) {
	o, err := u.readOverview(r.Context())
	if err != nil {
		u.fail(w, r, err)
		return
	}
	u.render(w, r, http.StatusOK, "overview", "live", u.page(r, "overview", o))
}

// ------------------------------------------------------------ dead letters

type uiDeadLetters struct {
	Filter  url.Values
	Error   string
	Counts  ops.DeadLetterCounts
	Items   []ops.DeadLetter
	Next    string // URL of the next page; empty on the last
	First   string // URL of the first page; empty on it
	Limited bool   // the filter selects some dead letters only
}

// uiFilterFields are the query parameters of the dead-letter list.
var uiFilterFields = []string{"topic", "key", "key_base64", "keyless", "state", "bucket", "since", "until", "limit"}

func (u *UI) deadLetters(w http.ResponseWriter, r *http.Request) {
	// A form sends its empty fields: they mean "any", not the empty key.
	v := url.Values{}
	for name, vals := range r.URL.Query() {
		if len(vals) > 0 && strings.TrimSpace(vals[0]) != "" {
			v.Set(name, strings.TrimSpace(vals[0]))
		}
	}
	data := uiDeadLetters{Filter: v}
	counts, err := u.op.CountDeadLetters(r.Context())
	if err != nil {
		u.fail(w, r, err)
		return
	}
	data.Counts = counts
	code := http.StatusOK
	q, err := ops.ParseDeadLetterQuery(v, time.Now())
	if err != nil {
		// Every parse error is a malformed parameter.
		err = badInput("%v", err)
	} else {
		var page ops.DeadLetterPage
		page, err = u.op.DeadLetters(r.Context(), q)
		data.Items = page.Items
		if page.Next != "" {
			next := cloneValues(v)
			next.Set("cursor", page.Next)
			data.Next = "dead-letters?" + next.Encode()
		}
	}
	if err != nil {
		var ue *uiError
		if !errors.As(err, &ue) && !errors.Is(err, ops.ErrInvalidRequest) {
			u.fail(w, r, err)
			return
		}
		// A malformed filter: the form again, with the message.
		code, data.Error, data.Items = http.StatusBadRequest, "Invalid filter: "+err.Error(), nil
	}
	if v.Has("cursor") {
		first := cloneValues(v)
		first.Del("cursor")
		data.First = "dead-letters?" + first.Encode()
	}
	for _, f := range uiFilterFields {
		if f != "limit" && v.Has(f) {
			data.Limited = true
		}
	}
	u.render(w, r, code, "dead_letters", "", u.page(r, "dead-letters", data))
}

func cloneValues(v url.Values) url.Values {
	c := url.Values{}
	for k, vs := range v {
		c[k] = slices.Clone(vs)
	}
	return c
}

type uiDeadLetter struct {
	D       ops.DeadLetter
	Key     uiBytes
	Value   uiBytes
	Headers []uiHeader
	// KeyField and KeyValue name the requeue form's key parameter.
	KeyField, KeyValue string
}

type uiHeader struct {
	Key   string
	Value uiBytes
}

func parseID(s string) (int64, error) {
	id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, badInput("dead letter id %q is not a number", s)
	}
	return id, nil
}

func (u *UI) deadLetter(w http.ResponseWriter, r *http.Request) {
	id, err := parseID(r.PathValue("id"))
	if err != nil {
		u.fail(w, r, err)
		return
	}
	d, err := u.op.DeadLetter(r.Context(), id)
	if err != nil {
		u.fail(w, r, err)
		return
	}
	data := uiDeadLetter{D: d, Key: showBytes(d.Key), Value: showBytes(d.Value)}
	for _, h := range d.Headers {
		data.Headers = append(data.Headers, uiHeader{Key: h.Key, Value: showBytes(h.Value)})
	}
	if d.Key != nil {
		data.KeyField, data.KeyValue = keyField(d.Key)
	}
	u.render(w, r, http.StatusOK, "dead_letter", "", u.page(r, "dead-letters", data))
}

// keyField returns the form parameter carrying key: "key" for text,
// "key_base64" otherwise.
func keyField(key []byte) (name, value string) {
	if utf8.Valid(key) {
		return "key", string(key)
	}
	return "key_base64", base64.StdEncoding.EncodeToString(key)
}

// uiBytesMax bounds the bytes a page shows of one value.
const uiBytesMax = 256 << 10

// uiBytes is a key, value or header value as the page shows it.
type uiBytes struct {
	// Kind is "none" (nil), "json" (Text is indented JSON), "text" or
	// "hex" (Text is a hex dump).
	Kind      string
	Text      string
	Size      int
	Truncated bool
}

func showBytes(b []byte) uiBytes {
	out := uiBytes{Size: len(b)}
	switch {
	case b == nil:
		out.Kind = "none"
		return out
	case len(b) <= uiBytesMax && json.Valid(b) && len(bytes.TrimSpace(b)) > 0:
		var buf bytes.Buffer
		if json.Indent(&buf, b, "", "  ") == nil {
			out.Kind, out.Text = "json", buf.String()
			return out
		}
	}
	if len(b) > uiBytesMax {
		b, out.Truncated = b[:uiBytesMax], true
		// Do not split the last rune of a text.
		for i := 0; i < utf8.UTFMax-1 && !utf8.Valid(b); i++ {
			b = b[:len(b)-1]
		}
	}
	if printable(b) {
		out.Kind, out.Text = "text", string(b)
	} else {
		out.Kind, out.Text = "hex", hex.Dump(b)
	}
	return out
}

// printable reports valid UTF-8 without control characters other than
// tab, newline and carriage return.
func printable(b []byte) bool {
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r == utf8.RuneError && n <= 1 {
			return false
		}
		if unicode.IsControl(r) && r != '\t' && r != '\n' && r != '\r' {
			return false
		}
		b = b[n:]
	}
	return true
}

// ------------------------------------------------------------ actions

// uiConfirm is the page asking to confirm an action.
type uiConfirm struct {
	Action   string
	Question string
	Notes    []string
	Fields   [][2]string // hidden fields carried to the confirmed POST
	Back     string
}

type uiResult struct {
	Title   string
	Message string
	Notes   []string
	Back    string
}

// uiAction is a parsed action: what to ask, and what to run.
type uiAction struct {
	confirm uiConfirm
	run     func(ctx context.Context) (uiResult, error)
}

// action parses a POST /actions/{action}. Without confirm=yes it shows
// the confirmation page; with it, runs the action and shows the result.
func (u *UI) action(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("action")
	var (
		a   uiAction
		err error
	)
	f := r.PostForm
	switch name {
	case "requeue":
		a, err = u.requeueAction(r.Context(), f)
	case "discard":
		a, err = u.discardAction(r.Context(), f)
	case "purge":
		a, err = u.purgeAction(r.Context(), f)
	case "pause", "resume":
		a, err = u.pauseAction(name == "pause", f)
	default:
		err = &uiError{code: http.StatusNotFound, msg: fmt.Sprintf("outbox ui: no action %q", name)}
	}
	if err != nil {
		u.fail(w, r, err)
		return
	}
	back := f.Get("back")
	if !safeBack(back) {
		back = "./"
	}
	if f.Get("confirm") != "yes" {
		a.confirm.Action = "actions/" + name
		a.confirm.Back = back
		for _, k := range slices.Sorted(func(yield func(string) bool) {
			for k := range f {
				if k != "token" && k != "confirm" && k != "back" && !yield(k) {
					return
				}
			}
		}) {
			a.confirm.Fields = append(a.confirm.Fields, [2]string{k, f.Get(k)})
		}
		a.confirm.Fields = append(a.confirm.Fields, [2]string{"back", back})
		u.render(w, r, http.StatusOK, "confirm", "", u.page(r, "", a.confirm))
		return
	}
	res, err := a.run(r.Context())
	u.forgetStatus()
	if err != nil {
		u.fail(w, r, err)
		return
	}
	res.Back = back
	u.render(w, r, http.StatusOK, "result", "", u.page(r, "", res))
}

// safeBack accepts a relative link within the UI only.
func safeBack(s string) bool {
	if s == "" || strings.ContainsAny(s, "\\\x00") {
		return false
	}
	p, err := url.Parse(s)
	return err == nil && p.Scheme == "" && p.Host == "" && !strings.HasPrefix(s, "/") && !strings.Contains(p.Path, "..")
}

// onlyOne returns the single set field among names.
func onlyOne(f url.Values, names ...string) (string, error) {
	var set []string
	for _, n := range names {
		if strings.TrimSpace(f.Get(n)) != "" {
			set = append(set, n)
		}
	}
	if len(set) != 1 {
		return "", badInput("give exactly one of %s", strings.Join(names, ", "))
	}
	return set[0], nil
}

// countUpTo counts the dead letters q selects, up to one page.
func (u *UI) countUpTo(ctx context.Context, q ops.DeadLetterQuery) (string, error) {
	q.Limit = ops.DeadLetterPageMax
	page, err := u.op.DeadLetters(ctx, q)
	if err != nil {
		return "", err
	}
	if page.Next != "" {
		return fmt.Sprintf("more than %d", len(page.Items)), nil
	}
	return strconv.Itoa(len(page.Items)), nil
}

func requeued(res ops.RequeueResult) uiResult {
	out := uiResult{Title: "Requeued", Message: fmt.Sprintf("Requeued %d dead letter(s).", res.Requeued)}
	if res.Moved > 0 {
		out.Notes = append(out.Notes, fmt.Sprintf("%d pending message(s) of the same key moved behind them to keep the key's order.", res.Moved))
	}
	if len(res.Buckets) > 0 {
		out.Notes = append(out.Notes, fmt.Sprintf("Buckets: %v.", res.Buckets))
	}
	return out
}

func (u *UI) requeueAction(ctx context.Context, f url.Values) (uiAction, error) {
	which, err := onlyOne(f, "id", "key", "key_base64", "topic", "all")
	if err != nil {
		return uiAction{}, err
	}
	switch which {
	case "id":
		id, d, what, err := u.namedDeadLetter(ctx, f)
		if err != nil {
			return uiAction{}, err
		}
		c := uiConfirm{Question: fmt.Sprintf("Requeue %s?", what)}
		if d.Key != nil {
			c.Notes = append(c.Notes, fmt.Sprintf("A keyed dead letter is requeued with every dead letter of its key in bucket %d, so the key keeps its order.", d.Bucket))
		}
		return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
			res, err := u.op.RequeueIDs(ctx, id)
			if err != nil {
				return uiResult{}, err
			}
			if len(res.NotFound) > 0 {
				return uiResult{}, goneMeanwhile(id)
			}
			return requeued(res), nil
		}}, nil
	case "key", "key_base64":
		key := []byte(f.Get("key"))
		if which == "key_base64" {
			if key, err = base64.StdEncoding.DecodeString(f.Get("key_base64")); err != nil {
				return uiAction{}, badInput("key_base64: %v", err)
			}
		}
		n, err := u.countUpTo(ctx, ops.DeadLetterQuery{Key: key})
		if err != nil {
			return uiAction{}, err
		}
		c := uiConfirm{Question: fmt.Sprintf("Requeue the %s dead letter(s) of key %s?", n, quoteKey(key)),
			Notes: []string{"The key's pending messages move behind them, so its order holds."}}
		return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
			res, err := u.op.RequeueKey(ctx, key)
			return requeued(res), err
		}}, nil
	default:
		topic := ""
		if which == "topic" {
			topic = strings.TrimSpace(f.Get("topic"))
		} else if f.Get("all") != "true" {
			return uiAction{}, badInput(`all must be "true"`)
		}
		n, err := u.countUpTo(ctx, ops.DeadLetterQuery{Topic: topic})
		if err != nil {
			return uiAction{}, err
		}
		c := uiConfirm{Question: fmt.Sprintf("Requeue all %s dead letter(s)?", n)}
		if topic != "" {
			c.Question = fmt.Sprintf("Requeue the %s dead letter(s) of topic %s?", n, topic)
			c.Notes = []string{"Keys move as a whole: a key with a dead letter of this topic is requeued with all its dead letters in the bucket, whatever their topic."}
		}
		return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
			res, err := u.op.RequeueAll(ctx, topic)
			return requeued(res), err
		}}, nil
	}
}

// namedDeadLetter reads the dead letter a form's id names, and describes
// it for a question.
func (u *UI) namedDeadLetter(ctx context.Context, f url.Values) (int64, ops.DeadLetter, string, error) {
	id, err := parseID(f.Get("id"))
	if err != nil {
		return 0, ops.DeadLetter{}, "", err
	}
	d, err := u.op.DeadLetter(ctx, id)
	if err != nil {
		return 0, ops.DeadLetter{}, "", err
	}
	return id, d, fmt.Sprintf("dead letter %d (topic %s, key %s)", id, d.Topic, quoteKey(d.Key)), nil
}

// goneMeanwhile is the error of a confirmed action whose dead letter was
// requeued or discarded since the confirmation was asked.
func goneMeanwhile(id int64) error {
	return fmt.Errorf("%w: dead letter %d (requeued or discarded meanwhile)", ops.ErrNotFound, id)
}

func (u *UI) discardAction(ctx context.Context, f url.Values) (uiAction, error) {
	id, d, what, err := u.namedDeadLetter(ctx, f)
	if err != nil {
		return uiAction{}, err
	}
	c := uiConfirm{Question: fmt.Sprintf("Delete %s for good?", what)}
	if d.Key != nil && d.State == ops.DeadLetterFailed {
		c.Notes = []string{"Messages parked behind it stay quarantined until the key is requeued."}
	}
	return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
		n, err := u.op.DiscardDeadLetters(ctx, id)
		if err == nil && n == 0 {
			err = goneMeanwhile(id)
		}
		return uiResult{Title: "Discarded", Message: fmt.Sprintf("Discarded dead letter %d.", id)}, err
	}}, nil
}

func (u *UI) purgeAction(ctx context.Context, f url.Values) (uiAction, error) {
	s := strings.TrimSpace(f.Get("older_than"))
	t, err := ops.ParseTime(s, time.Now())
	if err != nil || t.IsZero() {
		return uiAction{}, badInput("older than: %q must be an RFC 3339 time or a duration such as 72h", s)
	}
	n, err := u.countUpTo(ctx, ops.DeadLetterQuery{Until: t})
	if err != nil {
		return uiAction{}, err
	}
	c := uiConfirm{Question: fmt.Sprintf("Delete the %s dead letter(s) that died before %s for good?", n, fmtTime(t)),
		Notes: []string{"Pending messages are never touched. A key whose dead letters are all purged is released: its next messages are published."}}
	return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
		n, err := u.op.PurgeDeadLetters(ctx, t)
		return uiResult{Title: "Purged", Message: fmt.Sprintf("Purged %d dead letter(s) that died before %s.", n, fmtTime(t))}, err
	}}, nil
}

func (u *UI) pauseAction(pause bool, f url.Values) (uiAction, error) {
	s := strings.TrimSpace(f.Get("bucket"))
	b, err := strconv.Atoi(s)
	if err != nil {
		return uiAction{}, badInput("bucket %q is not a number", s)
	}
	if n := u.op.BucketCount(); b < 0 || b >= n {
		return uiAction{}, badInput("bucket %d outside 0..%d", b, n-1)
	}
	c := uiConfirm{Question: fmt.Sprintf("Resume bucket %d?", b), Notes: []string{"A relay with spare share claims it at its next lease maintenance."}}
	if pause {
		c = uiConfirm{Question: fmt.Sprintf("Pause bucket %d?", b),
			Notes: []string{"No relay claims it until it is resumed; its messages stay pending, in order, and new ones queue behind them."}}
	}
	return uiAction{confirm: c, run: func(ctx context.Context) (uiResult, error) {
		if pause {
			return uiResult{Title: "Paused", Message: fmt.Sprintf("Paused bucket %d.", b)}, u.op.PauseBucket(ctx, b)
		}
		return uiResult{Title: "Resumed", Message: fmt.Sprintf("Resumed bucket %d.", b)}, u.op.ResumeBucket(ctx, b)
	}}, nil
}

// ------------------------------------------------------------ formatting

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "–"
	}
	return t.UTC().Format("2006-01-02 15:04:05.000 UTC")
}

func fmtAgeMs(ms int64) string { return fmtAge(time.Duration(ms) * time.Millisecond) }

// fmtAge writes a duration with two units at most: 850ms, 12.3s, 5m12s,
// 3h04m, 2d05h.
func fmtAge(d time.Duration) string {
	switch {
	case d <= 0:
		return "0s"
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%.1fs", d.Seconds())
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// fmtKey writes a key for a table cell: its text, or hex for a binary
// key.
func fmtKey(k []byte) string {
	switch {
	case k == nil:
		return "(keyless)"
	case printable(k):
		return string(k)
	}
	return "0x" + hex.EncodeToString(k)
}

// quoteKey writes a key in a sentence.
func quoteKey(k []byte) string {
	if k != nil && printable(k) {
		return strconv.Quote(string(k))
	}
	return fmtKey(k)
}

// truncate shortens s to about n characters for a table cell, at a word
// boundary when there is one in the last third, and marks the cut with
// "…"; the detail view shows the whole text.
func truncate(n int, s string) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)[:n]
	for i := n - 1; i > n*2/3; i-- {
		if r[i] == ' ' {
			return string(r[:i]) + " …"
		}
	}
	return string(r) + "…"
}
