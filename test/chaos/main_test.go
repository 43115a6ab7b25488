package chaos_test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	gometrics "github.com/rcrowley/go-metrics"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// sarama's go-metrics meters (the WAL slot tests publish from this
	// process) start a goroutine that is never stopped; no test reads
	// them.
	gometrics.UseNilMetrics = true
	code := m.Run()
	if buildBin != "" {
		_ = os.RemoveAll(filepath.Dir(buildBin))
	}
	if code == 0 {
		if err := goleak.Find(
			// database/sql keeps one opener goroutine per pool until Close;
			// the pools are closed in t.Cleanup, but the check runs after
			// them.
			goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
