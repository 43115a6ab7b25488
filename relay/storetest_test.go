package relay_test

import (
	"testing"

	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/relay/storetest"
)

// The engine tests' in-memory store keeps the contract the GORM store
// keeps: with every capability (advancingStore), and without any
// (basicStore).
func TestFakeStoreConformance(t *testing.T) {
	t.Parallel()
	insert := func(t *testing.T, s relay.Store, msgs []relay.Message) {
		switch s := s.(type) {
		case advancingStore:
			s.insert(msgs)
		case basicStore:
			s.s.insert(msgs)
		default:
			t.Fatalf("unexpected store %T", s)
		}
	}
	t.Run("all capabilities", func(t *testing.T) {
		t.Parallel()
		storetest.Run(t, storetest.Harness{
			New:    func(t *testing.T, buckets int) relay.Store { return advancingStore{newFakeStore(buckets)} },
			Insert: insert,
		})
	})
	t.Run("none", func(t *testing.T) {
		t.Parallel()
		storetest.Run(t, storetest.Harness{
			New:    func(t *testing.T, buckets int) relay.Store { return basicStore{newFakeStore(buckets)} },
			Insert: insert,
		})
	})
}
