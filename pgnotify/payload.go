package pgnotify

import (
	"encoding/base64"
	"encoding/hex"
	"slices"
	"strconv"
	"strings"

	"github.com/gorm-outbox/outbox"
)

// Payload format, version 1:
//
//	h1:<sender>:<token>[,<token>...]
//
// sender is the publishing Transport's random id (12 lowercase hex
// digits), used to recognise and skip our own echoes. Each token is a
// decimal bucket id, "-1" for outbox.UnknownBucket, or "~" followed by a
// bitmap in unpadded base64url where bit i (byte i/8, bit i%8, least
// significant first) names bucket i. The encoder uses whichever of the
// decimal list and the bitmap is shorter, so the payload stays far below
// PostgreSQL's 8000-byte NOTIFY limit for every bucket count: all 4096
// buckets take 683 bitmap characters.
//
// A receiver that cannot parse a payload (a newer format, a foreign
// sender on the channel) treats it as one outbox.UnknownBucket: something
// was committed, look for it.
const payloadVersion = "h1"

// MaxPayloadBytes is PostgreSQL's limit for a NOTIFY payload (it must be
// shorter than 8000 bytes in the default configuration). Encoded hints
// never come close; the limit is checked anyway.
const MaxPayloadBytes = 7999

const senderLen = 12

var b64 = base64.RawURLEncoding

// encodePayload encodes buckets (any order, duplicates allowed) for the
// sender. Ids outside 0..outbox.BucketCountMax-1 become UnknownBucket.
func encodePayload(sender string, buckets []int) string {
	ids := make([]int, 0, len(buckets))
	unknown := false
	for _, b := range buckets {
		if b < 0 || b >= outbox.BucketCountMax {
			unknown = true
			continue
		}
		ids = append(ids, b)
	}
	slices.Sort(ids)
	ids = slices.Compact(ids)

	var sb strings.Builder
	sb.Grow(len(payloadVersion) + 2 + senderLen + 8 + 5*len(ids))
	sb.WriteString(payloadVersion)
	sb.WriteByte(':')
	sb.WriteString(sender)
	sb.WriteByte(':')
	first := true
	sep := func() {
		if !first {
			sb.WriteByte(',')
		}
		first = false
	}
	if unknown {
		sep()
		sb.WriteString("-1")
	}
	if len(ids) > 0 {
		listLen := len(ids) - 1 // commas
		for _, id := range ids {
			listLen += decimalLen(id)
		}
		bitmapBytes := ids[len(ids)-1]/8 + 1
		if 1+b64.EncodedLen(bitmapBytes) < listLen {
			bitmap := make([]byte, bitmapBytes)
			for _, id := range ids {
				bitmap[id/8] |= 1 << (uint(id) % 8)
			}
			sep()
			sb.WriteByte('~')
			sb.WriteString(b64.EncodeToString(bitmap))
		} else {
			var num [8]byte
			for _, id := range ids {
				sep()
				sb.Write(strconv.AppendInt(num[:0], int64(id), 10))
			}
		}
	}
	return sb.String()
}

func decimalLen(n int) int {
	l := 1
	for n >= 10 {
		n /= 10
		l++
	}
	return l
}

// decodePayload calls fn for each bucket in payload and returns the
// sender. ok is false when the payload is not a valid version-1 payload;
// fn has then been called once with UnknownBucket, and no more.
func decodePayload(payload string, fn func(bucket int)) (sender string, ok bool) {
	sender, body, ok := splitPayload(payload)
	// Validate everything before the first call, so a malformed payload
	// produces exactly one UnknownBucket and no partial list.
	if !ok || !validBody(body) {
		fn(outbox.UnknownBucket)
		return sender, false
	}
	eachBucket(body, fn)
	return sender, true
}

// eachBucket calls fn for each bucket of a body validBody accepted.
func eachBucket(body string, fn func(bucket int)) {
	for tok := range strings.SplitSeq(body, ",") {
		if bitmap, isBitmap := strings.CutPrefix(tok, "~"); isBitmap {
			raw, _ := b64.DecodeString(bitmap) // validated
			for i, by := range raw {
				for by != 0 {
					bit := 0
					for by&(1<<uint(bit)) == 0 {
						bit++
					}
					fn(i*8 + bit)
					by &^= 1 << uint(bit)
				}
			}
			continue
		}
		n, _ := strconv.Atoi(tok) // validated
		fn(n)
	}
}

func splitPayload(payload string) (sender, body string, ok bool) {
	version, rest, ok := strings.Cut(payload, ":")
	if !ok || version != payloadVersion {
		return "", "", false
	}
	sender, body, ok = strings.Cut(rest, ":")
	if !ok || len(sender) != senderLen || body == "" {
		return "", "", false
	}
	if _, err := hex.DecodeString(sender); err != nil {
		return "", "", false
	}
	return sender, body, true
}

func validBody(body string) bool {
	for tok := range strings.SplitSeq(body, ",") {
		if bitmap, isBitmap := strings.CutPrefix(tok, "~"); isBitmap {
			raw, err := b64.DecodeString(bitmap)
			if err != nil || len(raw) == 0 || len(raw) > outbox.BucketCountMax/8 {
				return false
			}
			continue
		}
		if tok == "" || len(tok) > 5 {
			return false
		}
		n, err := strconv.Atoi(tok)
		if err != nil || n < outbox.UnknownBucket || n >= outbox.BucketCountMax {
			return false
		}
	}
	return true
}
