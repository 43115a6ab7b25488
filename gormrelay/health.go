package gormrelay

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/relay"
)

// HealthTimeoutDefault bounds the query of one readiness request
// (opshttp.HealthTimeoutDefault).
const HealthTimeoutDefault = opshttp.HealthTimeoutDefault

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

// Health answers the probes of a service that runs a relay
// (opshttp.Health, which documents the probes and their bodies), with the
// Admin as its operator API. Database errors are logged on the outbox's
// Logger.
type Health struct {
	// Admin reads the backlog for Readiness. Required by Readiness and
	// Handler.
	Admin *Admin
	// Relay is the relay the process runs, if any: its end is reported at
	// once, without waiting for the backlog to age. Optional.
	Relay *relay.Relay
	// MaxAge is the oldest-pending age above which Readiness fails; it
	// must be positive (Readiness and Handler panic otherwise).
	MaxAge time.Duration
}

// ops is h as opshttp.Health.
func (h Health) ops() opshttp.Health {
	o := opshttp.Health{MaxAge: h.MaxAge}
	if h.Admin != nil {
		o.Operator = h.Admin
		o.Logger = h.Admin.cfg.Logger.With("outbox", h.Admin.cfg.Name)
	}
	if h.Relay != nil {
		o.Relay = h.Relay
	}
	return o
}

// Liveness returns the liveness handler (opshttp.Health.Liveness).
func (h Health) Liveness() http.Handler { return h.ops().Liveness() }

// Readiness returns the readiness handler (opshttp.Health.Readiness). It
// panics if Admin is nil or MaxAge is not positive.
func (h Health) Readiness() http.Handler {
	if h.Admin == nil {
		panic("outbox: Health.Readiness: Admin is required")
	}
	return h.ops().Readiness()
}

// Handler serves Liveness at /livez and Readiness at /readyz and /healthz
// (opshttp.Health.Handler). It panics as Readiness does.
func (h Health) Handler() http.Handler {
	if h.Admin == nil {
		panic("outbox: Health.Readiness: Admin is required")
	}
	return h.ops().Handler()
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
