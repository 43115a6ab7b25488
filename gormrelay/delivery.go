package gormrelay

import (
	"errors"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/gorm-outbox/outbox/ops"
)

// A stored error text (last_error of a message or a dead letter) ends
// with a line starting with maybeDeliveredPrefix when the relay learned
// that a copy of the message may already have reached Kafka although it
// was not acknowledged: the publisher said the failed record may have been
// written (its outcome is unknown), or the broker acknowledged the message
// in a batch whose earlier message failed, so the relay publishes it again.
// The line stays through later failures and into the dead-letter table;
// DeadLetter.MaybeDelivered and DeliveryNote read it back.
const maybeDeliveredPrefix = ops.MaybeDeliveredPrefix

// noteOutcomeUnknown is the note of a message whose publish may have
// written it although the publisher reported it failed.
const noteOutcomeUnknown = maybeDeliveredPrefix + "a publish was attempted and its outcome is unknown"

// noteLaterAcked is the note of a message the broker acknowledged (or
// whose outcome is unknown) after failedID, an earlier message of its
// batch, failed.
func noteLaterAcked(failedID string) string {
	return maybeDeliveredPrefix + "it was sent in a batch whose earlier message " + strconv.Quote(failedID) +
		" failed; the broker acknowledged it or did not answer, and the relay publishes it again"
}

// writeOutcome is what a publisher's error says about records that may have
// been written although they were not acknowledged. publisher.Error
// implements it; gormrelay does not import the publisher.
type writeOutcome interface {
	// MaybeWrittenIDs returns whether the failed message may have been
	// written, and the MessageIDs of the later messages of its batch that
	// may have been.
	MaybeWrittenIDs() (failed bool, later []string)
}

// outcomeOf reads the write outcome out of a publish error.
func outcomeOf(err error) (failed bool, later []string) {
	var o writeOutcome
	if errors.As(err, &o) {
		return o.MaybeWrittenIDs()
	}
	return false, nil
}

// DeliveryNote returns the "may have been delivered: ..." line of a stored
// error text, or "" if it has none (ops.DeliveryNote).
func DeliveryNote(lastError string) string { return ops.DeliveryNote(lastError) }

// errorText is the text stored for a failure with cause text: cut to fit
// lastErrorMax together with note (if any), which goes on its own last
// line.
func errorText(text, note string) string {
	if note == "" {
		return cutText(text, lastErrorMax)
	}
	return cutText(text, lastErrorMax-len(note)-1) + "\n" + note
}

// withNote adds the delivery note of old, if any, to text that has none.
func withNote(text string, old *string) string {
	if DeliveryNote(text) != "" || old == nil {
		return text
	}
	if note := DeliveryNote(*old); note != "" {
		return errorText(text, note)
	}
	return text
}

// cutText shortens s to at most n bytes, at a word boundary when there is
// one in its last quarter, and says so: " [... cut, N bytes in all]".
func cutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	marker := " [... cut, " + strconv.Itoa(len(s)) + " bytes in all]"
	n -= len(marker)
	if n <= 0 {
		return truncateUTF8(s, max(n+len(marker), 0))
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	cut := s[:n]
	if i := strings.LastIndexAny(cut, " \n\t"); i > len(cut)*3/4 {
		cut = cut[:i]
	}
	return cut + marker
}

// ErrorCause returns the part of a stored error text that a list shows
// whole (ops.ErrorCause).
func ErrorCause(lastError string) string { return ops.ErrorCause(lastError) }
