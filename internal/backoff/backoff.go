// Package backoff is the one exponential backoff with jitter of the
// module's retry loops: the relay's failing buckets, the hint bridge and
// the pgnotify listener.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Exponential returns the wait after the n-th consecutive failure (n >= 1):
// lo doubled n-1 times, capped at hi, then a uniformly random point in its
// upper half, so that peers failing together spread their retries. A cap
// of 1ns or less is returned as is.
func Exponential(lo, hi time.Duration, n int) time.Duration {
	d := lo
	for i := 1; i < n && d < hi; i++ {
		d *= 2
	}
	d = min(d, hi)
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// Sleep waits for d or ctx, and reports whether the full pause elapsed.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
