package gormrelay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox/relay"
)

// HealthTimeoutDefault bounds the query of one HealthHandler request.
const HealthTimeoutDefault = 5 * time.Second

// ErrBacklogTooOld is wrapped by every *BacklogAgeError.
var ErrBacklogTooOld = errors.New("outbox: oldest pending message is older than allowed")

// BacklogAgeError is Admin.Healthy's answer when a message has waited
// longer than the threshold: the relays are down, stuck on a failing
// message, or too slow for the load.
type BacklogAgeError struct {
	// Bucket holds the oldest pending message.
	Bucket int
	// Age is how long that message has waited, MaxAge the threshold.
	Age, MaxAge time.Duration
}

func (e *BacklogAgeError) Error() string {
	return fmt.Sprintf("outbox: oldest pending message (bucket %d) has waited %s, over %s",
		e.Bucket, e.Age.Round(time.Millisecond), e.MaxAge)
}

// Unwrap lets errors.Is(err, ErrBacklogTooOld) match.
func (e *BacklogAgeError) Unwrap() error { return ErrBacklogTooOld }

// OldestPending returns the age of the oldest pending message and its
// bucket; ok is false when nothing is pending. It reads the head of every
// bucket through the (bucket, id) index, one probe per bucket, so its cost
// does not grow with the backlog and it is cheap enough for a health probe.
// (Each probe selects its bucket as a range, like the relay's reads; see
// bucketRange. With "bucket = ? ORDER BY id", the plan PostgreSQL makes
// for any bucket walks the primary key instead, past every row of the
// other buckets and every deleted row.)
// The head of a bucket is the message the relay publishes next: the age of
// a stuck bucket is the age of its head. Ages are measured with this
// host's clock against the writers' clocks; a negative age counts as 0.
func (a *Admin) OldestPending(ctx context.Context) (age time.Duration, bucket int, ok bool, err error) {
	table := a.db.Statement.Quote(a.cfg.Tables.MessagesTable())
	oldest := int64(0)
	for start := 0; start < a.cfg.BucketCount; start += 128 {
		var sb strings.Builder
		var args []any
		for b := start; b < min(start+128, a.cfg.BucketCount); b++ {
			if b > start {
				sb.WriteString(" UNION ALL ")
			}
			fmt.Fprintf(&sb, "SELECT b, c FROM (SELECT bucket AS b, created_at_ms AS c FROM %s WHERE %s ORDER BY bucket, id LIMIT 1) h%d", table, bucketRange, b-start)
			args = append(args, b, b)
		}
		var heads []struct {
			B int
			C int64
		}
		if err := a.db.WithContext(ctx).Raw(sb.String(), args...).Scan(&heads).Error; err != nil {
			return 0, 0, false, fmt.Errorf("outbox: read the oldest pending message of %s: %w", a.cfg.Tables.MessagesTable(), err)
		}
		for _, h := range heads {
			if !ok || h.C < oldest {
				oldest, bucket, ok = h.C, h.B, true
			}
		}
	}
	if !ok {
		return 0, 0, false, nil
	}
	return max(time.Since(time.UnixMilli(oldest)), 0), bucket, true, nil
}

// Healthy reports whether every pending message has waited at most
// maxAge: nil if so (or if nothing is pending), a *BacklogAgeError
// (errors.Is(err, ErrBacklogTooOld)) if not, and the database error if the
// outbox could not be read. maxAge must be positive. It runs
// OldestPending, a few index probes.
//
// Pick maxAge from the delivery objective, well above the relays'
// PollInterval and BackoffMax: a bucket backing off after a transient
// failure is not unhealthy.
func (a *Admin) Healthy(ctx context.Context, maxAge time.Duration) error {
	if maxAge <= 0 {
		return &relay.ConfigError{Package: "gormrelay", Field: "maxAge", Value: maxAge, Reason: "must be positive"}
	}
	age, bucket, ok, err := a.OldestPending(ctx)
	if err != nil {
		return err
	}
	if ok && age > maxAge {
		return &BacklogAgeError{Bucket: bucket, Age: age, MaxAge: maxAge}
	}
	return nil
}

// healthBody is the health handlers' JSON response.
type healthBody struct {
	// Status is "ok"; "unhealthy" (backlog too old), "error" (the outbox
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
}

// Health answers the probes of a service that runs a relay, split the way
// Kubernetes expects:
//
//   - Liveness (mount at /livez): is the process worth keeping? 503 at
//     once when Relay has stopped on an error (Relay.Err, a
//     misconfiguration such as a writer's larger BucketCount), with the
//     error's text; 200 otherwise. It reads no database: a database
//     outage must not restart every relay.
//   - Readiness (mount at /readyz, and /healthz): is the outbox being
//     delivered? 503 when Relay stopped on an error (as Liveness) or
//     stopped at all, when the oldest pending message has waited longer
//     than MaxAge, or when the outbox cannot be read within
//     HealthTimeoutDefault; 200 otherwise.
//
// Bodies are small JSON objects:
//
//	{"status":"ok","oldest_pending_age_seconds":0.42,"max_age_seconds":300,"bucket":3}
//	{"status":"unhealthy","oldest_pending_age_seconds":912.5,"max_age_seconds":300,"bucket":5}
//	{"status":"error","max_age_seconds":300}
//	{"status":"failed","error":"relay: misconfiguration: BucketCount: table outbox_messages holds messages in bucket 63, ..."}
//
// Database errors are logged on the outbox's Logger, not written to the
// response. A relay's error is written: it names tables and settings, not
// payloads. Handler serves all three paths.
type Health struct {
	// Admin reads the backlog for Readiness. Required by Readiness and
	// Handler.
	Admin *Admin
	// Relay is the relay the process runs, if any: its end is reported at
	// once, without waiting for the backlog to age. Optional.
	Relay *relay.Relay
	// MaxAge is the oldest-pending age above which Readiness fails; it
	// must be positive (Readiness and Handler panic otherwise). Pick it
	// from the delivery objective, well above the relays' PollInterval and
	// BackoffMax.
	MaxAge time.Duration
}

// relayEnd reports whether h.Relay has stopped, and its error.
func (h Health) relayEnd() (stopped bool, err error) {
	if h.Relay == nil {
		return false, nil
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
// Admin is nil or MaxAge is not positive.
func (h Health) Readiness() http.Handler {
	if h.Admin == nil {
		panic("outbox: Health.Readiness: Admin is required")
	}
	if h.MaxAge <= 0 {
		panic("outbox: Health.Readiness: MaxAge must be positive")
	}
	a, maxAge := h.Admin, h.MaxAge
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
		age, bucket, ok, err := a.OldestPending(ctx)
		switch {
		case err != nil:
			body.Status, code = "error", http.StatusServiceUnavailable
			a.cfg.Logger.WarnContext(ctx, "outbox: health check could not read the backlog", "outbox", a.cfg.Name, "err", err)
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

// HealthHandler returns Health{Admin: a, MaxAge: maxAge}.Readiness(): 200
// when every pending message of a's outbox has waited at most maxAge, 503
// when one has waited longer or the outbox cannot be read within
// HealthTimeoutDefault. Mount it as a readiness or alerting endpoint of the
// service that runs the relays, not as a liveness probe: restarting a relay
// does not fix a message the sink rejects. Give Health the relay as well to
// report a relay stopped on an error at once, and for a liveness probe. It
// panics if maxAge is not positive.
func HealthHandler(a *Admin, maxAge time.Duration) http.Handler {
	if maxAge <= 0 {
		panic("outbox: HealthHandler: maxAge must be positive")
	}
	return Health{Admin: a, MaxAge: maxAge}.Readiness()
}
