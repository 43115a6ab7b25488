package publisher

import (
	"encoding/base64"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
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
		got, err := decodeMarker(meta)
		require.NoError(t, err, name)
		require.Equal(t, ids, got.IDs, name)
		require.Zero(t, got.Count, name)
		require.Equal(t, uint64(len(ids))<<40, got.Digest, name)
	}
}

// Ascending ids within 127 of each other cost one byte each: 2000, the
// relay's default batch, of an eight-bucket outbox are listed inside the
// broker's default limit, and so are 3000.
func TestMarkerSize(t *testing.T) {
	t.Parallel()
	for _, n := range []int{500, 2000, 3000} {
		ids := make([]int64, n)
		for i := range ids {
			ids[i] = 1_000_000_000 + int64(i)*8 // eight buckets, round robin
		}
		meta, got := encodeMarker(ids, MarkerMaxBytesDefault, noDigest)
		require.Equal(t, n, got)
		// version byte, eight-byte digest, a five-byte first id, n-1
		// one-byte deltas; base64.
		require.Equal(t, (4*(1+8+5+n-1)+2)/3, len(meta), "%d ids", n)
		rec, err := decodeMarker(meta)
		require.NoError(t, err)
		require.Equal(t, ids, rec.IDs, "%d ids: listed", n)
	}
	// Differences of 64 to 127 took two bytes as zigzag varints (version
	// 2), one now.
	ids := []int64{0, 100, 200, 300}
	meta, _ := encodeMarker(ids, MarkerMaxBytesDefault, noDigest)
	require.Equal(t, (4*(1+8+1+3)+2)/3, len(meta))
}

// Ascending ids that cannot be listed within the limit are recorded as
// their span, whatever their number, and the marker covers every one of
// them: nothing is truncated. The span of the most distant ids fits the
// smallest limit.
func TestMarkerSpan(t *testing.T) {
	t.Parallel()
	dense := make([]int64, relay.BatchSizeMax)
	for i := range dense {
		dense[i] = 5_000_000 + int64(i)*8
	}
	sparse := make([]int64, 3000)
	for i := range sparse {
		sparse[i] = int64(i) * 1_000_000 // three-byte differences
	}
	for name, tc := range map[string]struct {
		ids   []int64
		limit int
	}{
		"the largest batch":         {dense, MarkerMaxBytesDefault},
		"sparse":                    {sparse, MarkerMaxBytesDefault},
		"sparse, smallest limit":    {sparse, markerMinBytes},
		"extremes, smallest limit":  {[]int64{math.MinInt64, math.MinInt64 / 2, -1, 0, 1 << 62, math.MaxInt64}, markerMinBytes},
		"negative, smallest limit":  {[]int64{-900_000_000_000, -800_000_000_000, -700_000_000_000, -600_000_000_000, -500_000_000_000, -400_000_000_000, -1}, markerMinBytes},
		"one byte over a list form": {sparse[:1000], 1000},
	} {
		var digested int
		meta, n := encodeMarker(tc.ids, tc.limit, func(n int) uint64 { digested = n; return 99 })
		require.Equal(t, len(tc.ids), n, "%s: every id is covered", name)
		require.Equal(t, len(tc.ids), digested, "%s: the digest covers every id", name)
		require.LessOrEqual(t, len(meta), tc.limit, name)
		rec, err := decodeMarker(meta)
		require.NoError(t, err, name)
		require.Equal(t, relay.Committed{First: tc.ids[0], Last: tc.ids[len(tc.ids)-1], Count: len(tc.ids), Digest: 99}, rec, name)
	}
	// The list is kept for as long as it fits: the same ids, a larger limit.
	meta, _ := encodeMarker(sparse[:1000], 1<<20, noDigest)
	rec, err := decodeMarker(meta)
	require.NoError(t, err)
	require.Equal(t, sparse[:1000], rec.IDs)
}

