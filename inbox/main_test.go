package inbox_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// database/sql keeps one opener goroutine per pool until Close; the
		// pools are closed in t.Cleanup, but the check runs after them.
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		// sarama's broker metrics start one process-wide ticking goroutine
		// that the library never stops.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}
