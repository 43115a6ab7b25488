package ops

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/gorm-outbox/outbox/relay"
)

// DeadLetterState is the state of a dead letter.
type DeadLetterState string

const (
	// DeadLetterFailed is a message that exhausted the failure policy.
	DeadLetterFailed DeadLetterState = "failed"
	// DeadLetterParked is a message that did not fail itself but was held
	// back because an earlier message of its key (in its bucket) is a dead
	// letter: publishing it would deliver the key out of order.
	DeadLetterParked DeadLetterState = "parked"
)

// DeadLetter is a message taken out of the backlog by the failure policy.
type DeadLetter struct {
	// ID is the message's row id in the messages table when it died.
	ID        int64
	MessageID string
	Bucket    int
	Topic     string
	// Key is nil for a keyless message.
	Key []byte
	// Value and Headers are read by Operator.DeadLetter only; lists leave
	// them nil and report ValueSize.
	Value     []byte
	Headers   []relay.Header
	ValueSize int
	Partition *int32
	CreatedAt time.Time
	DeadAt    time.Time
	Attempts  int
	// LastError is the last publish error: its cause in plain words first,
	// then the sink's own text. It ends with DeliveryNote's line when
	// MaybeDelivered.
	LastError string
	State     DeadLetterState
	// MaybeDelivered reports that an earlier copy of the message may
	// already have reached Kafka, and so its consumers: the relay sent it
	// and never learned the outcome, or the broker acknowledged it in a
	// batch whose earlier message failed. Requeueing it may deliver it
	// twice; a parked message with MaybeDelivered may have been seen by
	// consumers before the dead letter of its key. False means the relay
	// knows of no such copy.
	MaybeDelivered bool
	// DeliveryNote says why MaybeDelivered is true; "" otherwise.
	DeliveryNote string
}

// SetDelivery derives MaybeDelivered and DeliveryNote from LastError.
func (d *DeadLetter) SetDelivery() {
	d.DeliveryNote = DeliveryNote(d.LastError)
	d.MaybeDelivered = d.DeliveryNote != ""
}

// deadLetterJSON is the JSON form of a DeadLetter.
type deadLetterJSON struct {
	ID          int64           `json:"id"`
	MessageID   string          `json:"message_id"`
	Bucket      int             `json:"bucket"`
	Topic       string          `json:"topic"`
	Key         *string         `json:"key,omitempty"`
	KeyBase64   *string         `json:"key_base64,omitempty"`
	Keyless     bool            `json:"keyless,omitempty"`
	ValueBase64 *string         `json:"value_base64,omitempty"`
	ValueSize   int             `json:"value_size"`
	Headers     []headerJSON    `json:"headers,omitempty"`
	Partition   *int32          `json:"partition,omitempty"`
	CreatedAt   time.Time       `json:"created_at"`
	DeadAt      time.Time       `json:"dead_at"`
	Attempts    int             `json:"attempts"`
	LastError   string          `json:"last_error,omitempty"`
	State       DeadLetterState `json:"state"`
	// MaybeDelivered and DeliveryNote are derived from LastError.
	MaybeDelivered bool   `json:"maybe_delivered"`
	DeliveryNote   string `json:"delivery_note,omitempty"`
}

type headerJSON struct {
	Key         string  `json:"key"`
	Value       *string `json:"value,omitempty"`
	ValueBase64 *string `json:"value_base64,omitempty"`
}

// MarshalJSON encodes a dead letter with snake_case names. The key is
// given as text ("key") when it is valid UTF-8 and as base64
// ("key_base64") otherwise, and "keyless" is true for a keyless message;
// the value, when loaded, as base64 ("value_base64"); header values as
// text or base64 likewise. UnmarshalJSON reads it back.
func (d DeadLetter) MarshalJSON() ([]byte, error) {
	v := deadLetterJSON{ID: d.ID, MessageID: d.MessageID, Bucket: d.Bucket, Topic: d.Topic, ValueSize: d.ValueSize, Partition: d.Partition,
		CreatedAt: d.CreatedAt, DeadAt: d.DeadAt, Attempts: d.Attempts, LastError: d.LastError, State: d.State,
		MaybeDelivered: d.MaybeDelivered, DeliveryNote: d.DeliveryNote}
	v.Key, v.KeyBase64 = textOrBase64(d.Key)
	v.Keyless = d.Key == nil
	if d.Value != nil {
		s := base64.StdEncoding.EncodeToString(d.Value)
		v.ValueBase64 = &s
	}
	for _, h := range d.Headers {
		t, b := textOrBase64(h.Value)
		v.Headers = append(v.Headers, headerJSON{Key: h.Key, Value: t, ValueBase64: b})
	}
	return json.Marshal(v)
}

