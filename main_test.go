package outbox_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// database/sql keeps one opener goroutine per pool until Close; the
		// pools are closed in t.Cleanup, but the check runs after them.
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		// GORM's prepared-statement cache (PrepareStmt) starts an expiry
		// goroutine that has no way to be stopped.
		goleak.IgnoreTopFunction("gorm.io/gorm/internal/lru.NewLRU[...].func1"),
	)
}