// Ids not in ascending order that do not fit are left out from the first
// one that does not: the marker holds a prefix, never more than the limit.
func TestMarkerPrefix(t *testing.T) {
	t.Parallel()
	ids := make([]int64, 3000)
	for i := range ids {
		ids[i] = int64(len(ids)-i) * 1_000_000 // four-byte deltas, descending
	}
	for _, limit := range []int{markerMinBytes, 100, 1000, MarkerMaxBytesDefault} {
		var digested int
		meta, n := encodeMarker(ids, limit, func(n int) uint64 { digested = n; return 7 })
		require.Positive(t, n, "limit %d", limit)
		require.Less(t, n, len(ids), "limit %d", limit)
		require.Equal(t, n, digested, "limit %d: the digest covers the prefix", limit)
		require.LessOrEqual(t, len(meta), limit, "limit %d", limit)
		got, err := decodeMarker(meta)
		require.NoError(t, err)
		require.Equal(t, ids[:n], got.IDs, "limit %d", limit)
		require.Equal(t, uint64(7), got.Digest, "limit %d", limit)
		// One more id would not have fit.
		more, _ := encodeMarker(ids[:n+1], 1<<20, noDigest)
		require.Greater(t, len(more), limit, "limit %d: the prefix stopped early", limit)
	}
	// The largest possible id fits even at the smallest limit.
	_, n := encodeMarker([]int64{math.MaxInt64, math.MinInt64}, markerMinBytes, noDigest)
	require.Equal(t, 2, n)
}

// Version 2 markers, which earlier releases wrote (zigzag varint
// differences, any order), are still read.
func TestMarkerVersion2(t *testing.T) {
	t.Parallel()
	// Written by the encoder of the releases before versions 4 and 5: ids 10, 18,
	// 26, 5, digest 0x0102030405060708.
	meta := "AgECAwQFBgcIFBAQKQ"
	rec, err := decodeMarker(meta)
	require.NoError(t, err)
	require.Equal(t, relay.Committed{IDs: []int64{10, 18, 26, 5}, Digest: 0x0102030405060708}, rec)
	// The encoder still writes version 2 for ids in another order.
	again, n := encodeMarker([]int64{10, 18, 26, 5}, MarkerMaxBytesDefault, func(int) uint64 { return 0x0102030405060708 })
	require.Equal(t, 4, n)
	require.Equal(t, meta, again)
}

// Metadata that is no marker is a typed error.
func TestMarkerBad(t *testing.T) {
	t.Parallel()
	v1, _ := encodeMarker([]int64{2, 1}, MarkerMaxBytesDefault, noDigest)
	v1 = "AQ" + v1[2:] // a version 1 marker had no digest: never trusted
	header := func(version byte, body ...byte) string {
		return base64.RawStdEncoding.EncodeToString(append([]byte{version, 0, 0, 0, 0, 0, 0, 0, 0}, body...))
	}
	maxVarint := binary.AppendVarint(nil, math.MaxInt64)
	for _, s := range []string{"", "not base64!", "AA", "AYA", "AgAAAAAAAAA", v1,
		header(2, 0x80),                       // version 2, a truncated id
		header(4),                             // list: no first id
		header(4, 2, 0),                       // list: a zero difference (ids repeat)
		header(4, 2, 0x80),                    // list: a truncated difference
		header(4, append(maxVarint, 1)...),    // list: past the largest id
		header(5),                             // span: no first id
		header(5, 2),                          // span: no last id
		header(5, 2, 5),                       // span: no count
		header(5, 2, 5, 0),                    // span: no ids
		header(5, 2, 5, 7),                    // span: more ids than the span holds
		header(5, 2, 5, 3, 1),                 // span: trailing bytes
		header(5, append(maxVarint, 1, 1)...), // span: past the largest id
		header(6, 2, 5, 3),                    // an unknown version
	} {
		_, err := decodeMarker(s)
		require.ErrorIs(t, err, ErrBadMarker, "%q", s)
	}
}

