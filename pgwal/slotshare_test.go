package pgwal_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/promtest"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opsui"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// dsnWithDatabase returns dsn (keyword/value or URL) naming database.
func dsnWithDatabase(dsn, database string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + database
		return u.String()
	}
	return dsn + " dbname=" + database
}

// otherDatabase creates a database of its own on the WAL mode server,
// dropped (with the slots created in it) when the test ends.
func otherDatabase(t *testing.T, admin *gorm.DB) (name, dsn string, db *gorm.DB) {
	t.Helper()
	name = strings.ToLower(dbtest.Name("db_"))
	require.NoError(t, admin.Exec("CREATE DATABASE "+name).Error)
	dsn = dsnWithDatabase(dbtest.PostgresWALDSN(), name)
	db, err := dbtest.OpenGorm(dbtest.Postgres, dsn, &gorm.Config{})
	require.NoError(t, err)
	t.Cleanup(func() {
		if sqlDB, err := db.DB(); err == nil {
			_ = sqlDB.Close()
		}
		require.Eventually(t, func() bool {
			return admin.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = ? AND NOT active", name).Error == nil &&
				admin.Exec("DROP DATABASE IF EXISTS "+name+" WITH (FORCE)").Error == nil
		}, 30*time.Second, 50*time.Millisecond)
	})
	return name, dsn, db
}

// TestSlotOfAnotherDatabase: slot names are unique per server, so a
// second service on another database of the server whose outbox has the
// same name gets the default slot name of the first. Its reader's
// EnsureSlot and Run, and its Admin's EnsureSlot, Unconfirmed, DropSlot
// (even with force) and WALStatus, refuse that slot with a
// *SlotForeignError that names the slot's database and a slot name of
// its own, never advising to drop it; the first service's slot is left
// as it was. With the suggested Config.Slot the second service gets a
// slot of its own.
func TestSlotOfAnotherDatabase(t *testing.T) {
	e := setup(t)
	first := e.reader(t, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil }), "first")
	slot := first.Config().Slot
	before, err := first.SlotStatus(context.Background())
	require.NoError(t, err)
	require.True(t, before.Exists)
	var firstDB string
	require.NoError(t, e.db.Raw("SELECT current_database()").Scan(&firstDB).Error)

	name, dsn, db2 := otherDatabase(t, e.db.DB)
	p2, err := outbox.NewPlugin(outbox.Config{Name: e.plugin.Config().Name, Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, db2.Use(p2))
	require.NoError(t, p2.AutoMigrate(context.Background(), db2))
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
	cfg := pgwal.Config{ReplicationDSN: dsn, RelayID: "second", LeaseDuration: 1500 * time.Millisecond, StandbyInterval: 200 * time.Millisecond,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Logger: dbtest.Logger(t)}
	r2, err := pgwal.New(db2, p2, pub, cfg)
	require.NoError(t, err)
	require.Equal(t, slot, r2.Config().Slot, "the same outbox name gives the same default slot name")

	checkForeign := func(err error) {
		t.Helper()
		var fe *pgwal.SlotForeignError
		require.ErrorAs(t, err, &fe)
		require.ErrorIs(t, err, pgwal.ErrSlotForeign)
		require.Equal(t, pgwal.SlotForeignError{Slot: slot, Database: firstDB, Plugin: "pgoutput", Type: "logical", Current: name}, *fe)
		require.Contains(t, err.Error(), fmt.Sprintf("pgwal.Config{Slot: %q}", fe.Suggested()))
		require.NotContains(t, err.Error(), "pg_drop_replication_slot")
	}
	checkForeign(r2.EnsureSlot(context.Background()))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	checkForeign(r2.Run(ctx))
	require.NoError(t, ctx.Err(), "Run returned the error, it did not retry until ctx ended")

	admin2, err := pgwal.NewAdmin(db2, p2, pgwal.Config{})
	require.NoError(t, err)
	_, err = admin2.EnsureSlot(context.Background())
	checkForeign(err)
	_, err = admin2.Unconfirmed(context.Background())
	checkForeign(err)
	_, err = admin2.DropSlot(context.Background(), true)
	checkForeign(err)
	ws, err := admin2.WALStatus(context.Background())
	require.NoError(t, err)
	require.True(t, ws.Exists)
	require.Contains(t, ws.Foreign, firstDB)
	require.Empty(t, ws.ConfirmedLSN, "the other database's slot position is not reported as this outbox's")
	var unhealthy *ops.WALUnhealthyError
	require.ErrorAs(t, ops.CheckWAL(ws, ops.WALHealth{}, time.Now()), &unhealthy)
	require.Equal(t, ops.WALReasonSlotForeign, unhealthy.Reason)

	ui := httptest.NewServer(opsui.New(admin2, opsui.Options{}))
	defer ui.Close()
	resp, err := http.Get(ui.URL + "/")
	require.NoError(t, err)
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Contains(t, string(page), `class="wal-state bad">NOT THIS OUTBOX'S: pgwal: slot `+slot+` is a logical slot`)

	reg := prometheus.NewRegistry()
	reg.MustRegister(r2.Collector())
	require.Equal(t, map[string]float64{"slot=" + slot: 1}, promtest.Series(t, reg, pgwal.NameSlotLost, p2.Config().Name))
	require.Empty(t, promtest.Series(t, reg, pgwal.NameRetainedBytes, p2.Config().Name), "the other database's retained WAL is not this outbox's")

	after, err := first.SlotStatus(context.Background())
	require.NoError(t, err)
	require.Equal(t, before.Database, after.Database)
	require.Equal(t, before.Confirmed, after.Confirmed, "the first service's slot is untouched")

	var fe *pgwal.SlotForeignError
	require.ErrorAs(t, r2.EnsureSlot(context.Background()), &fe)
	cfg.Slot = fe.Suggested()
	own, err := pgwal.New(db2, p2, pub, cfg)
	require.NoError(t, err)
	require.NoError(t, own.EnsureSlot(context.Background()))
	st, err := own.SlotStatus(context.Background())
	require.NoError(t, err)
	require.True(t, st.Exists)
	require.Equal(t, name, st.Database)
}

