package inbox

import (
	"errors"
	"fmt"
)

// ErrNoMessageID is wrapped by every *MessageIDError.
var ErrNoMessageID = errors.New("inbox: record has no usable message id")

// MessageIDError reports a record Process cannot deduplicate: it has no
// message-id header, an empty one, or one longer than MessageIDMaxLen.
// Nothing ran and nothing was recorded. Retrying cannot help: the record
// is not from the outbox (or from a publisher with another
// MessageIDHeader). Config.AllowMissingID processes such records without
// deduplication instead.
type MessageIDError struct {
	Topic     string
	Partition int32
	Offset    int64
	Header    string // the header looked for
	Reason    string // "missing", "empty" or "longer than 64 bytes"
}

func (e *MessageIDError) Error() string {
	return fmt.Sprintf("inbox: record %s/%d@%d: message id header %q %s (set Config.AllowMissingID to process such records without deduplication)",
		e.Topic, e.Partition, e.Offset, e.Header, e.Reason)
}

// Unwrap lets errors.Is(err, ErrNoMessageID) match.
func (e *MessageIDError) Unwrap() error { return ErrNoMessageID }

// HandlerError wraps the error a handler returned. Its transaction was
// rolled back: neither the handler's writes nor the message id were
// committed, so a redelivery runs the handler again.
type HandlerError struct {
	MessageID string
	Err       error
}

func (e *HandlerError) Error() string {
	return fmt.Sprintf("inbox: handler of message %s: %v", e.MessageID, e.Err)
}

func (e *HandlerError) Unwrap() error { return e.Err }
