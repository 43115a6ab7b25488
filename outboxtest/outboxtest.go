package outboxtest

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

// Timeout bounds each database operation of the helpers, and Drain as a
// whole.
const Timeout = 30 * time.Second

// testingT is the part of testing.TB the helpers use. The exported
// functions take testing.TB; the package's own tests pass a recorder to
// check the failure messages.
type testingT interface {
	Errorf(format string, args ...any)
	FailNow()
	Helper()
}

// Message is a pending or published outbox message.
type Message struct {
	relay.Message
}

// Header returns the value of the first header named name, and whether
// there is one.
func (m Message) Header(name string) (string, bool) { return header(m.Headers, name) }

// DecodeJSON decodes the message's value, a JSON document, into v.
func (m Message) DecodeJSON(v any) error {
	if err := json.Unmarshal(m.Value, v); err != nil {
		return fmt.Errorf("outboxtest: message %s on %s: value is not the JSON of %T: %w", m.MessageID, m.Topic, v, err)
	}
	return nil
}

// String describes the message on one line: topic, key, value and
// headers, with long values shortened.
func (m Message) String() string {
	var sb strings.Builder
	sb.WriteString(m.Topic)
	if m.Key == nil {
		sb.WriteString(" keyless")
	} else {
		sb.WriteString(" key=" + printable(m.Key))
	}
	if m.Partition != nil {
		fmt.Fprintf(&sb, " partition=%d", *m.Partition)
	}
	if m.Value == nil {
		sb.WriteString(" tombstone")
	} else {
		sb.WriteString(" value=" + printable(m.Value))
	}
	for _, h := range m.Headers {
		sb.WriteString(" " + h.Key + ":" + printable(h.Value))
	}
	return sb.String()
}

func header(hs []outbox.Header, name string) (string, bool) {
	for _, h := range hs {
		if h.Key == name {
			return string(h.Value), true
		}
	}
	return "", false
}

// printable shows b as text when it is valid UTF-8, shortened, and
// quoted when it would otherwise be ambiguous; as hex otherwise.
func printable(b []byte) string {
	const limit = 120
	s := string(b)
	if !utf8.ValidString(s) {
		if len(b) > limit/2 {
			return fmt.Sprintf("0x%x...(%d bytes)", b[:limit/2], len(b))
		}
		return fmt.Sprintf("0x%x", b)
	}
	if len(s) > limit {
		s = s[:limit] + "...(" + strconv.Itoa(len(b)) + " bytes)"
	}
	doc := strings.HasPrefix(s, "{") || strings.HasPrefix(s, "[")
	if s == "" || strings.ContainsAny(s, "\t\n\r") || !doc && strings.ContainsAny(s, " \"") {
		return strconv.Quote(s)
	}
	return s
}

// Want describes an expected message. Every field left at its zero value
// asserts nothing, so Want{Topic: "orders"} matches any message on
// "orders".
type Want struct {
	// Topic is the exact topic.
	Topic string
	// Key is the exact key. Use Keyless to assert a nil key.
	Key string
	// Keyless asserts that the message has no key (nil, not empty).
	Keyless bool
	// JSON is the expected payload: it is encoded with encoding/json and
	// compared with the message's value as decoded JSON, so key order,
	// whitespace and number formatting do not matter. A struct, a map, a
	// json.RawMessage or a string literal of JSON wrapped in
	// json.RawMessage all work.
	JSON any
	// Value is the exact payload, byte for byte. Set JSON or Value, not
	// both.
	Value []byte
	// Headers are headers the message must carry, with these values. Other
	// headers (content-type, trace context) are allowed.
	Headers map[string]string
	// Partition, if set, is the pinned partition.
	Partition *int32
}