// TestSlotCreationWaitsForOpenTransactions: creating a slot waits for a
// transaction open in another database of the server. The reader's and
// the Admin's EnsureSlot log the blocking session's pid while they wait,
// return ctx's error when it ends, and leave no server process creating
// the slot; meanwhile another EnsureSlot returns ErrSlotBeingCreated, not
// success. Once the transaction ends the slot is created.
func TestSlotCreationWaitsForOpenTransactions(t *testing.T) {
	e := setup(t)
	pub := relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil })
	for _, c := range []struct {
		name string
		// creating is the query the creating server process runs.
		creating string
		// gone: the creating process ended or went idle.
		gone   string
		ensure func(context.Context, pgwal.Config) error
	}{
		{name: "reader", creating: "CREATE_REPLICATION_SLOT ", gone: "SELECT count(*) FROM pg_stat_activity WHERE pid = ?",
			ensure: func(ctx context.Context, cfg pgwal.Config) error {
				r, err := pgwal.New(e.db.DB, e.plugin, pub, cfg)
				if err != nil {
					return err
				}
				return r.EnsureSlot(ctx)
			}},
		{name: "admin", creating: "pg_create_logical_replication_slot(", // The pooled connection stays; it may be the one this query runs on.
			gone: "SELECT count(*) FROM pg_stat_activity WHERE pid = ? AND state = 'active' AND strpos(query, 'pg_create_logical_replication_slot' || '(') > 0",
			ensure: func(ctx context.Context, cfg pgwal.Config) error {
				a, err := pgwal.NewAdmin(e.db.DB, e.plugin, cfg)
				if err != nil {
					return err
				}
				_, err = a.EnsureSlot(ctx)
				return err
			}},
	} {
		t.Run(c.name, func(t *testing.T) {
			slot := strings.ToLower(dbtest.Name("wait_"))
			e.dropSlotNamedAtEnd(t, slot)
			var logs dbtest.LogBuffer
			cfg := pgwal.Config{ReplicationDSN: dbtest.PostgresWALDSN(), Slot: slot, Logger: slog.New(slog.NewTextHandler(&logs, nil))}

			// A transaction holding a transaction id, open in another
			// database of the server.
			pc, err := pgconn.Connect(context.Background(), dsnWithDatabase(dbtest.PostgresWALDSN(), "postgres"))
			require.NoError(t, err)
			defer pc.Close(context.Background())
			_, err = pc.Exec(context.Background(), "BEGIN; SELECT txid_current()").ReadAll()
			require.NoError(t, err)
			blocker := pc.PID()

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			errc := make(chan error, 1)
			go func() { errc <- c.ensure(ctx, cfg) }()
			// The log names the creating server process and the blocking
			// session.
			creatorRE := regexp.MustCompile(`waits for the transactions open on the server.* pid=(\d+) blocking_pids=`)
			var creator int64
			require.Eventually(t, func() bool {
				m := creatorRE.FindStringSubmatch(logs.String())
				if m == nil || !strings.Contains(logs.String(), fmt.Sprintf("pid=%d datname=postgres", blocker)) {
					return false
				}
				creator, err = strconv.ParseInt(m[1], 10, 64)
				return err == nil
			}, 30*time.Second, 20*time.Millisecond, "the log names the blocking session %d: %s", blocker, &logs)
			var query string
			require.NoError(t, e.db.Raw("SELECT query FROM pg_stat_activity WHERE pid = ? AND state = 'active'", creator).Scan(&query).Error)
			require.Contains(t, query, c.creating)
			require.Contains(t, logs.String(), "waits for the transactions open on the server")
			select {
			case err := <-errc:
				t.Fatalf("EnsureSlot returned while the transaction is open: %v", err)
			default:
			}
			// Meanwhile the slot is listed, but not created yet: another
			// EnsureSlot says so instead of reporting it ready.
			err = c.ensure(context.Background(), cfg)
			require.ErrorIs(t, err, pgwal.ErrSlotBeingCreated)
			require.ErrorContains(t, err, fmt.Sprintf("by server process %d", creator))

			cancel()
			err = <-errc
			require.ErrorIs(t, err, context.Canceled)
			require.Eventually(t, func() bool {
				var n int64
				return e.db.Raw(c.gone, creator).Scan(&n).Error == nil && n == 0
			}, 30*time.Second, 20*time.Millisecond, "no server process is left creating the slot: %s", &logs)
			require.False(t, slotExists(e.db.DB, slot))

			_, err = pc.Exec(context.Background(), "ROLLBACK").ReadAll()
			require.NoError(t, err)
			require.NoError(t, c.ensure(context.Background(), cfg))
			require.True(t, slotExists(e.db.DB, slot))
		})
	}
}
