// Package opshttp serves the operator API (ops.Operator) as JSON over
// HTTP, for any store that implements it. It imports no database code.
package opshttp

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox/ops"
)

// Options configures NewHandler.
type Options struct {
	// AllowMutations enables the requests that change the outbox (requeue,
	// purge, discard, pause, resume: every POST and DELETE). Default false:
	// they are refused with 403 Forbidden and only the read-only requests
	// work.
	AllowMutations bool
	// Logger receives a line for every request that failed with a server
	// error. Default: slog.Default().
	Logger *slog.Logger
}

// NewHandler returns an http.Handler serving op's operations
// as JSON, for mounting into a service (use http.StripPrefix to mount it
// under a path):
//
//	GET    /status                    Operator.Status (in WAL mode with the slot, "wal")
//	GET    /wal                       ops.WALOperator.WALStatus; 404 in table mode
//	GET    /dead-letters              Operator.DeadLetters: ?topic= &key= (or key_base64=, or keyless=true)
//	                                  &state=failed|parked &bucket= &since= &until= &limit= &cursor=
//	                                  (times are RFC 3339, or a duration meaning that long ago)
//	GET    /dead-letters/count        Operator.CountDeadLetters
//	GET    /dead-letters/{id}         Operator.DeadLetter, with value and headers
//	POST   /dead-letters/requeue      {"ids":[..]} | {"key":".."} | {"key_base64":".."} | {"all":true,"topic":".."}
//	POST   /dead-letters/purge        {"older_than":"2024-05-01T00:00:00Z"} or {"older_than":"72h"}
//	POST   /dead-letters/discard      {"ids":[..]}
//	DELETE /dead-letters/{id}         Operator.DiscardDeadLetters of one
//	POST   /buckets/{bucket}/pause    Operator.PauseBucket
//	POST   /buckets/{bucket}/resume   Operator.ResumeBucket
//
// Errors are {"error":"..."} with 400 for a malformed or invalid request,
// 404 for an unknown dead letter, 403 for a refused mutation and 500 for
// anything else.
//
// The handler does no authentication or authorization of its own. It
// exposes message keys, payloads and error texts, and with AllowMutations
// it can requeue and delete dead letters and stop buckets: mount it only
// behind the service's own authentication and authorization, never on a
// public listener. Mutations are refused unless AllowMutations is set
// explicitly.
func NewHandler(op ops.Operator, opts Options) http.Handler {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	h := &adminHandler{op: op, opts: opts, mux: http.NewServeMux()}
	h.mux.HandleFunc("GET /status", h.status)
	h.mux.HandleFunc("GET /wal", h.wal)
	h.mux.HandleFunc("GET /dead-letters", h.list)
	h.mux.HandleFunc("GET /dead-letters/count", h.count)
	h.mux.HandleFunc("GET /dead-letters/{id}", h.show)
	h.mux.HandleFunc("POST /dead-letters/requeue", h.requeue)
	h.mux.HandleFunc("POST /dead-letters/purge", h.purge)
	h.mux.HandleFunc("POST /dead-letters/discard", h.discard)
	h.mux.HandleFunc("DELETE /dead-letters/{id}", h.discardOne)
	h.mux.HandleFunc("POST /buckets/{bucket}/pause", h.pause(true))
	h.mux.HandleFunc("POST /buckets/{bucket}/resume", h.pause(false))
	return h
}

type adminHandler struct {
	op   ops.Operator
	opts Options
	mux  *http.ServeMux
}

// adminBodyMax bounds a request body.
const adminBodyMax = 1 << 20

func (h *adminHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions:
	default:
		if !h.opts.AllowMutations {
			writeJSON(w, http.StatusForbidden, map[string]string{
				"error": "outbox admin: mutating requests are disabled; the service must enable them explicitly with opshttp.Options.AllowMutations (gormrelay.AdminHandlerOptions)",
			})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, adminBodyMax)
	}
	if _, pattern := h.mux.Handler(r); pattern == "" {
		// No route: let the mux decide between 404 and 405 (with its Allow
		// header), but answer in JSON like every other reply.
		rec := &statusRecorder{header: w.Header()}
		h.mux.ServeHTTP(rec, r)
		w.Header().Del("X-Content-Type-Options")
		writeJSON(w, rec.code, map[string]string{"error": fmt.Sprintf("outbox admin: %s %s: %s", r.Method, r.URL.Path, strings.ToLower(http.StatusText(rec.code)))})
		return
	}
	h.mux.ServeHTTP(w, r)
}

// statusRecorder keeps the status and headers of a reply and drops its
// body.
type statusRecorder struct {
	header http.Header
	code   int
}

func (s *statusRecorder) Header() http.Header { return s.header }
func (s *statusRecorder) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	s.WriteHeader(http.StatusOK)
	return len(b), nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// badRequest is an input error of the handler itself.
type badRequest struct{ msg string }

func (e badRequest) Error() string { return e.msg }

func badf(format string, args ...any) error { return badRequest{fmt.Sprintf(format, args...)} }

