package publishertest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/publisher"
)

// StartKafka builds a Kafka publisher from cfg and starts it, failing t if
// either fails. The publisher closes when the test ends: Start runs with
// t.Context(), and a cleanup calls Close and requires it to succeed.
func StartKafka(t testing.TB, cfg publisher.KafkaConfig) *publisher.Kafka {
	t.Helper()
	k, err := publisher.NewKafka(cfg)
	return started(t, k, err)
}

// StartTransactional builds a strict-mode publisher from cfg and starts
// it, as StartKafka does.
func StartTransactional(t testing.TB, cfg publisher.TransactionalConfig) *publisher.Transactional {
	t.Helper()
	tx, err := publisher.NewTransactional(cfg)
	return started(t, tx, err)
}

func started[P interface {
	Start(context.Context) error
	Close() error
}](t testing.TB, p P, err error) P {
	t.Helper()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	require.NoError(t, p.Start(t.Context()))
	return p
}
