package publisher

import (
	"context"

	"github.com/gorm-outbox/outbox/relay"
)

// Func is a publisher for sinks other than Kafka (an HTTP endpoint, an
// in-process bus): it calls the function once per message, in batch order,
// one message at a time, and stops at the first error.
//
// The function must deliver msg before it returns nil; returning nil is the
// acknowledgement. An error it returns stops the batch: Publish reports the
// messages before it as acknowledged and wraps the error in an *Error.
// Wrap errors that retrying cannot fix with relay.Permanent so the relay's
// failure policy can tell them apart.
//
// Publish checks ctx before each message and returns the prefix delivered
// so far with ctx.Err() once it ended; the function should honour ctx too.
//
// relay.PublisherFunc adapts a function that handles whole batches instead.
type Func func(ctx context.Context, msg relay.Message) error

var _ relay.Publisher = Func(nil)

// Publish calls f for each message in order until one fails.
func (f Func) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	for i := range msgs {
		if err := ctx.Err(); err != nil {
			return i, err
		}
		if err := f(ctx, msgs[i]); err != nil {
			return i, newError(i, &msgs[i], err)
		}
	}
	return len(msgs), nil
}
