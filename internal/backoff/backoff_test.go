package backoff

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestExponential(t *testing.T) {
	t.Parallel()
	lo, hi := 100*time.Millisecond, 3*time.Second
	for n, capped := range map[int]time.Duration{1: lo, 2: 2 * lo, 3: 4 * lo, 5: 16 * lo, 6: hi, 50: hi} {
		seen := map[time.Duration]bool{}
		for range 200 {
			d := Exponential(lo, hi, n)
			require.GreaterOrEqual(t, d, capped/2, "n=%d", n)
			require.LessOrEqual(t, d, capped, "n=%d", n)
			seen[d] = true
		}
		require.Greater(t, len(seen), 1, "n=%d: jittered", n)
	}
	require.Equal(t, time.Duration(0), Exponential(0, hi, 3))
	require.Equal(t, time.Duration(1), Exponential(1, 1, 3))
}
