// Package opstest gives the tests of the operator front ends (opshttp,
// opsui, test/ui) and the operator conformance runs one outbox to work on,
// behind ops.Operator, in each implementation: the GORM store's Admin on
// every database, and the in-memory opsmem.Store.
package opstest

import (
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opsmem"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/relay/storetest"
)

// Backend is one outbox and the means to fill and read it below the
// operator API.
type Backend struct {
	// Name is "memory" or the database's dialect.
	Name string
	Op   ops.Operator
	// Insert commits pending messages in order; InsertDead writes dead
	// letters as the failure policy does.
	Insert     func(t testing.TB, msgs ...relay.Message)
	InsertDead func(t testing.TB, dead ...ops.DeadLetter)
	// Pending reads the pending messages by id.
	Pending func(t testing.TB) []relay.Message
	// DeletePending deletes the pending messages of topic, as a relay
	// deletes what it published.
	DeletePending func(t testing.TB, topic string)
	// SetLease gives bucket to owner until expires, with a new term.
	SetLease func(t testing.TB, bucket int, owner string, expires time.Time)
	// Heartbeat records a relay's heartbeat.
	Heartbeat func(t testing.TB, relayID string, lastSeen, startedAt time.Time)
	// DB is the database of a GORM backend; nil for memory.
	DB *dbtest.DB
	// Admin is the GORM backend's Admin; nil for memory.
	Admin *gormrelay.Admin
	// Config is the outbox's configuration (BucketCount for memory).
	Config outbox.Config
}

// ForEach runs fn on a fresh outbox of buckets buckets in memory and on
// every database (dbtest.ForEach), each as a subtest named after it.
func ForEach(t *testing.T, buckets int, fn func(t *testing.T, b *Backend)) {
	t.Helper()
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		fn(t, Memory(buckets))
	})
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		fn(t, GORM(t, db, outbox.Config{BucketCount: buckets}))
	})
}

// Memory is an in-memory outbox.
func Memory(buckets int) *Backend {
	s := opsmem.New(buckets)
	return &Backend{
		Name:       "memory",
		Op:         s,
		Config:     outbox.Config{BucketCount: buckets}.WithDefaults(),
		Insert:     func(_ testing.TB, msgs ...relay.Message) { s.Insert(msgs...) },
		InsertDead: func(_ testing.TB, dead ...ops.DeadLetter) { s.InsertDead(dead...) },
		Pending:    func(testing.TB) []relay.Message { return s.Pending() },
		DeletePending: func(_ testing.TB, topic string) {
			s.DeletePending(func(m relay.Message) bool { return m.Topic == topic })
		},
		SetLease: func(_ testing.TB, bucket int, owner string, expires time.Time) {
			s.SetLease(bucket, owner, expires)
		},
		Heartbeat: func(_ testing.TB, id string, lastSeen, startedAt time.Time) { s.Heartbeat(id, lastSeen, startedAt) },
	}
}

var outboxes atomic.Int64

