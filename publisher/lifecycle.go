package publisher

import (
	"context"
	"fmt"

	"github.com/gorm-outbox/outbox/internal/startstop"
)

// lifecycle gives a Kafka publisher the shape of the module's other
// background services around its Close: Start(ctx) ties it to ctx (its
// end closes the publisher), Stop(ctx) closes it synchronously, bounded
// by ctx, Stopped and Err report the end. Stop before Start and a second
// Stop are harmless.
type lifecycle struct {
	life startstop.Service
}

func (l *lifecycle) start(ctx context.Context, closeFn func() error) error {
	if err := l.life.Start(ctx, func(ctx context.Context) error {
		<-ctx.Done()
		return closeFn()
	}); err != nil {
		return fmt.Errorf("publisher: start: %w", err)
	}
	return nil
}

// stop closes the publisher (Close is idempotent) and waits for it and
// for a started lifecycle to end, or for ctx: the close then finishes in
// the background.
func (l *lifecycle) stop(ctx context.Context, closeFn func() error) error {
	done := make(chan error, 1)
	go func() { done <- closeFn() }()
	select {
	case err := <-done:
		if err != nil {
			return err
		}
	case <-ctx.Done():
		return fmt.Errorf("publisher: stop: %w", ctx.Err())
	}
	if err := l.life.Stop(ctx); err != nil {
		return fmt.Errorf("publisher: stop: %w", err)
	}
	return nil
}