// String describes the expectation for failure messages.
func (w Want) String() string {
	var parts []string
	if w.Topic != "" {
		parts = append(parts, "topic="+w.Topic)
	}
	if w.Keyless {
		parts = append(parts, "keyless")
	} else if w.Key != "" {
		parts = append(parts, "key="+printable([]byte(w.Key)))
	}
	if w.Partition != nil {
		parts = append(parts, fmt.Sprintf("partition=%d", *w.Partition))
	}
	if w.JSON != nil {
		b, err := json.Marshal(w.JSON)
		if err != nil {
			parts = append(parts, fmt.Sprintf("json=<%v>", err))
		} else {
			parts = append(parts, "json="+printable(b))
		}
	}
	if w.Value != nil {
		parts = append(parts, "value="+printable(w.Value))
	}
	keys := make([]string, 0, len(w.Headers))
	for k := range w.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		parts = append(parts, "header "+k+":"+printable([]byte(w.Headers[k])))
	}
	if len(parts) == 0 {
		return "{any message}"
	}
	return "{" + strings.Join(parts, " ") + "}"
}

// mismatch returns why m does not match w, or "" when it does.
func (w Want) mismatch(m Message) string {
	if w.Topic != "" && m.Topic != w.Topic {
		return fmt.Sprintf("topic is %s", m.Topic)
	}
	if w.Keyless && m.Key != nil {
		return fmt.Sprintf("key is %s, want none", printable(m.Key))
	}
	if w.Key != "" && (m.Key == nil || string(m.Key) != w.Key) {
		if m.Key == nil {
			return "message is keyless"
		}
		return fmt.Sprintf("key is %s", printable(m.Key))
	}
	if w.Partition != nil && (m.Partition == nil || *m.Partition != *w.Partition) {
		if m.Partition == nil {
			return "partition is not pinned"
		}
		return fmt.Sprintf("partition is %d", *m.Partition)
	}
	if w.Value != nil && !bytes.Equal(m.Value, w.Value) {
		return fmt.Sprintf("value is %s", printable(m.Value))
	}
	if w.JSON != nil {
		if reason := jsonMismatch(w.JSON, m.Value); reason != "" {
			return reason
		}
	}
	keys := make([]string, 0, len(w.Headers))
	for k := range w.Headers {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		found := false
		for _, h := range m.Headers {
			if h.Key == k && string(h.Value) == w.Headers[k] {
				found = true
				break
			}
		}
		if !found {
			if v, ok := m.Header(k); ok {
				return fmt.Sprintf("header %s is %s", k, printable([]byte(v)))
			}
			return fmt.Sprintf("no header %s", k)
		}
	}
	return ""
}

// jsonMismatch compares want, encoded to JSON, with the JSON document got.
func jsonMismatch(want any, got []byte) string {
	wb, err := json.Marshal(want)
	if err != nil {
		return fmt.Sprintf("Want.JSON cannot be encoded: %v", err)
	}
	wv, err := decodeJSON(wb)
	if err != nil {
		return fmt.Sprintf("Want.JSON cannot be decoded: %v", err)
	}
	gv, err := decodeJSON(got)
	if err != nil {
		return fmt.Sprintf("value is not JSON: %s", printable(got))
	}
	if !reflect.DeepEqual(wv, gv) {
		return fmt.Sprintf("JSON value is %s", printable(got))
	}
	return ""
}

func decodeJSON(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, fmt.Errorf("trailing data after the JSON value")
	}
	return normalizeNumbers(v), nil
}

// normalizeNumbers rewrites json.Numbers in a canonical form, so 1, 1.0
// and 1e0 compare equal.
func normalizeNumbers(v any) any {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return strconv.FormatInt(i, 10)
		}
		if f, err := x.Float64(); err == nil {
			return strconv.FormatFloat(f, 'g', -1, 64)
		}
		return x.String()
	case map[string]any:
		for k, e := range x {
			x[k] = normalizeNumbers(e)
		}
	case []any:
		for i, e := range x {
			x[i] = normalizeNumbers(e)
		}
	}
	return v
}

// Pending returns the messages waiting in the outbox of plugin p (nil: the
// only outbox plugin on db), in enqueue order, read through db: pass a
// transaction to include what it has enqueued but not committed.
func Pending(tb testing.TB, db *gorm.DB, p *outbox.Plugin) []Message {
	tb.Helper()
	msgs, _ := pending(tb, db, p)
	return msgs
}

