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

// healthBody is HealthHandler's JSON response.
type healthBody struct {
	Status string `json:"status"` // "ok", "unhealthy" or "error"
	// OldestPendingAgeSeconds is absent when nothing is pending or the
	// outbox could not be read.
	OldestPendingAgeSeconds *float64 `json:"oldest_pending_age_seconds,omitempty"`
	MaxAgeSeconds           float64  `json:"max_age_seconds"`
	Bucket                  *int     `json:"bucket,omitempty"`
}

// HealthHandler returns an http.Handler that answers 200 when every
// pending message of a's outbox has waited at most maxAge, and 503 when one
// has waited longer or the outbox cannot be read within
// HealthTimeoutDefault, with a small JSON body:
//
//	{"status":"ok","oldest_pending_age_seconds":0.42,"max_age_seconds":300,"bucket":3}
//	{"status":"unhealthy","oldest_pending_age_seconds":912.5,"max_age_seconds":300,"bucket":5}
//	{"status":"error","max_age_seconds":300}
//
// Database errors are logged on the outbox's Logger, not written to the
// response. Mount it as a readiness or alerting endpoint of the service
// that runs the relays, not as a liveness probe: restarting a relay does
// not fix a message the sink rejects. It panics if maxAge is not positive.
func HealthHandler(a *Admin, maxAge time.Duration) http.Handler {
	if maxAge <= 0 {
		panic("outbox: HealthHandler: maxAge must be positive")
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), HealthTimeoutDefault)
		defer cancel()
		body := healthBody{Status: "ok", MaxAgeSeconds: maxAge.Seconds()}
		code := http.StatusOK
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
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(code)
		if r.Method != http.MethodHead {
			_ = json.NewEncoder(w).Encode(body)
		}
	})
}
