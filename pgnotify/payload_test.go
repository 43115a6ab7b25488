package pgnotify

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
)

const testSender = "0123456789ab"

func decodeAll(t *testing.T, payload string) (ids []int, sender string, ok bool) {
	t.Helper()
	sender, ok = decodePayload(payload, func(b int) { ids = append(ids, b) })
	return ids, sender, ok
}

func TestPayloadRoundTrip(t *testing.T) {
	t.Parallel()
	all := make([]int, outbox.BucketCountMax)
	for i := range all {
		all[i] = i
	}
	evens := []int{}
	for i := 0; i < outbox.BucketCountMax; i += 2 {
		evens = append(evens, i)
	}
	for _, tc := range []struct {
		name string
		in   []int
		want []int
	}{
		{"one", []int{3}, []int{3}},
		{"several", []int{7, 0, 2}, []int{0, 2, 7}},
		{"duplicates", []int{5, 5, 1, 5}, []int{1, 5}},
		{"unknown", []int{outbox.UnknownBucket}, []int{-1}},
		{"unknown and buckets", []int{4, -1, 2}, []int{-1, 2, 4}},
		{"out of range is unknown", []int{outbox.BucketCountMax, -7, 1}, []int{-1, 1}},
		{"all buckets", all, all},
		{"every other bucket", evens, evens},
		{"highest bucket", []int{outbox.BucketCountMax - 1}, []int{outbox.BucketCountMax - 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			payload := encodePayload(testSender, tc.in)
			require.Less(t, len(payload), MaxPayloadBytes+1)
			got, sender, ok := decodeAll(t, payload)
			require.True(t, ok, "payload %q", payload)
			require.Equal(t, testSender, sender)
			require.Equal(t, tc.want, got)
		})
	}
}

// The encoder picks the shorter of the decimal list and the bitmap.
func TestPayloadCompact(t *testing.T) {
	t.Parallel()
	require.Equal(t, "h1:"+testSender+":1,9", encodePayload(testSender, []int{9, 1}))
	many := make([]int, 0, 256)
	for i := range 256 {
		many = append(many, i)
	}
	p := encodePayload(testSender, many)
	require.True(t, strings.HasPrefix(p, "h1:"+testSender+":~"), p)
	require.Len(t, p, len("h1:"+testSender+":~")+43) // 32 bytes, base64
	all := make([]int, outbox.BucketCountMax)
	for i := range all {
		all[i] = i
	}
	require.Less(t, len(encodePayload(testSender, append(all, -1))), 720)
}

// Anything that is not a valid payload is one unknown-bucket hint, never a
// partial list.
func TestPayloadMalformed(t *testing.T) {
	t.Parallel()
	for _, p := range []string{
		"",
		"garbage",
		"h2:" + testSender + ":1",
		"h1:short:1",
		"h1:0123456789zz:1",
		"h1:" + testSender,
		"h1:" + testSender + ":",
		"h1:" + testSender + ":1,,2",
		"h1:" + testSender + ":1,x",
		"h1:" + testSender + ":3,-2",
		"h1:" + testSender + ":4096",
		"h1:" + testSender + ":000001",
		"h1:" + testSender + ":~",
		"h1:" + testSender + ":~!!",
		"h1:" + testSender + ":~" + strings.Repeat("A", 700),
	} {
		got, _, ok := decodeAll(t, p)
		require.False(t, ok, "payload %q", p)
		require.Equal(t, []int{outbox.UnknownBucket}, got, "payload %q", p)
	}
}

func FuzzDecodePayload(f *testing.F) {
	f.Add("h1:" + testSender + ":1,2,-1")
	f.Add("h1:" + testSender + ":~_w")
	f.Fuzz(func(t *testing.T, p string) {
		var got []int
		_, ok := decodePayload(p, func(b int) { got = append(got, b) })
		if !ok {
			require.Equal(t, []int{outbox.UnknownBucket}, got)
		}
		for _, b := range got {
			require.True(t, b >= -1 && b < outbox.BucketCountMax, "bucket %d", b)
		}
	})
}

func TestDefaultChannel(t *testing.T) {
	t.Parallel()
	require.Equal(t, "outbox_messages_hints", DefaultChannel(outbox.Tables{}))
	require.Equal(t, "billing_outbox_messages_hints", DefaultChannel(outbox.WithPrefix("billing_")))
	require.Equal(t, "sales__orders_outbox_hints", DefaultChannel(outbox.Tables{Schema: "Sales", Messages: "Orders_Outbox"}))
	long := DefaultChannel(outbox.Tables{Schema: strings.Repeat("s", 63), Messages: strings.Repeat("m", 63)})
	require.Len(t, long, 63)
	require.NoError(t, ValidateChannel(long))
	other := DefaultChannel(outbox.Tables{Schema: strings.Repeat("s", 63), Messages: strings.Repeat("m", 62) + "n"})
	require.NotEqual(t, long, other, "the hash tells long names apart")
	for _, tables := range []outbox.Tables{{}, outbox.WithPrefix("x_"), {Schema: "a", Messages: "b"}} {
		require.NoError(t, ValidateChannel(DefaultChannel(tables)))
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	const dsn = "host=127.0.0.1 user=postgres dbname=test"
	for _, tc := range []struct {
		field string
		cfg   Config
	}{
		{"DSN", Config{}},
		{"DSN", Config{DSN: "postgres://[::1"}},
		{"Channel", Config{DSN: dsn, Channel: "Has-Dash"}},
		{"Channel", Config{DSN: dsn, Channel: "UPPER"}},
		{"Channel", Config{DSN: dsn, Channel: strings.Repeat("c", 64)}},
		{"PingInterval", Config{DSN: dsn, PingInterval: -1}},
		{"Timeout", Config{DSN: dsn, Timeout: -1}},
		{"ReconnectBackoffMin", Config{DSN: dsn, ReconnectBackoffMin: -1}},
		{"ReconnectBackoffMax", Config{DSN: dsn, ReconnectBackoffMin: 2e9, ReconnectBackoffMax: 1e9}},
		{"PublishDSN", Config{DSN: dsn, PublishDSN: "postgres://[::1"}},
	} {
		_, err := New(tc.cfg)
		var ce *outbox.ConfigError
		require.True(t, errors.As(err, &ce), "%s: %v", tc.field, err)
		require.Equal(t, tc.field, ce.Field)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	}

	tr, err := New(Config{DSN: dsn + " application_name=from_dsn"})
	require.NoError(t, err)
	defer tr.Close()
	require.Equal(t, "outbox_messages_hints", tr.Channel())
	require.Equal(t, "from_dsn", tr.ApplicationName())
	require.Equal(t, Stats{}, tr.Stats())

	tr2, err := New(Config{DSN: dsn})
	require.NoError(t, err)
	defer tr2.Close()
	require.Equal(t, ApplicationNameDefault, tr2.ApplicationName())
	require.NotEqual(t, tr.sender, tr2.sender)
	require.True(t, slices.Equal([]byte(tr.sender), []byte(strings.ToLower(tr.sender))))
}