func pending(t testingT, db *gorm.DB, p *outbox.Plugin) ([]Message, bool) {
	t.Helper()
	p, ok := plugin(t, db, p)
	if !ok {
		return nil, false
	}
	table := p.Config().Tables.MessagesTable()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	sess := db.Session(&gorm.Session{NewDB: true, SkipHooks: true, Context: ctx})
	rows, err := sess.Raw("SELECT " + wire.MessageColumns + " FROM " +
		sess.Statement.Quote(table) + " ORDER BY id").Rows()
	if err != nil {
		failure(t, "cannot read the outbox table %s (did you run the plugin's AutoMigrate or the migrations?): %v", table, err)
		return nil, false
	}
	defer rows.Close()
	var out []Message
	for rows.Next() {
		var (
			m         Message
			headers   []byte
			partition *int64
			created   int64
			attempts  int64
			bucket    int64
		)
		if err := rows.Scan(&m.ID, &m.MessageID, &bucket, &m.Topic, &m.Key, &m.Value, &headers, &partition, &created, &attempts); err != nil {
			failure(t, "cannot read the outbox table %s: %v", table, err)
			return nil, false
		}
		if m.Headers, err = outbox.DecodeHeaders(headers); err != nil {
			failure(t, "message %d in %s: %v", m.ID, table, err)
			return nil, false
		}
		if partition != nil {
			p := int32(*partition)
			m.Partition = &p
		}
		m.Bucket = int(bucket)
		m.CreatedAt = time.UnixMilli(created)
		m.Attempts = int(attempts)
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		failure(t, "cannot read the outbox table %s: %v", table, err)
		return nil, false
	}
	return out, true
}

func plugin(t testingT, db *gorm.DB, p *outbox.Plugin) (*outbox.Plugin, bool) {
	t.Helper()
	if db == nil {
		failure(t, "a *gorm.DB is required")
		return nil, false
	}
	if p != nil {
		return p, true
	}
	p, err := outbox.Lookup(db, "")
	if err != nil {
		failure(t, "no plugin given and %v", err)
		return nil, false
	}
	return p, true
}

// RequireEnqueued asserts that exactly one pending message of the outbox
// of p (nil: the only outbox plugin on db) matches want, and returns it for
// further assertions. It fails the test when none or several match,
// listing the pending messages and why each does not match.
//
//	msg := outboxtest.RequireEnqueued(t, db, nil, outboxtest.Want{
//		Topic: "orders",
//		Key:   "order-42",
//		JSON:  OrderPlaced{ID: 42, Total: 1999},
//	})
func RequireEnqueued(tb testing.TB, db *gorm.DB, p *outbox.Plugin, want Want) Message {
	tb.Helper()
	return requireEnqueued(tb, db, p, want)
}

func requireEnqueued(t testingT, db *gorm.DB, p *outbox.Plugin, want Want) Message {
	t.Helper()
	msgs, ok := pending(t, db, p)
	if !ok {
		return Message{}
	}
	var found []Message
	for _, m := range msgs {
		if want.mismatch(m) == "" {
			found = append(found, m)
		}
	}
	switch len(found) {
	case 1:
		return found[0]
	case 0:
		failure(t, "no pending message matches %s\n%s", want, listing(msgs, want))
	default:
		failure(t, "%d pending messages match %s, want exactly one (use RequireManyEnqueued, or a Key)\n%s", len(found), want, listing(msgs, want))
	}
	return Message{}
}

// RequireNotEnqueued asserts that no pending message of the outbox of p
// (nil: the only outbox plugin on db) matches want.
func RequireNotEnqueued(tb testing.TB, db *gorm.DB, p *outbox.Plugin, want Want) {
	tb.Helper()
	requireNotEnqueued(tb, db, p, want)
}

func requireNotEnqueued(t testingT, db *gorm.DB, p *outbox.Plugin, want Want) {
	t.Helper()
	msgs, ok := pending(t, db, p)
	if !ok {
		return
	}
	for _, m := range msgs {
		if want.mismatch(m) == "" {
			failure(t, "a pending message matches %s, want none: %s", want, m)
			return
		}
	}
}

// RequireManyEnqueued asserts that the pending messages on the topics the
// wants name are exactly the wants, one message each, in enqueue order,
// and returns them. When a Want has no Topic, every pending message
// counts.
func RequireManyEnqueued(tb testing.TB, db *gorm.DB, p *outbox.Plugin, wants ...Want) []Message {
	tb.Helper()
	return requireManyEnqueued(tb, db, p, wants)
}

