package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/sqlrows"
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

// write prepares msgs and inserts them through tx's connection (see
// insert).
func (p *Plugin) write(tx *gorm.DB, msgs []*Message) error {
	for _, m := range msgs {
		if err := p.prepare(tx.Statement.Context, m); err != nil {
			return err
		}
	}
	return p.insertPrepared(tx, msgs)
}

// prepare readies one message for writing and checks it, once: a nil
// message is refused, the trace of the request that writes it (ctx's
// span context) is added to its headers (tracing.go), and it is
// validated, trace headers included, against the configured Limits and
// MaxMessageBytes. Enqueue prepares its messages in write; the
// messages of publish rules are prepared by runRules, so that a refusal
// names the rule, and go to insertPrepared.
func (p *Plugin) prepare(ctx context.Context, m *Message) error {
	if m == nil {
		return &MessageError{Field: "Message", Reason: "nil message"}
	}
	injectTraceContext(ctx, m)
	return m.validate(p.cfg.Limits, p.cfg.MaxMessageBytes)
}

// insertPrepared inserts messages that prepare accepted through tx's
// connection, as raw SQL so no GORM callback (and so no outbox rule)
// runs again for it; in WAL mode it emits them instead. On MySQL it
// refuses a message larger than the server's max_allowed_packet.
func (p *Plugin) insertPrepared(tx *gorm.DB, msgs []*Message) error {
	if p.cfg.Mode == ModeWAL {
		return p.emit(tx, msgs)
	}
	style := placeholderStyle(tx.Dialector.Name())
	packetLimit := 0
	if tx.Dialector.Name() == "mysql" {
		packetLimit = p.mysqlPacketLimit(tx)
	}
	if packetLimit > 0 {
		for _, m := range msgs {
			if size := m.Size(); size+packetOverhead > packetLimit {
				return &TooLargeError{Topic: m.Topic, Size: size, Limit: packetLimit - packetOverhead, Setting: "max_allowed_packet"}
			}
		}
	}
	budget := statementBytes
	if packetLimit > 0 {
		budget = min(budget, packetLimit-packetOverhead)
	}
	now := time.Now().UnixMilli()
	conn := p.findTx(tx.Statement.ConnPool)
	table := tx.Statement.Quote(p.cfg.Tables.MessagesTable())
	for start := 0; start < len(msgs); {
		// One statement holds at most sqlrows.InsertChunk rows and, unless a
		// single message is larger, statementBytes of payload.
		end, bytes := start, 0
		for end < len(msgs) && end-start < sqlrows.InsertChunk {
			size := msgs[end].Size() + rowOverhead
			if end > start && bytes+size > budget {
				break
			}
			bytes += size
			end++
		}
		chunk := msgs[start:end]
		start = end
		args := make([]any, 0, len(chunk)*sqlrows.InsertArgs)
		for _, m := range chunk {
			bucket, err := p.identify(m)
			if err != nil {
				return err
			}
			var partition any
			if m.Partition != nil {
				partition = int64(*m.Partition)
			}
			args = append(args, m.ID, bucket, m.Topic, sqlrows.NullBytes(m.Key), sqlrows.NullBytes(m.Value), sqlrows.NullBytes(EncodeHeaders(m.Headers)), partition, now)
			if conn != nil {
				conn.record(bucket)
			}
		}
		if err := p.insert(tx, conn, style, table, len(chunk), args); err != nil {
			return fmt.Errorf("outbox: write %d message(s) to %s: %w", len(chunk), p.cfg.Tables.MessagesTable(), err)
		}
	}
	return nil
}

// identify fills in an empty m.ID and returns m's bucket.
func (p *Plugin) identify(m *Message) (int, error) {
	if m.ID == "" {
		id, err := newMessageID()
		if err != nil {
			return 0, err
		}
		m.ID = id
	}
	return Bucket(m.Key, m.Partition, m.ID, p.cfg.BucketCount), nil
}

const (
	// statementBytes bounds the payload of one multi-row INSERT, so a
	// batch of large messages becomes several statements of a sane size.
	statementBytes = 4 << 20
	// rowOverhead approximates the bytes of a row besides key, value and
	// headers: id, topic, bucket, partition, time, placeholders.
	rowOverhead = 400
	// packetOverhead is the room left in MySQL's max_allowed_packet for
	// the statement around one message.
	packetOverhead = 16 << 10
)