// UnmarshalJSON decodes the form MarshalJSON writes, as the admin HTTP
// API and outboxctl --json print it.
func (d *DeadLetter) UnmarshalJSON(b []byte) error {
	var v deadLetterJSON
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	out := DeadLetter{ID: v.ID, MessageID: v.MessageID, Bucket: v.Bucket, Topic: v.Topic, ValueSize: v.ValueSize, Partition: v.Partition,
		CreatedAt: v.CreatedAt, DeadAt: v.DeadAt, Attempts: v.Attempts, LastError: v.LastError, State: v.State}
	out.SetDelivery()
	var err error
	if out.Key, err = fromTextOrBase64(v.Key, v.KeyBase64); err != nil {
		return fmt.Errorf("outbox: dead letter %d: key_base64: %w", v.ID, err)
	}
	if out.Value, err = fromTextOrBase64(nil, v.ValueBase64); err != nil {
		return fmt.Errorf("outbox: dead letter %d: value_base64: %w", v.ID, err)
	}
	for _, h := range v.Headers {
		val, err := fromTextOrBase64(h.Value, h.ValueBase64)
		if err != nil {
			return fmt.Errorf("outbox: dead letter %d: header %q: %w", v.ID, h.Key, err)
		}
		out.Headers = append(out.Headers, relay.Header{Key: h.Key, Value: val})
	}
	*d = out
	return nil
}

func fromTextOrBase64(text, b64 *string) ([]byte, error) {
	switch {
	case text != nil:
		return []byte(*text), nil
	case b64 != nil:
		return base64.StdEncoding.DecodeString(*b64)
	}
	return nil, nil
}

func textOrBase64(b []byte) (text, b64 *string) {
	if b == nil {
		return nil, nil
	}
	if utf8.Valid(b) {
		s := string(b)
		return &s, nil
	}
	s := base64.StdEncoding.EncodeToString(b)
	return nil, &s
}

// DeadLetterQuery selects dead letters. Zero fields select everything.
type DeadLetterQuery struct {
	// Topic, if set, selects that topic only.
	Topic string
	// Key, if non-nil, selects that key only (an empty, non-nil key is the
	// empty key). Keyless dead letters are selected with Keyless.
	Key     []byte
	Keyless bool
	// State, if set, selects failed or parked dead letters only.
	State DeadLetterState
	// Bucket, if non-nil, selects one bucket.
	Bucket *int
	// Since and Until bound the time the message died: Since <= DeadAt <
	// Until. Zero means unbounded.
	Since, Until time.Time
	// Limit is the page size, 1 to 1000. Default 50.
	Limit int
	// Cursor continues a listing where the previous page ended
	// (DeadLetterPage.Next). Empty starts with the newest.
	Cursor string
}

// DeadLetterPage is one page of dead letters, newest first.
type DeadLetterPage struct {
	Items []DeadLetter `json:"items"`
	// Next is the cursor of the next page; empty on the last page.
	Next string `json:"next,omitempty"`
}

// Dead-letter page sizes.
const (
	DeadLetterPageDefault = 50
	DeadLetterPageMax     = 1000
)

// Cursor is a position in a dead-letter listing: the last item of a page,
// by the time it died (in milliseconds) and its id. The next page starts
// after it.
type Cursor struct {
	DeadAtMs int64
	ID       int64
}

// CursorAfter is the cursor continuing a listing after d.
func CursorAfter(d DeadLetter) string {
	return strconv.FormatInt(d.DeadAt.UnixMilli(), 10) + "." + strconv.FormatInt(d.ID, 10)
}

// Check validates q as every Operator does: the page size (0 is
// DeadLetterPageDefault), Key and Keyless together, the state and the
// cursor. It returns the page size and the cursor to continue after (nil
// to start with the newest); every error wraps ErrInvalidRequest.
func (q DeadLetterQuery) Check() (limit int, after *Cursor, err error) {
	limit = q.Limit
	switch {
	case limit == 0:
		limit = DeadLetterPageDefault
	case limit < 0 || limit > DeadLetterPageMax:
		return 0, nil, fmt.Errorf("%w: limit %d outside 1..%d", ErrInvalidRequest, limit, DeadLetterPageMax)
	}
	if q.Key != nil && q.Keyless {
		return 0, nil, fmt.Errorf("%w: Key and Keyless exclude each other", ErrInvalidRequest)
	}
	switch q.State {
	case "", DeadLetterFailed, DeadLetterParked:
	default:
		return 0, nil, fmt.Errorf("%w: state %q is neither %q nor %q", ErrInvalidRequest, q.State, DeadLetterFailed, DeadLetterParked)
	}
	if q.Cursor == "" {
		return limit, nil, nil
	}
	a, b, ok := strings.Cut(q.Cursor, ".")
	var c Cursor
	if ok {
		if c.DeadAtMs, err = strconv.ParseInt(a, 10, 64); err == nil {
			c.ID, err = strconv.ParseInt(b, 10, 64)
		}
	}
	if !ok || err != nil {
		return 0, nil, fmt.Errorf("%w: malformed cursor %q", ErrInvalidRequest, q.Cursor)
	}
	return limit, &c, nil
}
