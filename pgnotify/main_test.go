package pgnotify_test

import (
	"log/slog"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// database/sql keeps one opener goroutine per pool until Close; the
		// pools are closed in t.Cleanup, but the check runs after them.
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
	)
}

// testLogger discards the logs unless OUTBOX_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("OUTBOX_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
