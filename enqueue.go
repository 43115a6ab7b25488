package outbox

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"
)

// Enqueue writes msgs to the outbox of the only outbox plugin registered
// on tx. See Plugin.Enqueue.
func Enqueue(tx *gorm.DB, msgs ...*Message) error {
	p, err := lookup(tx)
	if err != nil {
		return err
	}
	return p.Enqueue(tx, msgs...)
}

// EnqueueJSON serializes v to JSON once and enqueues it with key on the
// only outbox plugin registered on tx. See Plugin.EnqueueJSON.
func EnqueueJSON(tx *gorm.DB, topic string, key []byte, v any, headers ...Header) error {
	p, err := lookup(tx)
	if err != nil {
		return err
	}
	return p.EnqueueJSON(tx, topic, key, v, headers...)
}

// Enqueue writes msgs to the outbox in tx, the transaction that does the
// business write: they become visible to the relay when tx commits and
// vanish if it rolls back. The relay is woken after the commit.
//
// tx must be inside a transaction (db.Transaction, or Begin before
// Commit); otherwise Enqueue writes nothing and returns ErrNoTransaction.
// Every message is validated first: a bad one (invalid topic, too large,
// negative partition, empty header name) writes nothing, returns a
// *MessageError or *TooLargeError, and should make the caller roll back.
// Enqueue fills in an empty Message.ID.
//
// When tx's context (tx.WithContext(ctx)) holds a valid OpenTelemetry span
// context, Enqueue adds the W3C traceparent and tracestate headers to every
// message that carries neither, so the consumer's span joins the request
// that caused the event. Messages built by publish rules get them from the
// write's context the same way.
func (p *Plugin) Enqueue(tx *gorm.DB, msgs ...*Message) error {
	if tx == nil || !inTransaction(tx.Statement.ConnPool) {
		return ErrNoTransaction
	}
	if len(msgs) == 0 {
		return nil
	}
	return p.write(tx, msgs)
}

// EnqueueJSON serializes v to JSON once, here in the transaction, and
// enqueues it with the given key (nil for keyless) and headers, adding a
// "content-type: application/json" header. See Enqueue.
func (p *Plugin) EnqueueJSON(tx *gorm.DB, topic string, key []byte, v any, headers ...Header) error {
	m, err := JSONMessage(topic, key, v, headers...)
	if err != nil {
		return err
	}
	return p.Enqueue(tx, m)
}

// JSONMessage builds a message whose value is v serialized to JSON, with
// a "content-type: application/json" header after the given ones. Rules
// use it to build their messages.
func JSONMessage(topic string, key []byte, v any, headers ...Header) (*Message, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, &MessageError{Field: "Value", Topic: topic, Reason: "JSON encoding: " + err.Error()}
	}
	hs := make([]Header, 0, len(headers)+1)
	hs = append(hs, headers...)
	hs = append(hs, Header{Key: "content-type", Value: []byte("application/json")})
	return &Message{Topic: topic, Key: key, Value: b, Headers: hs}, nil
}

// insertChunk bounds the rows of one INSERT: 500 rows of 8 parameters
// stay far below every supported database's parameter limit.
const insertChunk = 500

const insertColumns = "(message_id, bucket, topic, msg_key, msg_value, headers, msg_partition, created_at_ms)"

// write validates msgs and inserts them through tx's connection, as raw
// SQL so no GORM callback (and so no outbox rule) runs again for it.
func (p *Plugin) write(tx *gorm.DB, msgs []*Message) error {
	for _, m := range msgs {
		if m == nil {
			return &MessageError{Field: "Message", Reason: "nil message"}
		}
		// The trace of the request that writes the message travels with it
		// (tracing.go); added first so the size check includes it.
		injectTraceContext(tx.Statement.Context, m)
		if err := m.validate(p.cfg.MaxMessageBytes); err != nil {
			return err
		}
	}
	now := time.Now().UnixMilli()
	conn := p.findTx(tx.Statement.ConnPool)
	exec := tx.Session(&gorm.Session{NewDB: true, SkipHooks: true})
	table := exec.Statement.Quote(p.cfg.Tables.MessagesTable())
	for start := 0; start < len(msgs); start += insertChunk {
		chunk := msgs[start:min(start+insertChunk, len(msgs))]
		var sb strings.Builder
		sb.Grow(64 + len(chunk)*26)
		sb.WriteString("INSERT INTO ")
		sb.WriteString(table)
		sb.WriteString(" ")
		sb.WriteString(insertColumns)
		sb.WriteString(" VALUES ")
		args := make([]any, 0, len(chunk)*8)
		for i, m := range chunk {
			if m.ID == "" {
				id, err := newMessageID()
				if err != nil {
					return err
				}
				m.ID = id
			}
			bucket := Bucket(m.Key, m.Partition, m.ID, p.cfg.BucketCount)
			if i > 0 {
				sb.WriteString(",")
			}
			sb.WriteString("(?,?,?,?,?,?,?,?)")
			args = append(args, m.ID, bucket, m.Topic, nullBytes(m.Key), nullBytes(m.Value), nullBytes(EncodeHeaders(m.Headers)), m.Partition, now)
			if conn != nil {
				conn.record(bucket)
			}
		}
		if err := exec.Exec(sb.String(), args...).Error; err != nil {
			return fmt.Errorf("outbox: write %d message(s) to %s: %w", len(chunk), p.cfg.Tables.MessagesTable(), err)
		}
	}
	return nil
}

// nullBytes turns a nil slice into an untyped nil so every driver writes
// NULL, and keeps an empty, non-nil slice as an empty value.
func nullBytes(b []byte) any {
	if b == nil {
		return nil
	}
	return b
}