// GORM migrates a fresh outbox of cfg in db (its own table prefix when cfg
// has none, so one database holds many) and returns it with its Admin.
func GORM(t testing.TB, db *dbtest.DB, cfg outbox.Config) *Backend {
	t.Helper()
	if cfg.Tables == (outbox.Tables{}) {
		cfg.Tables = outbox.WithPrefix(fmt.Sprintf("ops%d_", outboxes.Add(1)))
	}
	cfg = cfg.WithDefaults()
	require.NoError(t, cfg.Tables.AutoMigrate(t.Context(), db.DB))
	admin, err := gormrelay.NewAdmin(db.DB, cfg)
	require.NoError(t, err)
	tb := cfg.Tables
	return &Backend{
		Name: db.Dialect, Op: admin, DB: db, Admin: admin, Config: cfg,
		Insert: func(t testing.TB, msgs ...relay.Message) {
			t.Helper()
			rows := make([]outbox.MessageRow, len(msgs))
			for i, m := range msgs {
				if m.CreatedAt.IsZero() {
					m.CreatedAt = time.Now()
				}
				rows[i] = outbox.MessageRow{ID: m.ID, MessageID: m.MessageID, Bucket: int32(m.Bucket), Topic: m.Topic, Key: m.Key, Value: m.Value,
					Headers: outbox.EncodeHeaders(m.Headers), Partition: m.Partition, CreatedAtMs: m.CreatedAt.UnixMilli()}
			}
			require.NoError(t, db.DB.Table(tb.MessagesTable()).Create(&rows).Error)
		},
		InsertDead: func(t testing.TB, dead ...ops.DeadLetter) {
			t.Helper()
			rows := make([]outbox.DeadLetterRow, len(dead))
			for i, d := range dead {
				if d.State == "" {
					d.State = ops.DeadLetterFailed
				}
				if d.DeadAt.IsZero() {
					d.DeadAt = time.Now()
				}
				rows[i] = outbox.DeadLetterRow{ID: d.ID, MessageID: d.MessageID, Bucket: int32(d.Bucket), Topic: d.Topic, Key: d.Key, Value: d.Value,
					Headers: outbox.EncodeHeaders(d.Headers), Partition: d.Partition, CreatedAtMs: d.CreatedAt.UnixMilli(),
					Attempts: int32(d.Attempts), DeadAtMs: d.DeadAt.UnixMilli(), State: string(d.State)}
				if d.LastError != "" {
					rows[i].LastError = &d.LastError
				}
			}
			require.NoError(t, db.DB.Table(tb.DeadLettersTable()).Create(&rows).Error)
		},
		Pending: func(t testing.TB) []relay.Message {
			t.Helper()
			var rows []outbox.MessageRow
			require.NoError(t, db.DB.Table(tb.MessagesTable()).Order("id").Find(&rows).Error)
			out := make([]relay.Message, len(rows))
			for i, r := range rows {
				h, err := outbox.DecodeHeaders(r.Headers)
				require.NoError(t, err)
				out[i] = relay.Message{ID: r.ID, MessageID: r.MessageID, Bucket: int(r.Bucket), Topic: r.Topic, Key: r.Key, Value: r.Value,
					Headers: h, Partition: r.Partition, CreatedAt: time.UnixMilli(r.CreatedAtMs), Attempts: int(r.Attempts)}
			}
			return out
		},
		DeletePending: func(t testing.TB, topic string) {
			t.Helper()
			require.NoError(t, db.DB.Table(tb.MessagesTable()).Where("topic = ?", topic).Delete(&outbox.MessageRow{}).Error)
		},
		SetLease: func(t testing.TB, bucket int, owner string, expires time.Time) {
			t.Helper()
			require.NoError(t, db.DB.Table(tb.LeasesTable()).Clauses(clause.OnConflict{DoNothing: true}).
				Create(&outbox.LeaseRow{Bucket: int32(bucket)}).Error)
			require.NoError(t, db.DB.Exec("UPDATE "+db.DB.Statement.Quote(tb.LeasesTable())+
				" SET owner = ?, term = term + 1, expires_at_ms = ? WHERE bucket = ?", owner, expires.UnixMilli(), bucket).Error)
		},
		Heartbeat: func(t testing.TB, id string, lastSeen, startedAt time.Time) {
			t.Helper()
			require.NoError(t, db.DB.Table(tb.RelaysTable()).Create(&outbox.RelayRow{
				RelayID: id, LastSeenMs: lastSeen.UnixMilli(), StartedAtMs: startedAt.UnixMilli()}).Error)
		},
	}
}

// Harness is the operator conformance harness (storetest.RunOperator)
// over the backends newBackend makes.
func Harness(newBackend func(t *testing.T, buckets int) *Backend) storetest.OperatorHarness {
	var mu sync.Mutex
	made := map[ops.Operator]*Backend{}
	of := func(op ops.Operator) *Backend {
		mu.Lock()
		defer mu.Unlock()
		return made[op]
	}
	return storetest.OperatorHarness{
		New: func(t *testing.T, buckets int) ops.Operator {
			b := newBackend(t, buckets)
			mu.Lock()
			made[b.Op] = b
			mu.Unlock()
			return b.Op
		},
		Insert:     func(t *testing.T, op ops.Operator, msgs []relay.Message) { of(op).Insert(t, msgs...) },
		InsertDead: func(t *testing.T, op ops.Operator, dead []ops.DeadLetter) { of(op).InsertDead(t, dead...) },
		Pending:    func(t *testing.T, op ops.Operator) []relay.Message { return of(op).Pending(t) },
	}
}

// GetJSON GETs path from srv and decodes the JSON object it answers (a
// health probe's, an admin endpoint's); it returns the status code and
// the object.
func GetJSON(t testing.TB, srv *httptest.Server, path string) (int, map[string]any) {
	t.Helper()
	resp, err := srv.Client().Get(srv.URL + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	var body map[string]any
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&body), path)
	return resp.StatusCode, body
}