// mysqlPacketLimit returns the server's max_allowed_packet, read once
// through the write's connection; 0 when it cannot be read. A statement
// larger than it makes MySQL and MariaDB drop the connection, which the
// driver reports as "commands out of sync": refusing the message up front
// gives the writer a clear, typed error instead.
func (p *Plugin) mysqlPacketLimit(tx *gorm.DB) int {
	if v := p.packetLimit.Load(); v != 0 {
		return int(max(v, 0))
	}
	var limit int64
	var err error
	const q = "SELECT @@max_allowed_packet"
	if conn := p.findTx(tx.Statement.ConnPool); conn != nil {
		// Below GORM's prepared-statement cache, like the INSERT.
		err = conn.QueryRowContext(tx.Statement.Context, q).Scan(&limit)
	} else {
		err = tx.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Raw(q).Scan(&limit).Error
	}
	if err != nil || limit <= packetOverhead {
		p.cfg.Logger.Warn("outbox: cannot read max_allowed_packet; large messages are not checked against it",
			slog.String("outbox", p.cfg.Name), slog.Any("err", err))
		p.packetLimit.Store(-1)
		return 0
	}
	p.packetLimit.Store(limit)
	return int(limit)
}

// Placeholder styles of the dialects the plugin writes to directly.
const (
	styleUnknown  = iota
	styleQuestion // ?, ?, ... (MySQL, SQLite)
	styleDollar   // $1, $2, ... (PostgreSQL)
)

func placeholderStyle(dialect string) int {
	switch dialect {
	case "postgres":
		return styleDollar
	case "mysql", "sqlite", "sqlite3":
		return styleQuestion
	}
	return styleUnknown
}

// insertSQL builds the INSERT of rows rows in the given placeholder
// style.
func insertSQL(table string, rows, style int) string {
	var sb strings.Builder
	sb.Grow(len(table) + len(sqlrows.InsertColumns) + 32 + rows*(sqlrows.InsertArgs*5+3))
	sb.WriteString("INSERT INTO ")
	sb.WriteString(table)
	sb.WriteString(" ")
	sb.WriteString(sqlrows.InsertColumns)
	sb.WriteString(" VALUES ")
	n := 0
	for r := 0; r < rows; r++ {
		if r > 0 {
			sb.WriteByte(',')
		}
		sb.WriteByte('(')
		for c := 0; c < sqlrows.InsertArgs; c++ {
			if c > 0 {
				sb.WriteByte(',')
			}
			n++
			if style == styleDollar {
				sb.WriteByte('$')
				sb.WriteString(strconv.Itoa(n))
			} else {
				sb.WriteByte('?')
			}
		}
		sb.WriteByte(')')
	}
	return sb.String()
}

// insert runs the INSERT through the statement's own connection (the
// write's transaction). For the dialects whose placeholders it knows it
// skips GORM's statement builder, which costs more than the insert on a
// single-row write; the single-row statement text is built once. Others
// go through db.Exec. Either way no GORM callback, and so no outbox rule,
// runs for the outbox row, and the statement is traced to GORM's logger.
// It runs on the plugin's own transaction (conn) when there is one, below
// GORM's prepared-statement wrapper: the outbox's INSERT is not one of the
// application's statements to cache.
func (p *Plugin) insert(tx *gorm.DB, conn *txConn, style int, table string, rows int, args []any) error {
	if style == styleUnknown {
		sql := insertSQL(table, rows, styleQuestion)
		return tx.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Exec(sql, args...).Error
	}
	var sql string
	if rows == 1 {
		key := singleInsertKey{table: table, style: style}
		if v, ok := p.singleInsert.Load(key); ok {
			sql = v.(string)
		} else {
			sql = insertSQL(table, 1, style)
			p.singleInsert.Store(key, sql)
		}
	} else {
		sql = insertSQL(table, rows, style)
	}
	ctx := tx.Statement.Context
	begin := time.Now()
	var exec gorm.ConnPool = tx.Statement.ConnPool
	if conn != nil {
		exec = conn
	}
	res, err := exec.ExecContext(ctx, sql, args...)
	tx.Logger.Trace(ctx, begin, func() (string, int64) {
		var n int64 = -1
		if res != nil {
			n, _ = res.RowsAffected()
		}
		return sql, n
	}, err)
	return err
}

type singleInsertKey struct {
	table string
	style int
}
