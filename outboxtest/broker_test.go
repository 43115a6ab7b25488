package outboxtest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// NewBroker works without a test; ReadContext reports a read that ends
// short with the count, the topic and why it ended.
func TestNewBrokerReadContextShort(t *testing.T) {
	t.Parallel()
	b, err := NewBroker("empty")
	require.NoError(t, err)
	defer b.Close()
	require.NotEmpty(t, b.Brokers())

	ctx, cancel := context.WithTimeoutCause(context.Background(), 300*time.Millisecond, errors.New("the test's deadline"))
	defer cancel()
	recs, err := b.ReadContext(ctx, "empty", 1)
	require.Empty(t, recs)
	require.EqualError(t, err, "read 0 of 1 records from topic empty before the test's deadline")
}
