// Package badinput_test feeds gorm-outbox bad input and hostile
// conditions on every supported database (PostgreSQL, MariaDB, SQLite):
// oversized and malformed messages, misconfiguration between writers and
// relays, hostile table names, databases that go away mid-batch,
// cancellation mid-publish, and secrets that must never reach the logs.
// See RELIABILITY.md at the root of the repository.
package badinput_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// database/sql keeps one opener goroutine per pool until Close; the
		// pools are closed in t.Cleanup, but the check runs after them.
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		// sarama's broker metrics start one process-wide go-metrics ticker
		// that is never stopped (see publisher/main_test.go).
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
