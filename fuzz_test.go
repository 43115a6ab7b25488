package outbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/gorm-outbox/outbox"
)

// The fuzz targets below run their seed corpus as ordinary tests in CI
// (go test ./...) and explore further with
//
//	go test -run '^$' -fuzz FuzzBucket -fuzztime 60s .
//	go test -run '^$' -fuzz FuzzValidateIdentifier -fuzztime 60s .
//
// The header and topic fuzzers live in message_test.go.

// FuzzBucket checks that outbox.Bucket is a pure function of its inputs
// with a range of [0, n), and that each input decides the bucket only
// where the storage format says it does: a pinned partition alone, else
// the key alone (nil and empty keys differ), else the message id alone.
// The expected value is computed by an independent FNV-1a (fnv32a in
// message_test.go).
func FuzzBucket(f *testing.F) {
	f.Add([]byte("order-1"), false, false, int32(0), "", 8)
	f.Add([]byte{}, false, false, int32(0), "", 8)
	f.Add([]byte(nil), true, false, int32(0), "0190c3b2-0000-7000-8000-000000000000", 16)
	f.Add([]byte("ignored"), false, true, int32(13), "id", 8)
	f.Add([]byte("k"), false, true, int32(2147483647), "", 4096)
	f.Add([]byte("k"), false, false, int32(0), "", 1)
	f.Add([]byte("k"), false, false, int32(0), "", 0)
	f.Add([]byte("k"), false, false, int32(0), "", -3)
	f.Add([]byte{0xff, 0x00, 0x80}, false, false, int32(0), "x", 4095)
	f.Add([]byte(nil), true, false, int32(0), "", 7)
	f.Fuzz(func(t *testing.T, key []byte, nilKey, pinned bool, partition int32, id string, n int) {
		if nilKey {
			key = nil
		} else if key == nil {
			key = []byte{}
		}
		var part *int32
		if pinned {
			if partition < 0 {
				// Refused at enqueue; the bucket of a negative partition
				// is never computed for a stored row.
				partition = -(partition + 1)
			}
			part = &partition
		}
		keyCopy := append([]byte(nil), key...)

		got := outbox.Bucket(key, part, id, n)
		if again := outbox.Bucket(key, part, id, n); again != got {
			t.Fatalf("Bucket not deterministic: %d then %d", got, again)
		}
		if n <= 0 {
			if got != 0 {
				t.Fatalf("Bucket with n=%d = %d, want 0", n, got)
			}
			return
		}
		if got < 0 || got >= n {
			t.Fatalf("Bucket = %d, outside [0, %d)", got, n)
		}
		if key != nil && string(key) != string(keyCopy) {
			t.Fatal("Bucket modified the key")
		}

		var want int
		switch {
		case pinned:
			want = int(uint32(partition) % uint32(n))
			// The key and id play no part.
			if other := outbox.Bucket([]byte("other"), part, "other-id", n); other != got {
				t.Fatalf("pinned bucket depends on key/id: %d vs %d", got, other)
			}
		case key != nil:
			want = int(uint32(fnv32a(string(key))) % uint32(n))
			// The id plays no part, and the empty key is not keyless.
			if other := outbox.Bucket(key, nil, id+"-other", n); other != got {
				t.Fatalf("keyed bucket depends on the message id: %d vs %d", got, other)
			}
		default:
			want = int(uint32(fnv32a(id)) % uint32(n))
			if viaKey := outbox.Bucket([]byte(id), nil, "", n); viaKey != got {
				t.Fatalf("keyless bucket %d differs from the bucket of the id as a key %d", got, viaKey)
			}
		}
		if got != want {
			t.Fatalf("Bucket(%q, %v, %q, %d) = %d, want %d", key, part, id, n, got, want)
		}
	})
}

// legalIdentifier is the identifier grammar written out by hand:
// ^[A-Za-z_][A-Za-z0-9_]{0,62}$.
func legalIdentifier(s string) bool {
	if len(s) < 1 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		letter := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == '_'
		digit := c >= '0' && c <= '9'
		if !letter && !(digit && i > 0) {
			return false
		}
	}
	return true
}

// FuzzValidateIdentifier checks that outbox.ValidateIdentifier accepts
// exactly ^[A-Za-z_][A-Za-z0-9_]{0,62}$, that a refusal is a *ConfigError
// naming the field, and that every configuration entry point that takes a
// table or schema name (Config.Validate, NewPlugin) agrees with it.
func FuzzValidateIdentifier(f *testing.F) {
	for _, s := range []string{
		"outbox_messages", "_", "a", "A9_", "9a", "", "a b", "a-b", "a.b", "a;b",
		`a"b`, "a`b", "a'b", "a\x00", "a\n", "ä", "é1", "x; DROP TABLE t; --",
		strings.Repeat("a", 63), strings.Repeat("a", 64), "a\u200b", "ａ",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		legal := legalIdentifier(s)
		err := outbox.ValidateIdentifier("Tables.Messages", s)
		if legal != (err == nil) {
			t.Fatalf("ValidateIdentifier(%q) = %v, want legal=%v", s, err, legal)
		}
		if err != nil {
			var ce *outbox.ConfigError
			if !errors.As(err, &ce) || ce.Field != "Tables.Messages" || !errors.Is(err, outbox.ErrInvalidConfig) {
				t.Fatalf("ValidateIdentifier(%q) error %T %v: want a *ConfigError for Tables.Messages", s, err, err)
			}
		}

		// As every table name and as the schema, through the config.
		for _, cfg := range []outbox.Config{
			{Tables: outbox.Tables{Messages: s}},
			{Tables: outbox.Tables{Leases: s}},
			{Tables: outbox.Tables{Relays: s}},
			{Tables: outbox.Tables{DeadLetters: s}},
			{Tables: outbox.Tables{Schema: s}},
		} {
			cfg = cfg.WithDefaults()
			verr := cfg.Validate()
			// A legal name may still collide with a default table name.
			collides := cfg.Tables.Messages == cfg.Tables.Leases || cfg.Tables.Messages == cfg.Tables.Relays ||
				cfg.Tables.Messages == cfg.Tables.DeadLetters || cfg.Tables.Leases == cfg.Tables.Relays ||
				cfg.Tables.Leases == cfg.Tables.DeadLetters || cfg.Tables.Relays == cfg.Tables.DeadLetters
			// An empty table name takes its default and an empty schema
			// means the connection's current one: both are valid.
			wantOK := s == "" || legal && !collides
			if wantOK != (verr == nil) {
				t.Fatalf("Config.Validate with %q in %+v = %v, want ok=%v", s, cfg.Tables, verr, wantOK)
			}
			if verr != nil && !errors.Is(verr, outbox.ErrInvalidConfig) {
				t.Fatalf("Config.Validate error is not ErrInvalidConfig: %v", verr)
			}
			if _, perr := outbox.NewPlugin(cfg); (perr == nil) != (verr == nil) {
				t.Fatalf("NewPlugin and Config.Validate disagree on %q: %v vs %v", s, perr, verr)
			}
		}
	})
}
