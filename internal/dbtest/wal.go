package dbtest

import (
	"database/sql"
	"os"
	"testing"

	"github.com/jackc/pglogrepl"
)

// PostgresWALDSN returns the DSN of the PostgreSQL server with
// wal_level = logical that WAL mode tests use (scripts/services.sh starts
// one on port 5434): OUTBOX_TEST_POSTGRES_WAL_DSN, by default
// postgres@127.0.0.1:5434, database test. Its role needs REPLICATION and
// pg_hba must allow replication connections.
func PostgresWALDSN() string {
	if v := os.Getenv("OUTBOX_TEST_POSTGRES_WAL_DSN"); v != "" {
		return v
	}
	return "host=127.0.0.1 port=5434 user=postgres dbname=test sslmode=disable"
}

// RequireWAL skips the test (fails it in CI) when the WAL mode server is
// down.
func RequireWAL(t testing.TB) {
	t.Helper()
	reachMu.Lock()
	err, ok := reach["postgres-wal"]
	if !ok {
		err = ping("pgx", PostgresWALDSN())
		reach["postgres-wal"] = err
	}
	reachMu.Unlock()
	if err != nil {
		if InCI() {
			t.Fatalf("PostgreSQL with wal_level=logical required in CI but unreachable (%s): %v", PostgresWALDSN(), err)
		}
		t.Skipf("PostgreSQL with wal_level=logical unreachable: %v", err)
	}
}

// OpenWAL is Open on the WAL mode server: a fresh schema, dropped at the
// end of the test. Logical decoding is per database, so a slot sees the
// messages of every test; tests tell theirs apart by the outbox name.
func OpenWAL(t testing.TB) *DB {
	t.Helper()
	RequireWAL(t)
	d := &DB{Dialect: Postgres, Namespace: Name("t_")}
	d.postgresSchema(t, PostgresWALDSN())
	d.connect(t, nil)
	return d
}

// WALSlot is a logical replication slot (pgoutput, messages on) created
// for one test on the WAL mode server and dropped when it ends.
type WALSlot struct {
	Name        string
	Publication string
	db          *sql.DB
}

// NewWALSlot creates a slot and an empty publication for it. Messages
// written after it returns are in the slot.
func NewWALSlot(t testing.TB) *WALSlot {
	t.Helper()
	RequireWAL(t)
	s := &WALSlot{Name: Name("slot_"), Publication: Name("pub_"), db: mustOpen(t, "pgx", PostgresWALDSN())}
	exec(t, s.db, "CREATE PUBLICATION "+s.Publication)
	if _, err := s.db.Exec("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", s.Name); err != nil {
		t.Fatalf("dbtest: create slot: %v", err)
	}
	t.Cleanup(func() {
		_, _ = s.db.Exec("SELECT pg_drop_replication_slot($1)", s.Name)
		_, _ = s.db.Exec("DROP PUBLICATION " + s.Publication)
		s.db.Close()
	})
	return s
}

// WALMessage is one logical decoding message read from a slot.
type WALMessage struct {
	Transactional bool
	Prefix        string
	Content       []byte
}

// Messages consumes the slot up to the current WAL position and returns
// the logical decoding messages whose prefix is prefix, in WAL order.
func (s *WALSlot) Messages(t testing.TB, prefix string) []WALMessage {
	t.Helper()
	rows, err := s.db.Query("SELECT data FROM pg_logical_slot_get_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', $2, 'messages', 'true')", s.Name, s.Publication)
	if err != nil {
		t.Fatalf("dbtest: read slot: %v", err)
	}
	defer rows.Close()
	var out []WALMessage
	for rows.Next() {
		var data []byte
		if err := rows.Scan(&data); err != nil {
			t.Fatalf("dbtest: read slot: %v", err)
		}
		msg, err := pglogrepl.Parse(data)
		if err != nil {
			t.Fatalf("dbtest: parse pgoutput message: %v", err)
		}
		if m, ok := msg.(*pglogrepl.LogicalDecodingMessage); ok && m.Prefix == prefix {
			out = append(out, WALMessage{Transactional: m.Transactional, Prefix: m.Prefix, Content: m.Content})
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("dbtest: read slot: %v", err)
	}
	return out
}