func (h *adminHandler) fail(w http.ResponseWriter, r *http.Request, err error) {
	var br badRequest
	switch {
	case errors.As(err, &br), errors.Is(err, ops.ErrInvalidRequest):
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
	case errors.Is(err, ops.ErrNotFound):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
	default:
		if r.Context().Err() == nil {
			h.opts.Logger.Error("outbox admin: request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		}
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
	}
}

func (h *adminHandler) status(w http.ResponseWriter, r *http.Request) {
	st, err := h.op.Status(r.Context())
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (h *adminHandler) wal(w http.ResponseWriter, r *http.Request) {
	wop, ok := h.op.(ops.WALOperator)
	if !ok {
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "outbox admin: the outbox is not in WAL mode"})
		return
	}
	st, err := wop.WALStatus(r.Context())
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (h *adminHandler) count(w http.ResponseWriter, r *http.Request) {
	c, err := h.op.CountDeadLetters(r.Context())
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, struct {
		ops.DeadLetterCounts
		Total int64 `json:"total"`
	}{c, c.Total()})
}

func (h *adminHandler) list(w http.ResponseWriter, r *http.Request) {
	q, err := parseDeadLetterQuery(r)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	page, err := h.op.DeadLetters(r.Context(), q)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	if page.Items == nil {
		page.Items = []ops.DeadLetter{}
	}
	writeJSON(w, http.StatusOK, page)
}

func parseDeadLetterQuery(r *http.Request) (ops.DeadLetterQuery, error) {
	return ops.ParseDeadLetterQuery(r.URL.Query(), time.Now())
}

func pathID(r *http.Request) (int64, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		return 0, badf("dead letter id %q is not a number", r.PathValue("id"))
	}
	return id, nil
}

func (h *adminHandler) show(w http.ResponseWriter, r *http.Request) {
	id, err := pathID(r)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	d, err := h.op.DeadLetter(r.Context(), id)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, d)
}

func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return badf("request body: %v", err)
	}
	return nil
}

// RequeueRequest is the body of POST /dead-letters/requeue: exactly one of
// IDs, Key, KeyBase64 or All (optionally with Topic).
type RequeueRequest struct {
	IDs       []int64 `json:"ids,omitempty"`
	Key       *string `json:"key,omitempty"`
	KeyBase64 string  `json:"key_base64,omitempty"`
	All       bool    `json:"all,omitempty"`
	Topic     string  `json:"topic,omitempty"`
}

func (h *adminHandler) requeue(w http.ResponseWriter, r *http.Request) {
	var req RequeueRequest
	if err := decodeBody(r, &req); err != nil {
		h.fail(w, r, err)
		return
	}
	key, err := ops.ParseKey(req.Key != nil, deref(req.Key), req.KeyBase64)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	n := 0
	for _, set := range []bool{len(req.IDs) > 0, key != nil, req.All} {
		if set {
			n++
		}
	}
	if n != 1 || (req.Topic != "" && !req.All) {
		h.fail(w, r, badf(`give exactly one of "ids", "key", "key_base64" or "all" (with an optional "topic")`))
		return
	}
	var res ops.RequeueResult
	switch {
	case len(req.IDs) > 0:
		res, err = h.op.RequeueIDs(r.Context(), req.IDs...)
	case key != nil:
		res, err = h.op.RequeueKey(r.Context(), key)
	default:
		res, err = h.op.RequeueAll(r.Context(), req.Topic)
	}
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func (h *adminHandler) purge(w http.ResponseWriter, r *http.Request) {
	var req struct {
		OlderThan string `json:"older_than"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.fail(w, r, err)
		return
	}
	t, err := ops.ParseTime(req.OlderThan, time.Now())
	if err != nil || t.IsZero() {
		h.fail(w, r, badf(`"older_than" must be an RFC 3339 time or a duration such as 72h`))
		return
	}
	n, err := h.op.PurgeDeadLetters(r.Context(), t)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"purged": n, "older_than": t})
}

func (h *adminHandler) discard(w http.ResponseWriter, r *http.Request) {
	var req struct {
		IDs []int64 `json:"ids"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.fail(w, r, err)
		return
	}
	if len(req.IDs) == 0 {
		h.fail(w, r, badf(`"ids" is required`))
		return
	}
	n, err := h.op.DiscardDeadLetters(r.Context(), req.IDs...)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]int64{"discarded": n})
}

func (h *adminHandler) discardOne(w http.ResponseWriter, r *http.Request) {
	id, err := pathID(r)
	if err != nil {
		h.fail(w, r, err)
		return
	}
	n, err := h.op.DiscardDeadLetters(r.Context(), id)
	if err == nil && n == 0 {
		err = fmt.Errorf("%w: dead letter %d", ops.ErrNotFound, id)
	}
	if err != nil {
		h.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]int64{"discarded": n})
}

func (h *adminHandler) pause(paused bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		b, err := strconv.Atoi(strings.TrimSpace(r.PathValue("bucket")))
		if err != nil {
			h.fail(w, r, badf("bucket %q is not a number", r.PathValue("bucket")))
			return
		}
		if paused {
			err = h.op.PauseBucket(r.Context(), b)
		} else {
			err = h.op.ResumeBucket(r.Context(), b)
		}
		if err != nil {
			h.fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"bucket": b, "paused": paused})
	}
}
