package bucketset

import (
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