// The decoder reads broker data: whatever it is given, it returns a
// typed error or a record the relay can use, a list of strictly
// ascending ids (version 3) or a span of at least one id with no more
// ids than it holds; and what it returns for a marker it encoded is
// what was encoded.
func FuzzDecodeMarker(f *testing.F) {
	f.Add("AgECAwQFBgcIFBAQKQ")
	for _, ids := range [][]int64{{1}, {1, 2, 3}, {5, 900, 1 << 40}, {math.MinInt64, math.MaxInt64}} {
		for _, limit := range []int{markerMinBytes, MarkerMaxBytesDefault} {
			meta, _ := encodeMarker(ids, limit, noDigest)
			f.Add(meta)
		}
	}
	f.Fuzz(func(t *testing.T, s string) {
		rec, err := decodeMarker(s)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMarker)
			require.Zero(t, rec)
			return
		}
		raw, _ := base64.RawStdEncoding.DecodeString(s)
		switch raw[0] {
		case markerList:
			require.NotEmpty(t, rec.IDs)
			require.True(t, ascending(rec.IDs), "%v", rec.IDs)
		case markerSpan:
			require.Empty(t, rec.IDs)
			require.Positive(t, rec.Count)
			require.LessOrEqual(t, rec.First, rec.Last)
			require.LessOrEqual(t, uint64(rec.Count-1), uint64(rec.Last-rec.First))
		}
		if raw[0] == markerList || raw[0] == markerList2 && len(rec.IDs) > 0 {
			// What the encoder makes of the ids decodes to them again.
			meta, n := encodeMarker(rec.IDs, 1<<20, func(int) uint64 { return rec.Digest })
			require.Equal(t, len(rec.IDs), n)
			again, err := decodeMarker(meta)
			require.NoError(t, err)
			require.Equal(t, rec, again)
		}
	})
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
		require.Equal(t, ids[:n], m.rec.IDs, "limit %d", limit)
		require.Equal(t, marker{rec: relay.Committed{IDs: m.rec.IDs, Digest: uint64(n), Position: uint64(n) << 32, LastDigest: uint64(n) << 16}}, m, "limit %d", limit)
	}
	_, n := encodeMarkerSums([]int64{math.MinInt64, math.MaxInt64}, markerMinBytes, true, func(int) markerSums { return markerSums{} })
	require.Equal(t, 2, n, "the largest ids fit a positioned marker at the smallest limit")

	v2, _ := encodeMarker([]int64{6, 5}, MarkerMaxBytesDefault, func(int) uint64 { return 9 })
	require.Equal(t, byte('A'), v2[0], "version 2: ids not ascending")
	m, err := parseMarker(v2)
	require.NoError(t, err)
	require.Equal(t, marker{rec: relay.Committed{IDs: []int64{6, 5}, Digest: 9}}, m)

	// Ascending positioned ids are listed too, cut where the limit is:
	// the WAL reader needs the ids.
	asc := make([]int64, 3000)
	for i := range asc {
		asc[i] = int64(i) * 1_000_000
	}
	meta, n := encodeMarkerSums(asc, MarkerMaxBytesDefault, true, func(int) markerSums { return markerSums{position: 1} })
	require.Less(t, n, len(asc))
	m, err = parseMarker(meta)
	require.NoError(t, err)
	require.Equal(t, asc[:n], m.rec.IDs)
	require.Zero(t, m.rec.Count)

	v3, _ := encodeMarkerSums([]int64{5}, MarkerMaxBytesDefault, true, func(int) markerSums { return markerSums{digest: 1, position: 2, last: 3} })
	short := v3[:(markerHeaderPositioned-1)*4/3] // the header without its last bytes
	_, err = parseMarker(short)
	require.ErrorIs(t, err, ErrBadMarker)
}
