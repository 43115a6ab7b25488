package bucketset

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSet(t *testing.T) {
	t.Parallel()
	s := New(130)
	for _, b := range []int{129, 0, 64, 63, 5} {
		require.True(t, s.Add(b), b)
	}
	require.False(t, s.Add(5), "already there")
	for _, b := range []int{-1, 130, 1 << 20} {
		require.False(t, s.Add(b), "out of range %d", b)
		require.False(t, s.Contains(b))
		s.Remove(b) // ignored
	}
	require.True(t, s.Contains(64))
	s.Remove(64)
	require.False(t, s.Contains(64))
	require.Equal(t, []int{-7, 0, 5, 63, 129}, s.Drain([]int{-7}))
	require.Empty(t, s.Drain(nil))
	require.True(t, s.Add(64), "drained buckets can be added again")

	require.Equal(t, 130, s.Size())
	var zero Set
	require.Zero(t, zero.Size())
	require.False(t, zero.Add(0))
	require.Empty(t, zero.Drain(nil))
}

func TestHints(t *testing.T) {
	t.Parallel()
	h := NewHints(8)
	got, unknown := h.Take([]int{-1})
	require.Equal(t, []int{-1}, got)
	require.False(t, unknown, "nothing recorded")

	h.Add([]int{5, 1, 5})
	got, unknown = h.Take(nil)
	require.Equal(t, []int{1, 5}, got)
	require.False(t, unknown)
	got, unknown = h.Take(nil)
	require.Empty(t, got, "taken once")
	require.False(t, unknown)

	h.Add([]int{3, 8, -2})
	got, unknown = h.Take(nil)
	require.Equal(t, []int{3}, got)
	require.True(t, unknown, "8 and -2 are outside 0..7")
	_, unknown = h.Take(nil)
	require.False(t, unknown, "the unknown hint was taken")

	h.AddUnknown()
	got, unknown = h.Take(nil)
	require.Empty(t, got)
	require.True(t, unknown)
}

// Concurrent adders and a taker lose no bucket: every one added is taken
// once, by one of the takes.
func TestHintsConcurrent(t *testing.T) {
	t.Parallel()
	const n = 256
	h := NewHints(n)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for b := w; b < n; b += 4 {
				h.Add([]int{b})
			}
		}()
	}
	seen := map[int]int{}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	take := func() {
		got, unknown := h.Take(nil)
		require.False(t, unknown)
		for _, b := range got {
			seen[b]++
		}
	}
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
		}
		take()
	}
	take()
	require.Len(t, seen, n)
	for b, c := range seen {
		require.Equal(t, 1, c, "bucket %d", b)
	}
}
