package publisher

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// The marker round-trips any ids, ascending or not, sparse or dense,
// negative (the WAL reader's) included.
func TestMarkerRoundTrip(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	sparse := make([]int64, 200)
	id := int64(1)
	for i := range sparse {
		id += 1 + rng.Int64N(100_000)
		sparse[i] = id
	}
	for name, ids := range map[string][]int64{
		"one":        {42},
		"dense":      {7, 8, 9, 10, 11, 12},
		"sparse":     sparse,
		"descending": {100, 90, 95, 3},
		"extremes":   {math.MaxInt64, math.MinInt64, 0, -1, 1},
		"wal":        {-123456789, -123456700, -123400000},
	} {
		meta, n := encodeMarker(ids, MarkerMaxBytesDefault, func(n int) uint64 { return uint64(n) << 40 })
		require.Equal(t, len(ids), n, name)
		require.LessOrEqual(t, len(meta), MarkerMaxBytesDefault, name)
		got, digest, err := decodeMarker(meta)
		require.NoError(t, err, name)
		require.Equal(t, ids, got, name)
		require.Equal(t, uint64(len(ids))<<40, digest, name)
	}
}

// Consecutive ids cost one byte each: 500, the relay's default batch, are
// well inside the broker's default limit.
func TestMarkerSize(t *testing.T) {
	t.Parallel()
	ids := make([]int64, 500)
	for i := range ids {
		ids[i] = 1_000_000_000 + int64(i)*8 // eight buckets, round robin
	}
	meta, n := encodeMarker(ids, MarkerMaxBytesDefault, noDigest)
	require.Equal(t, 500, n)
	// version byte, eight-byte digest, a five-byte first id, 499 one-byte
	// deltas; base64.
	require.Equal(t, (4*(1+8+5+499)+2)/3, len(meta))
}

// Ids that do not fit are left out from the first one that does not: the
// marker holds a prefix, never more than the limit.
func TestMarkerPrefix(t *testing.T) {
	t.Parallel()
	ids := make([]int64, 3000)
	for i := range ids {
		ids[i] = int64(i) * 1_000_000 // four-byte deltas
	}
	for _, limit := range []int{markerMinBytes, 100, 1000, MarkerMaxBytesDefault} {
		var digested int
		meta, n := encodeMarker(ids, limit, func(n int) uint64 { digested = n; return 7 })
		require.Positive(t, n, "limit %d", limit)
		require.Less(t, n, len(ids), "limit %d", limit)
		require.Equal(t, n, digested, "limit %d: the digest covers the prefix", limit)
		require.LessOrEqual(t, len(meta), limit, "limit %d", limit)
		got, digest, err := decodeMarker(meta)
		require.NoError(t, err)
		require.Equal(t, ids[:n], got, "limit %d", limit)
		require.Equal(t, uint64(7), digest, "limit %d", limit)
		// One more id would not have fit.
		more, _ := encodeMarker(ids[:n+1], 1<<20, noDigest)
		require.Greater(t, len(more), limit, "limit %d: the prefix stopped early", limit)
	}
	// The largest possible id fits even at the smallest limit.
	_, n := encodeMarker([]int64{math.MinInt64, math.MaxInt64}, markerMinBytes, noDigest)
	require.Equal(t, 2, n)
}

// Metadata that is no marker is a typed error.
func TestMarkerBad(t *testing.T) {
	t.Parallel()
	v1, _ := encodeMarker([]int64{1, 2}, MarkerMaxBytesDefault, noDigest)
	v1 = "AQ" + v1[2:] // a version 1 marker had no digest: never trusted
	for _, s := range []string{"", "not base64!", "AA", "AYA", "AgAAAAAAAAA", v1} {
		_, _, err := decodeMarker(s)
		require.ErrorIs(t, err, ErrBadMarker, "%q", s)
	}
}

func noDigest(int) uint64 { return 0 }

// A positioned marker (WAL mode, version 3) round-trips its ids, digest,
// the position and the digest of its last recorded message, of the prefix
// that fits; a version-2 marker still decodes, with no position; a
// version-3 marker cut inside its header is a typed error.
func TestMarkerPositioned(t *testing.T) {
	t.Parallel()
	ids := make([]int64, 3000)
	for i := range ids {
		ids[i] = -int64(1_000_000_000 + i*1_000_000)
	}
	for _, limit := range []int{markerMinBytes, 1000, MarkerMaxBytesDefault} {
		meta, n := encodeMarkerSums(ids, limit, true, func(n int) markerSums {
			return markerSums{digest: uint64(n), position: uint64(n) << 32, last: uint64(n) << 16}
		})
		require.Positive(t, n, "limit %d", limit)
		require.LessOrEqual(t, len(meta), limit, "limit %d", limit)
		m, err := parseMarker(meta)
		require.NoError(t, err, "limit %d", limit)
		require.Equal(t, ids[:n], m.ids, "limit %d", limit)
		require.Equal(t, marker{ids: m.ids, digest: uint64(n), position: uint64(n) << 32, last: uint64(n) << 16}, m, "limit %d", limit)
	}
	_, n := encodeMarkerSums([]int64{math.MinInt64, math.MaxInt64}, markerMinBytes, true, func(int) markerSums { return markerSums{} })
	require.Equal(t, 2, n, "the largest ids fit a positioned marker at the smallest limit")

	v2, _ := encodeMarker([]int64{5, 6}, MarkerMaxBytesDefault, func(int) uint64 { return 9 })
	m, err := parseMarker(v2)
	require.NoError(t, err)
	require.Equal(t, marker{ids: []int64{5, 6}, digest: 9}, m)

	v3, _ := encodeMarkerSums([]int64{5}, MarkerMaxBytesDefault, true, func(int) markerSums { return markerSums{digest: 1, position: 2, last: 3} })
	short := v3[:(markerHeaderPositioned-1)*4/3] // the header without its last bytes
	_, err = parseMarker(short)
	require.ErrorIs(t, err, ErrBadMarker)
}
