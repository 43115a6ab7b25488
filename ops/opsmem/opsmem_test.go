package opsmem_test

import (
	"testing"

	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/relay/storetest"
)

// The in-memory outbox keeps the operator API's contract.
func TestOperatorConformance(t *testing.T) {
	t.Parallel()
	storetest.RunOperator(t, opstest.Harness(func(_ *testing.T, buckets int) *opstest.Backend {
		return opstest.Memory(buckets)
	}))
}
