package publisher_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Both Kafka publishers have the lifecycle of the module's services: Stop
// before Start and a second Stop are harmless, Stop is synchronous (Publish
// fails with ErrClosed after it), Stopped closes for a started publisher,
// and the end of the Start context stops it too.
func TestPublisherLifecycle(t *testing.T) {
	t.Parallel()
	c := kafkatest.Start(t)
	type service interface {
		relay.Publisher
		Start(context.Context) error
		Stop(context.Context) error
		Stopped() <-chan struct{}
		Err() error
	}
	for name, open := range map[string]func(t *testing.T) service{
		"kafka":         func(t *testing.T) service { return newKafka(t, c) },
		"transactional": func(t *testing.T) service { return newTransactional(t, c) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := testCtx(t)
			msg := []relay.Message{{Topic: c.Topic(t, 1), Key: []byte("k"), Value: []byte("v"), MessageID: "m1", Bucket: 0}}

			never := open(t)
			require.NoError(t, never.Stop(ctx), "Stop before Start")
			_, err := never.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)

			p := open(t)
			require.NoError(t, p.Start(ctx))
			require.NoError(t, p.Start(ctx), "Start on a running publisher")
			acked, err := p.Publish(ctx, msg)
			require.NoError(t, err)
			require.Equal(t, 1, acked)
			require.NoError(t, p.Stop(ctx))
			<-p.Stopped()
			require.NoError(t, p.Err())
			require.NoError(t, p.Stop(ctx), "second Stop")
			_, err = p.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)
			require.Error(t, p.Start(ctx), "a publisher runs once")

			q := open(t)
			startCtx, cancel := context.WithCancel(ctx)
			require.NoError(t, q.Start(startCtx))
			cancel()
			<-q.Stopped()
			_, err = q.Publish(ctx, msg)
			require.ErrorIs(t, err, publisher.ErrClosed)
		})
	}
}
