package ops

import (
	"encoding/base64"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// MaybeDeliveredPrefix starts the line of a stored error text (the
// last_error of a message or a dead letter) that says a copy of the
// message may already have reached the sink although it was not
// acknowledged. The failure policy writes it; DeliveryNote reads it back.
const MaybeDeliveredPrefix = "may have been delivered: "

// DeliveryNote returns the "may have been delivered: ..." line of a stored
// error text, or "" if it has none.
func DeliveryNote(lastError string) string {
	for line := range strings.SplitSeq(lastError, "\n") {
		if strings.HasPrefix(line, MaybeDeliveredPrefix) {
			return line
		}
	}
	return ""
}

// sinkErrorMark separates a recorded failure's cause, in plain words, from
// the sink's own error text (see publisher.Error).
const sinkErrorMark = "; sink error: "

// ErrorCause returns the part of a stored error text that a list shows
// whole: the cause in plain words and where it happened (topic,
// partition, message id, key), without the sink's raw text and the
// delivery note; whitespace runs become one space. A text without the
// "; sink error: " mark (recorded by an older release, or by a publisher
// that does not write one) is returned whole.
func ErrorCause(lastError string) string {
	var lines []string
	for line := range strings.SplitSeq(lastError, "\n") {
		if !strings.HasPrefix(line, MaybeDeliveredPrefix) {
			lines = append(lines, line)
		}
	}
	s := strings.Join(lines, "\n")
	if i := strings.Index(s, sinkErrorMark); i > 0 {
		s = s[:i]
	}
	return strings.Join(strings.Fields(s), " ")
}

// ParseTime parses a time given to the operator tools: RFC 3339, or a Go
// duration ("72h", "30m") meaning that long before now. Empty is the zero
// time. Its errors wrap ErrInvalidRequest and say what is wrong with s.
func ParseTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, invalidf("negative duration %q", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, invalidf("%q is neither an RFC 3339 time nor a duration such as 72h", s)
	}
	return t, nil
}

// invalidf is an ErrInvalidRequest with a message of its own.
func invalidf(format string, args ...any) error {
	return &invalidError{fmt.Sprintf(format, args...)}
}

type invalidError struct{ msg string }

func (e *invalidError) Error() string { return e.msg }
func (e *invalidError) Unwrap() error { return ErrInvalidRequest }

// ParseDeadLetterQuery reads a dead-letter filter from URL query
// parameters, as opshttp's GET /dead-letters and the web UI take them:
// topic, key (or key_base64, or keyless=true), state, bucket, since, until
// (ParseTime, relative to now), limit and cursor. A present but empty key
// selects the empty key. Every error it returns describes a malformed
// parameter and wraps ErrInvalidRequest.
func ParseDeadLetterQuery(v url.Values, now time.Time) (DeadLetterQuery, error) {
	q := DeadLetterQuery{Topic: v.Get("topic"), State: DeadLetterState(v.Get("state")), Cursor: v.Get("cursor")}
	var err error
	if q.Key, err = ParseKey(v.Has("key"), v.Get("key"), v.Get("key_base64")); err != nil {
		return q, err
	}
	if s := v.Get("keyless"); s != "" {
		if q.Keyless, err = strconv.ParseBool(s); err != nil {
			return q, invalidf("keyless: %v", err)
		}
	}
	if s := v.Get("bucket"); s != "" {
		b, err := strconv.Atoi(s)
		if err != nil {
			return q, invalidf("bucket: %v", err)
		}
		q.Bucket = &b
	}
	if s := v.Get("limit"); s != "" {
		if q.Limit, err = strconv.Atoi(s); err != nil {
			return q, invalidf("limit: %v", err)
		}
	}
	if q.Since, err = ParseTime(v.Get("since"), now); err != nil {
		return q, invalidf("since: %v", err)
	}
	if q.Until, err = ParseTime(v.Get("until"), now); err != nil {
		return q, invalidf("until: %v", err)
	}
	return q, nil
}

// ParseKey reads a key given as text (hasText: the parameter is present,
// even empty) or as base64; nil when neither is given. Its errors wrap
// ErrInvalidRequest.
func ParseKey(hasText bool, text, b64 string) ([]byte, error) {
	switch {
	case hasText && b64 != "":
		return nil, invalidf("give key or key_base64, not both")
	case hasText:
		return []byte(text), nil
	case b64 != "":
		k, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			return nil, invalidf("key_base64: %v", err)
		}
		return k, nil
	}
	return nil, nil
}
