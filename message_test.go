package outbox_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
)

func TestValidateTopic(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"orders", "a", "A.b_c-9", strings.Repeat("x", 249), "...", ".a"} {
		require.NoError(t, outbox.ValidateTopic(ok), ok)
	}
	for _, bad := range []string{"", ".", "..", strings.Repeat("x", 250), "a b", "a/b", "ä", "a\x00"} {
		err := outbox.ValidateTopic(bad)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage, "%q", bad)
	}
}

// The bucket function is part of the storage format: these values must
// never change, or writers and relays of different versions would
// disagree about which bucket a row is in.
func TestBucketIsStable(t *testing.T) {
	t.Parallel()
	p := int32(13)
	cases := []struct {
		key   []byte
		part  *int32
		id    string
		count int
		want  int
	}{
		{[]byte("order-1"), nil, "", 8, fnv32a("order-1") % 8},
		{[]byte{}, nil, "", 8, fnv32a("") % 8},
		{nil, nil, "0190c3b2-0000-7000-8000-000000000000", 16, fnv32a("0190c3b2-0000-7000-8000-000000000000") % 16},
		{[]byte("ignored"), &p, "", 8, 5},
	}
	for _, c := range cases {
		require.Equal(t, c.want, outbox.Bucket(c.key, c.part, c.id, c.count))
	}
	// FNV-1a 32 of the empty input is its offset basis.
	require.Equal(t, int(uint32(2166136261)%8), outbox.Bucket([]byte{}, nil, "", 8))
	require.Equal(t, int(uint32(0xe40c292c)%8), outbox.Bucket([]byte("a"), nil, "", 8), "FNV-1a test vector for \"a\"")
	require.Equal(t, int(uint32(0xbf9cf968)%7), outbox.Bucket([]byte("foobar"), nil, "", 7), "FNV-1a test vector for \"foobar\"")
}

// fnv32a is an independent FNV-1a implementation for the test.
func fnv32a(s string) int {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return int(h)
}

func TestHeadersRoundTrip(t *testing.T) {
	t.Parallel()
	for _, hs := range [][]outbox.Header{
		nil,
		{{Key: "a", Value: []byte("1")}},
		{{Key: "a", Value: nil}, {Key: "a", Value: []byte{}}, {Key: "traceparent", Value: []byte(strings.Repeat("z", 300))}},
	} {
		b := outbox.EncodeHeaders(hs)
		got, err := outbox.DecodeHeaders(b)
		require.NoError(t, err)
		require.Equal(t, hs, got)
	}
	for _, bad := range [][]byte{{9}, {1, 5}, {1, 1, 3, 'a'}, {1, 1, 1, 'a', 0, 0}} {
		_, err := outbox.DecodeHeaders(bad)
		require.Error(t, err, "%v", bad)
	}
}

func FuzzHeadersRoundTrip(f *testing.F) {
	f.Add("a", []byte("1"), "b", []byte(nil), false)
	f.Add("", []byte{}, "x", []byte{0, 1}, true)
	f.Fuzz(func(t *testing.T, k1 string, v1 []byte, k2 string, v2 []byte, nil2 bool) {
		if nil2 {
			v2 = nil
		} else if v2 == nil {
			v2 = []byte{}
		}
		if v1 == nil {
			v1 = []byte{}
		}
		hs := []outbox.Header{{Key: k1, Value: v1}, {Key: k2, Value: v2}}
		got, err := outbox.DecodeHeaders(outbox.EncodeHeaders(hs))
		if err != nil {
			t.Fatal(err)
		}
		require.Equal(t, hs, got)
	})
}

func FuzzDecodeHeadersNeverPanics(f *testing.F) {
	f.Add([]byte{1, 1, 1, 'a', 2, 'b'})
	f.Add([]byte{1, 255, 255, 255, 255, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		hs, err := outbox.DecodeHeaders(b)
		if err != nil {
			return
		}
		again, err := outbox.DecodeHeaders(outbox.EncodeHeaders(hs))
		require.NoError(t, err)
		if len(hs) == 0 {
			require.Empty(t, again)
			return
		}
		require.Equal(t, hs, again)
	})
}

func FuzzValidateTopic(f *testing.F) {
	for _, s := range []string{"orders", "..", "a b", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := outbox.ValidateTopic(s)
		legal := len(s) >= 1 && len(s) <= 249 && s != "." && s != ".."
		for _, c := range []byte(s) {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
				legal = false
			}
		}
		require.Equal(t, legal, err == nil, "%q", s)
	})
}
