package opshttp

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/gorm-outbox/outbox/ops"
)

// HealthTimeoutDefault bounds the reading of one readiness request.
const HealthTimeoutDefault = 5 * time.Second

// healthBody is the health handlers' JSON response.
type healthBody struct {
	// Status is "ok"; "unhealthy" (backlog too old, or in WAL mode the
	// slot unhealthy: see Reason), "error" (the outbox
	// could not be read), "failed" (the relay stopped on an error) or
	// "stopped" (the relay stopped cleanly: the process is shutting down).
	Status string `json:"status"`
	// Error is the relay's error when Status is "failed".
	Error string `json:"error,omitempty"`
	// OldestPendingAgeSeconds is absent when nothing is pending or the
	// outbox could not be read.
	OldestPendingAgeSeconds *float64 `json:"oldest_pending_age_seconds,omitempty"`
	MaxAgeSeconds           float64  `json:"max_age_seconds,omitempty"`
	Bucket                  *int     `json:"bucket,omitempty"`
	// Reason is set for an unhealthy slot in WAL mode: "slot_lost",
	// "slot_missing", "retained_wal" or "no_reader" (ops.WALUnhealthyError),
	// with Error saying what was found.
	Reason string `json:"reason,omitempty"`
	// WALSlot and WALRetainedBytes describe the slot in WAL mode.
	WALSlot          string `json:"wal_slot,omitempty"`
	WALRetainedBytes *int64 `json:"wal_retained_bytes,omitempty"`
}

// Health answers the probes of a service that runs a relay, split the way
// Kubernetes expects:
//
//   - Liveness (mount at /livez): is the process worth keeping? 503 at
//     once when Relay has stopped on an error or could not start
//     (Relay.Err: a misconfiguration such as a writer's larger
//     BucketCount or missing tables), with the error's text; 200
//     otherwise. It reads no database: a database
//     outage must not restart every relay.
//   - Readiness (mount at /readyz, and /healthz): is the outbox being
//     delivered? 503 when Relay stopped on an error (as Liveness) or
//     stopped at all, when the oldest pending message has waited longer
//     than MaxAge, or when the outbox cannot be read within
//     HealthTimeoutDefault; 200 otherwise. For an outbox in WAL mode (an
//     Operator that is an ops.WALOperator) also when the replication slot
//     is lost or missing, retains more WAL than MaxRetainedWALBytes, or
//     no reader has held its lease for longer than the lease duration
//     (ops.CheckWAL), with Reason and Error saying which. That is the
//     readiness of a process that only relays. In a service whose API
//     writes to the outbox, mount it on a path of its own and leave it
//     out of the API's readiness: the API keeps taking writes during a
//     sink outage, and failing its readiness on the backlog's age takes
//     every pod out of the load balancer (docs/observability.md, Health
//     check).
//
// Bodies are small JSON objects:
//
//	{"status":"ok","oldest_pending_age_seconds":0.42,"max_age_seconds":300,"bucket":3}
//	{"status":"unhealthy","oldest_pending_age_seconds":912.5,"max_age_seconds":300,"bucket":5}
//	{"status":"error","max_age_seconds":300}
//	{"status":"failed","error":"relay: misconfiguration: BucketCount: table outbox_messages holds messages in bucket 63, ..."}
//	{"status":"unhealthy","reason":"slot_lost","error":"outbox: WAL slot outbox_orders: the slot is lost: ...","wal_slot":"outbox_orders","wal_retained_bytes":0}
//
// Errors reading the outbox are logged on Logger, not written to the
// response. A relay's error is written: it names tables and settings, not
// payloads. Handler serves all three paths.
type Health struct {
	// Operator reads the backlog for Readiness (OldestPending). Required
	// by Readiness and Handler.
	Operator ops.Operator
	// Relay is the relay the process runs, if any (a *relay.Relay, or in
	// WAL mode a *pgwal.Reader): its end is reported at once, without
	// waiting for the backlog to age. Optional.
	Relay Stopper
	// MaxAge is the oldest-pending age above which Readiness fails; it
	// must be positive (Readiness and Handler panic otherwise). Pick it
	// from the delivery objective, well above the relays' PollInterval and
	// BackoffMax.
	MaxAge time.Duration
	// MaxRetainedWALBytes is, in WAL mode, the WAL the slot may retain
	// before Readiness fails (the reader is behind or stopped). Default
	// ops.WALMaxRetainedBytesDefault (1 GiB); negative disables the
	// check. Unused in table mode.
	MaxRetainedWALBytes int64
	// Logger receives a line when the outbox cannot be read. Default:
	// slog.Default().
	Logger *slog.Logger
}

