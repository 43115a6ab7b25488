package outboxtest

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// mockT records failures instead of stopping the test, so the failure
// messages can be checked.
type mockT struct {
	failed bool
	msg    strings.Builder
}

func (m *mockT) Errorf(format string, args ...any) { fmt.Fprintf(&m.msg, format, args...) }
func (m *mockT) FailNow()                          { m.failed = true }
func (m *mockT) Helper()                           {}

func (m *mockT) requireFailed(t *testing.T, parts ...string) {
	t.Helper()
	require.True(t, m.failed, "the assertion passed")
	for _, p := range parts {
		require.Contains(t, m.msg.String(), p)
	}
}

func (m *mockT) requirePassed(t *testing.T) {
	t.Helper()
	require.False(t, m.failed, m.msg.String())
}

// The failure messages say what was expected, what is pending and why
// each pending message does not match.
func TestFailureMessages(t *testing.T) {
	t.Parallel()
	db := dbtest.Open(t, dbtest.SQLite)
	p, err := outbox.NewPlugin(outbox.Config{})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), db.DB))

	// Empty outbox.
	mt := &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Topic: "orders"})
	mt.requireFailed(t, "outbox assertion failure", "no pending message matches {topic=orders}", "the outbox has no pending message")

	require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
		for _, k := range []string{"order-1", "order-2"} {
			if err := p.EnqueueJSON(tx, "orders", []byte(k), map[string]any{"id": k}, outbox.Header{Key: "tenant", Value: []byte("acme")}); err != nil {
				return err
			}
		}
		return p.Enqueue(tx, &outbox.Message{Topic: "audit", Value: []byte{0xff, 0x00}})
	}))

	mt = &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Topic: "orders", Key: "order-1", JSON: map[string]any{"id": "order-9"}})
	mt.requireFailed(t,
		`no pending message matches {topic=orders key=order-1 json={"id":"order-9"}}`,
		"pending messages (3):",
		`#1 orders key=order-1 value={"id":"order-1"} tenant:acme content-type:application/json`,
		`not a match: JSON value is {"id":"order-1"}`,
		"not a match: key is order-2",
		"#3 audit keyless value=0xff00",
		"not a match: topic is audit",
	)

	mt = &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Topic: "orders", Headers: map[string]string{"tenant": "acme"}})
	mt.requireFailed(t, "2 pending messages match {topic=orders header tenant:acme}, want exactly one")

	mt = &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Key: "order-1", Headers: map[string]string{"tenant": "other", "trace": "x"}})
	mt.requireFailed(t, "not a match: header tenant is acme")

	mt = &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Keyless: true, Topic: "orders"})
	mt.requireFailed(t, "not a match: key is order-1, want none")

	mt = &mockT{}
	requireEnqueued(mt, db.DB, p, Want{Topic: "audit", JSON: 1})
	mt.requireFailed(t, "not a match: value is not JSON: 0xff00")

	mt = &mockT{}
	requireNotEnqueued(mt, db.DB, p, Want{Key: "order-2"})
	mt.requireFailed(t, "a pending message matches {key=order-2}, want none: orders key=order-2")

	mt = &mockT{}
	requireManyEnqueued(mt, db.DB, p, []Want{{Topic: "orders", Key: "order-2"}, {Topic: "orders", Key: "order-1"}, {Topic: "orders"}})
	mt.requireFailed(t,
		"pending messages differ from the 3 expected, in enqueue order:",
		"#1 want {topic=orders key=order-2}: key is order-1",
		"#2 want {topic=orders key=order-1}: key is order-2",
		"#3 missing: {topic=orders}",
	)
	mt = &mockT{}
	requireManyEnqueued(mt, db.DB, p, []Want{{Topic: "audit"}})
	mt.requirePassed(t)
	mt = &mockT{}
	requireManyEnqueued(mt, db.DB, p, []Want{{Key: "order-1"}})
	mt.requireFailed(t, "#2 unexpected: orders key=order-2", "#3 unexpected: audit")

	// Tables that were never migrated.
	other, err := outbox.NewPlugin(outbox.Config{Tables: outbox.WithPrefix("none_")})
	require.NoError(t, err)
	mt = &mockT{}
	pending(mt, db.DB, other)
	mt.requireFailed(t, "cannot read the outbox table none_outbox_messages", "AutoMigrate")
	mt = &mockT{}
	drain(mt, db.DB, other)
	mt.requireFailed(t, "drain none_outbox_messages", "is missing", "AutoMigrate")

	// No plugin on the *gorm.DB.
	bare := dbtest.Open(t, dbtest.SQLite)
	mt = &mockT{}
	requireEnqueued(mt, bare.DB, nil, Want{})
	mt.requireFailed(t, "no plugin given and outbox: no outbox plugin registered")
}

func TestWantString(t *testing.T) {
	t.Parallel()
	one := int32(1)
	require.Equal(t, "{any message}", Want{}.String())
	require.Equal(t, `{topic=t key="a b" partition=1 value=v header a:1 header b:""}`,
		Want{Topic: "t", Key: "a b", Partition: &one, Value: []byte("v"), Headers: map[string]string{"b": "", "a": "1"}}.String())
	require.Equal(t, `{keyless json=[1,2]}`, Want{Keyless: true, JSON: []int{1, 2}}.String())
}