func requireManyEnqueued(t testingT, db *gorm.DB, p *outbox.Plugin, wants []Want) []Message {
	t.Helper()
	msgs, ok := pending(t, db, p)
	if !ok {
		return nil
	}
	topics := map[string]bool{}
	anyTopic := false
	for _, w := range wants {
		topics[w.Topic] = true
		anyTopic = anyTopic || w.Topic == ""
	}
	var got []Message
	for _, m := range msgs {
		if anyTopic || topics[m.Topic] {
			got = append(got, m)
		}
	}
	var sb strings.Builder
	for i := range max(len(got), len(wants)) {
		switch {
		case i >= len(wants):
			fmt.Fprintf(&sb, "\n  #%d unexpected: %s", i+1, got[i])
		case i >= len(got):
			fmt.Fprintf(&sb, "\n  #%d missing: %s", i+1, wants[i])
		default:
			if reason := wants[i].mismatch(got[i]); reason != "" {
				fmt.Fprintf(&sb, "\n  #%d want %s: %s (%s)", i+1, wants[i], reason, got[i])
			}
		}
	}
	if sb.Len() > 0 {
		failure(t, "pending messages differ from the %d expected, in enqueue order:%s", len(wants), sb.String())
		return nil
	}
	return got
}

// listing describes the pending messages and why each does not match.
func listing(msgs []Message, want Want) string {
	const limit = 20
	if len(msgs) == 0 {
		return "the outbox has no pending message"
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "pending messages (%d):", len(msgs))
	for i, m := range msgs {
		if i == limit {
			fmt.Fprintf(&sb, "\n  ... and %d more", len(msgs)-limit)
			break
		}
		fmt.Fprintf(&sb, "\n  #%d %s", i+1, m)
		if reason := want.mismatch(m); reason != "" {
			fmt.Fprintf(&sb, "\n     not a match: %s", reason)
		}
	}
	return sb.String()
}

// Drain publishes every pending message of the outbox of p (nil: the only
// outbox plugin on db) once, the way a relay does (gormrelay.NewStore and
// (*relay.Relay).DrainOnce), into a recorder instead of Kafka, and returns what was
// published in enqueue order. The published rows are deleted, so the
// outbox is empty afterwards. Pass the database, not a transaction: only
// committed messages are drained.
//
// Drain fails the test if the relay fails, for example on a relay that
// cannot start on the tables (missing migrations). A relay running
// concurrently on the same tables may publish some messages itself; Drain
// returns only those it published.
func Drain(tb testing.TB, db *gorm.DB, p *outbox.Plugin) []Message {
	tb.Helper()
	return drain(tb, db, p)
}

func drain(t testingT, db *gorm.DB, p *outbox.Plugin) []Message {
	t.Helper()
	p, ok := plugin(t, db, p)
	if !ok {
		return nil
	}
	store, err := gormrelay.NewStore(db, p.Config())
	if err != nil {
		failure(t, "%v", err)
		return nil
	}
	var (
		mu        sync.Mutex
		published []Message
	)
	rec := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range msgs {
			published = append(published, Message{m})
		}
		return len(msgs), nil
	})
	r, err := relay.New(store, rec, relay.Config{
		BucketCount: p.Config().BucketCount,
		Logger:      slog.New(slog.DiscardHandler),
	})
	if err != nil {
		failure(t, "%v", err)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if _, err := r.DrainOnce(ctx); err != nil {
		failure(t, "drain %s: %v", p.Config().Tables.MessagesTable(), err)
		return nil
	}
	mu.Lock()
	defer mu.Unlock()
	slices.SortFunc(published, func(a, b Message) int { return cmp.Compare(a.ID, b.ID) })
	return published
}

// failure fails the test with a message under a common header.
func failure(t testingT, format string, args ...any) {
	t.Helper()
	t.Errorf("\n    outbox assertion failure:\n    %s\n", strings.ReplaceAll(fmt.Sprintf(format, args...), "\n", "\n    "))
	t.FailNow()
}
