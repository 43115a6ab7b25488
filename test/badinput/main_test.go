// Package badinput_test feeds gorm-outbox bad input and hostile
// conditions on every supported database (PostgreSQL, MariaDB, SQLite):
// oversized and malformed messages, misconfiguration between writers and
// relays, hostile table names, databases that go away mid-batch,
// cancellation mid-publish, and secrets that must never reach the logs.
// See RELIABILITY.md at the root of the repository.
package badinput_test

import (
	"testing"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func TestMain(m *testing.M) { dbtest.VerifyTestMain(m) }