// Stopper is what Health reads of a running relay; *relay.Relay
// implements it.
type Stopper interface {
	// Stopped is closed when the relay has stopped.
	Stopped() <-chan struct{}
	// Err is the error the relay stopped on, or the error its start
	// failed on (Stopped is then not closed); nil while it runs or after
	// a clean stop.
	Err() error
}

// relayEnd reports whether h.Relay has stopped, and its error. A relay
// that could not start has not stopped (it never ran) but reports the
// start's error: it counts as stopped on that error.
func (h Health) relayEnd() (stopped bool, err error) {
	if h.Relay == nil {
		return false, nil
	}
	if err := h.Relay.Err(); err != nil {
		return true, err
	}
	select {
	case <-h.Relay.Stopped():
		return true, h.Relay.Err()
	default:
		return false, nil
	}
}

// Liveness returns the liveness handler; see Health.
func (h Health) Liveness() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, code := healthBody{Status: "ok"}, http.StatusOK
		if _, err := h.relayEnd(); err != nil {
			body, code = healthBody{Status: "failed", Error: err.Error()}, http.StatusServiceUnavailable
		}
		writeHealth(w, r, code, body)
	})
}

// Readiness returns the readiness handler; see Health. It panics if
// Operator is nil or MaxAge is not positive.
func (h Health) Readiness() http.Handler {
	if h.Operator == nil {
		panic("outbox: Health.Readiness: Operator is required")
	}
	if h.MaxAge <= 0 {
		panic("outbox: Health.Readiness: MaxAge must be positive")
	}
	op, maxAge, logger := h.Operator, h.MaxAge, h.Logger
	if logger == nil {
		logger = slog.Default()
	}
	wop, _ := op.(ops.WALOperator)
	// noReaderSince is when a probe first saw the slot's lease free, in
	// Unix nanoseconds; 0 while it is held.
	var noReaderSince atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := healthBody{Status: "ok", MaxAgeSeconds: maxAge.Seconds()}
		code := http.StatusOK
		if stopped, err := h.relayEnd(); stopped {
			body.Status, code = "stopped", http.StatusServiceUnavailable
			if err != nil {
				body.Status, body.Error = "failed", err.Error()
			}
			writeHealth(w, r, code, body)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), HealthTimeoutDefault)
		defer cancel()
		if wop != nil {
			ws, err := wop.WALStatus(ctx)
			if err != nil {
				body.Status, code = "error", http.StatusServiceUnavailable
				logger.WarnContext(ctx, "outbox: health check could not read the WAL slot", "err", err)
				writeHealth(w, r, code, body)
				return
			}
			body.WALSlot, body.WALRetainedBytes = ws.Slot, &ws.RetainedBytes
			now := time.Now()
			if ws.Reader.Held {
				noReaderSince.Store(0)
			} else {
				noReaderSince.CompareAndSwap(0, now.UnixNano())
			}
			wh := ops.WALHealth{MaxRetainedBytes: h.MaxRetainedWALBytes}
			if ns := noReaderSince.Load(); ns != 0 {
				wh.NoReaderSince = time.Unix(0, ns)
			}
			if err := ops.CheckWAL(ws, wh, now); err != nil {
				var we *ops.WALUnhealthyError
				errors.As(err, &we)
				body.Status, body.Reason, body.Error, code = "unhealthy", we.Reason, err.Error(), http.StatusServiceUnavailable
				writeHealth(w, r, code, body)
				return
			}
		}
		age, bucket, ok, err := op.OldestPending(ctx)
		switch {
		case err != nil:
			body.Status, code = "error", http.StatusServiceUnavailable
			logger.WarnContext(ctx, "outbox: health check could not read the backlog", "err", err)
		case ok:
			secs := age.Seconds()
			body.OldestPendingAgeSeconds, body.Bucket = &secs, &bucket
			if age > maxAge {
				body.Status, code = "unhealthy", http.StatusServiceUnavailable
			}
		}
		writeHealth(w, r, code, body)
	})
}

// Handler returns a handler serving Liveness at /livez and Readiness at
// /readyz and /healthz (paths ending there, so it can be mounted under a
// prefix); other paths get 404. It panics as Readiness does.
func (h Health) Handler() http.Handler {
	live, ready := h.Liveness(), h.Readiness()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/livez"):
			live.ServeHTTP(w, r)
		case strings.HasSuffix(r.URL.Path, "/readyz"), strings.HasSuffix(r.URL.Path, "/healthz"):
			ready.ServeHTTP(w, r)
		default:
			http.NotFound(w, r)
		}
	})
}

func writeHealth(w http.ResponseWriter, r *http.Request, code int, body healthBody) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	if r.Method != http.MethodHead {
		_ = json.NewEncoder(w).Encode(body)
	}
}
