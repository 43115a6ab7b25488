package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/gorm-outbox/outbox/wire"
)

// Sentinel errors. Each is returned wrapped; test with errors.Is.
var (
	// ErrLeaseLost is returned by Store.MarkPublished (and the other
	// lease-guarded store operations) when the relay no longer holds the
	// bucket under the term it named: the lease expired, another relay took
	// it over, or the relay released and re-acquired it since. Nothing was
	// changed. The relay drops the bucket and leaves its rows to the current
	// owner.
	ErrLeaseLost = errors.New("relay: lease lost")

	// ErrLeaseRevoked is wrapped, beside ErrLeaseLost, by the error of a
	// lease-guarded store operation that found the lease revoked by an
	// operator: the bucket's lease term was advanced (a requeue, purge or
	// discard of its dead letters) while the row still names this relay,
	// unexpired. Nobody else took the bucket; the relay takes it again
	// under the new term at its next acquisition. The fencing is the same
	// as for any lost lease: nothing was changed under the old term.
	ErrLeaseRevoked = errors.New("relay: lease revoked by an operator")

	// ErrInvalidConfig is wrapped by every *ConfigError. It is
	// wire.ErrInvalidConfig.
	ErrInvalidConfig = wire.ErrInvalidConfig

	// ErrMisconfigured is wrapped by every *MisconfigurationError.
	ErrMisconfigured = errors.New("relay: misconfigured")

	// ErrStopped is returned by Start and DrainOnce on a relay that has
	// already run and stopped. A Relay runs once; create a new one to run
	// again.
	ErrStopped = errors.New("relay: stopped; create a new Relay to run again")

	// ErrPublishTimeout is wrapped by the error of a publish that the
	// relay cancelled after Config.PublishTimeout. It is not about the
	// messages (IsUnavailable reports true for it): the bucket backs off
	// and the batch is retried, its acknowledged prefix deleted.
	ErrPublishTimeout = errors.New("relay: publish timed out")

	// ErrNotOwned is wrapped by the error DrainOnce returns when pending
	// messages remain in buckets it could not lease (see
	// *NotOwnedError).
	ErrNotOwned = errors.New("relay: buckets not owned")

	// ErrBusy is returned by DrainOnce while the relay is started, and by
	// Start while a DrainOnce is in progress: one relay never drains the
	// same leases from two loops.
	ErrBusy = errors.New("relay: busy: Start and DrainOnce cannot run at the same time")
)

// ConfigError reports a configuration field that failed validation. It
// is wire.ConfigError, the one shape of configuration error in the module
// (outbox.ConfigError is the same type): package relay returns it from
// New, and packages outbox, gormrelay, publisher and pgnotify return it
// from their constructors, each setting Package.
type ConfigError = wire.ConfigError

// MisconfigurationError is a problem that retrying cannot fix: messages in
// buckets no relay can own (a writer uses a larger BucketCount), relays
// disagreeing on BucketCount, outbox tables that do not exist (the relay
// started before the tables were migrated). A store returns it; the relay
// stops on it and reports it through Relay.Err instead of retrying, so the
// problem is loud rather than a silent backlog.
type MisconfigurationError struct {
	// Setting names what is wrong: "BucketCount", "Tables", ...
	Setting string
	// Reason says what was found and how to fix it.
	Reason string
	// Err is the underlying error, if any.
	Err error
}

func (e *MisconfigurationError) Error() string {
	s := "relay: misconfiguration: " + e.Setting + ": " + e.Reason
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the underlying error.
func (e *MisconfigurationError) Unwrap() error { return e.Err }

// Is lets errors.Is(err, ErrMisconfigured) match.
func (e *MisconfigurationError) Is(target error) bool { return target == ErrMisconfigured }

// IsMisconfiguration reports whether err, or any error it wraps, is a
// *MisconfigurationError.
func IsMisconfiguration(err error) bool {
	var me *MisconfigurationError
	return errors.As(err, &me)
}

// errPublishTimedOut is the cause of a publish context that
// Config.PublishTimeout ended.
var errPublishTimedOut = errors.New("relay: publish timeout")

// NotOwnedError is returned by DrainOnce, joined with any publish
// failures, when buckets it could not lease (other relays hold them, or
// they are paused) still hold pending messages: the drain was partial.
type NotOwnedError struct {
	// Buckets are the buckets with pending messages the drain did not own,
	// in order.
	Buckets []int
}

func (e *NotOwnedError) Error() string {
	return fmt.Sprintf("relay: drain incomplete: %d bucket(s) with pending messages are leased by other relays or paused: %v", len(e.Buckets), e.Buckets)
}

// Unwrap lets errors.Is(err, ErrNotOwned) match.
func (e *NotOwnedError) Unwrap() error { return ErrNotOwned }

// isStop reports whether err is the relay's own cancellation, not a
// failure worth logging or counting.
func isStop(ctx context.Context, err error) bool {
	return ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ctx.Err()))
}
