package main

import (
	"context"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// TestMain lets the test binary play the broker and relay processes the
// scenarios start from their own executable.
func TestMain(m *testing.M) {
	switch os.Getenv("OUTBOX_BENCH_ROLE") {
	case "broker":
		os.Exit(runBrokerRole())
	case "relay":
		os.Exit(runRelayRole())
	}
	os.Exit(m.Run())
}

// TestSmoke runs every scenario at a tiny size: it checks that the harness
// works and that every message arrives, and asserts no timing.
func TestSmoke(t *testing.T) {
	for _, driver := range []string{dbtest.Postgres, dbtest.SQLite} {
		t.Run(driver, func(t *testing.T) {
			if driver != dbtest.SQLite {
				dbtest.Require(t, driver)
			}
			cfg, err := parseFlags([]string{"-smoke", "-driver", driver})
			require.NoError(t, err)
			cfg.TmpDir = t.TempDir()
			results, err := run(context.Background(), cfg, io.Discard)
			require.NoError(t, err)
			require.Len(t, results, len(allScenarios))
			for _, r := range results {
				require.Empty(t, r.Err, "%s: %s", r.Scenario, r.Err)
				require.NotEmpty(t, r.Figures, r.Scenario)
			}
		})
	}
}

func TestParseFlags(t *testing.T) {
	_, err := parseFlags([]string{"-scenarios", "drain,nope"})
	require.ErrorContains(t, err, `unknown scenario "nope"`)
	_, err = parseFlags([]string{"-growth", "10k"})
	require.Error(t, err)
	c, err := parseFlags([]string{"-growth", "1_000,2000", "-driver", "sqlite"})
	require.NoError(t, err)
	require.Equal(t, []int{1000, 2000}, c.Growth)
}
