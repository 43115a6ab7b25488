package main

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestCPUUseCountsThisProcess spins until this process has used 50 ms of
// CPU more than at the first sample: the period's use counts it as this
// process's and as the machine's.
func TestCPUUseCountsThisProcess(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("/proc/stat is Linux's")
	}
	a, t0 := readCPU(), time.Now()
	require.True(t, a.ok, "/proc/stat read")
	var b cpuSample
	for x := 0; ; x++ {
		if x%1_000_000 == 0 {
			if b = readCPU(); b.self-a.self >= 50*time.Millisecond {
				break
			}
		}
	}
	var u cpuUse
	u.add(a, b, time.Since(t0))
	require.GreaterOrEqual(t, u.self, 50*time.Millisecond)
	require.Greater(t, u.busy, uint64(0), "the machine was busy: this process spun")
	require.True(t, strings.HasPrefix(u.String(), "CPU busy "), u.String())
	require.Equal(t, "CPU not measured", cpuUse{}.String())
}
