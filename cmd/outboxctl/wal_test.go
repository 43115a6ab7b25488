package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/ops"
)

// walOutbox migrates an outbox in WAL mode on the WAL test server and
// returns it, its name and slot (dropped at the end), and a run of
// outboxctl against it that returns the exit status, stdout and stderr.
func walOutbox(t *testing.T) (*dbtest.DB, *outbox.Plugin, string, string, func(args ...string) (int, string, string)) {
	t.Helper()
	dbt := dbtest.OpenWAL(t)
	name := dbtest.Name("ctl_")
	p, err := outbox.NewPlugin(outbox.Config{Name: name, Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, dbt.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), dbt.DB))
	slot := "outbox_" + name
	t.Cleanup(func() {
		_ = dbt.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ?", slot).Error
		_ = dbt.Exec("DROP PUBLICATION IF EXISTS " + slot).Error
	})
	env := map[string]string{"OUTBOX_DSN": dbt.DSN, "OUTBOX_MODE": "wal", "OUTBOX_NAME": name}
	ctl := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] })
		return code, out.String(), errOut.String()
	}
	return dbt, p, name, slot, ctl
}

// TestWALMode: outboxctl --mode wal shows the slot, creates it, requeues
// a WAL dead letter by emitting it into the slot again, refuses pause,
// refuses to drop a slot holding unpublished messages (saying what they
// are), and drops it with --force.
func TestWALMode(t *testing.T) {
	t.Parallel()
	dbt, p, name, slot, ctl := walOutbox(t)
	slotExists := func() bool {
		var n int64
		require.NoError(t, dbt.Raw("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&n).Error)
		return n > 0
	}

	code, out, errOut := ctl("wal", "slot", "status")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "MISSING")
	code, out, errOut = ctl("wal", "slot", "create")
	require.Equal(t, exitOK, code, errOut)
	require.Equal(t, "created slot "+slot+"\n", out)
	require.True(t, slotExists())
	code, out, _ = ctl("wal", "slot", "create")
	require.Equal(t, exitOK, code)
	require.Equal(t, "slot "+slot+" exists\n", out)

	require.NoError(t, dbt.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("a"), Value: []byte("a0")},
			&outbox.Message{Topic: "t", Key: []byte("b"), Value: []byte("b0")}, &outbox.Message{Topic: "t", Key: []byte("a"), Value: []byte("a1")})
	}))
	code, out, errOut = ctl("wal", "slot", "status")
	require.Equal(t, exitOK, code, errOut)
	require.Regexp(t, `SLOT +`+slot+`\n`, out)
	require.Regexp(t, `STATE +inactive \(no reader connected\)`, out)
	require.Regexp(t, `READER +none\n`, out)
	require.Regexp(t, `LAG BYTES +[1-9][0-9]* \(WAL retained`, out)
	require.Contains(t, out, "(age of the oldest unconfirmed message in the slot)")
	require.Regexp(t, `UNCONFIRMED +3 message\(s\) of 2 key\(s\)`, out)

	code, out, errOut = ctl("--json", "wal", "slot", "status")
	require.Equal(t, exitOK, code, errOut)
	var js walSlotJSON
	require.NoError(t, json.Unmarshal([]byte(out), &js))
	require.True(t, js.Slot.Exists)
	require.Equal(t, slot, js.Slot.Slot)
	require.Equal(t, "slot", js.Slot.LagSource)
	require.Equal(t, int64(3), js.Unconfirmed.Messages)

	// status: the outbox and its slot, not the table-mode view.
	code, out, errOut = ctl("status")
	require.Equal(t, exitOK, code, errOut)
	require.True(t, strings.HasPrefix(out, "outbox "+name+" (WAL mode): dead letters 0 failed + 0 parked\n\n"), out)
	require.Regexp(t, `SLOT +`+slot+`\n`, out)
	for _, tableMode := range []string{p.Config().Tables.MessagesTable(), "buckets", "pending", "BUCKET", "OWNER", "relay"} {
		require.NotContains(t, out, tableMode)
	}

	// A WAL mode dead letter (negative id: a negated WAL position),
	// requeued: emitted into the slot again and gone from the table.
	now := time.Now().UnixMilli()
	require.NoError(t, dbt.Table(p.Config().Tables.DeadLettersTable()).Create(&outbox.DeadLetterRow{ID: -12345, MessageID: "m1",
		Topic: "t", Key: []byte("a"), Value: []byte("a-dead"), CreatedAtMs: now, DeadAtMs: now, State: "failed"}).Error)
	code, out, errOut = ctl("dead-letters", "list")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "-12345")
	// Negative ids are ids, not flags, alone, in lists, after flags and
	// after "--".
	for _, args := range [][]string{{"dead-letters", "show", "-12345"}, {"dead-letters", "show", "--json", "-12345"},
		{"--json", "dead-letters", "show", "--", "-12345"}} {
		code, out, errOut = ctl(args...)
		require.Equal(t, exitOK, code, "%v: %s", args, errOut)
		require.Contains(t, out, "12345", args)
		require.Contains(t, out, "m1", args)
	}
	code, _, errOut = ctl("requeue", "-99999,-99998")
	require.Equal(t, exitFail, code, errOut)
	require.Contains(t, errOut, "none of the ids is a dead letter")
	code, _, errOut = ctl("dead-letters", "show", "-1x")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "flag provided but not defined: -1x")
	code, out, errOut = ctl("requeue", "--key", "a")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "requeued 1 dead letter(s)")
	code, out, errOut = ctl("--json", "wal", "slot", "status")
	require.Equal(t, exitOK, code, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), &js))
	require.Equal(t, int64(4), js.Unconfirmed.Messages, "the dead letter is in the slot again")
	var dead int64
	require.NoError(t, dbt.Table(p.Config().Tables.DeadLettersTable()).Count(&dead).Error)
	require.Zero(t, dead)

	code, _, errOut = ctl("pause", "0")
	require.Equal(t, exitFail, code)
	require.Contains(t, errOut, "WAL mode has no per-bucket pause")

	code, _, errOut = ctl("wal", "slot", "drop")
	require.Equal(t, exitFail, code)
	require.Contains(t, errOut, "refusing to drop slot "+slot+": it holds 4 unpublished message(s) of 2 key(s)")
	require.Contains(t, errOut, "(outboxctl --mode wal --wal-slot "+slot+" wal slot drop --force)", "the refusal names the command that drops this slot")
	require.Contains(t, errOut, "--force")
	require.True(t, slotExists(), "refused: still there")
	code, out, errOut = ctl("wal", "slot", "drop", "--force")
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "dropped slot "+slot)
	require.Contains(t, out, "4 unpublished message(s) of 2 key(s)")
	require.False(t, slotExists())
	code, _, errOut = ctl("wal", "slot", "drop")
	require.Equal(t, exitFail, code)
	require.Contains(t, errOut, "replication slot does not exist")
	code, out, errOut = ctl("wal", "slot", "drop", "--force")
	require.Equal(t, exitOK, code, errOut)
	require.Equal(t, "slot "+slot+" did not exist; deleted its publication and its lease, so that it is created afresh\n", out)

	code, _, errOut = ctl("--mode", "table", "wal", "slot", "status")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "need --mode wal")
	code, _, errOut = ctl("wal", "slot", "frob")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "unknown wal slot command")
}

// printWAL says a slot of another database is not this outbox's, and
// why, before anything else.
func TestPrintWALForeignSlot(t *testing.T) {
	var b strings.Builder
	printWAL(&b, ops.WALStatus{Slot: "outbox_orders", Exists: true, Lost: true, LostReason: "dropped",
		Foreign: `pgwal: slot outbox_orders is a logical slot of plugin "pgoutput" in database "inventory"`}, nil)
	require.Regexp(t, `STATE +NOT THIS OUTBOX'S: pgwal: slot outbox_orders is a logical slot of plugin "pgoutput" in database "inventory"`, b.String())
}

// TestWALSwitchChecks: "wal switch" runs the staged switch's checks with
// no reader or publisher: table-mark prints the highest id of the rows a
// table-mode writer left, table-drained waits (exit 3) until no row up to
// the mark is left, table-relays-stopped until no live bucket lease is,
// wal-mark prints a position in PostgreSQL's text form, which
// published-through takes back and answers from the slot's confirmed
// position.
func TestWALSwitchChecks(t *testing.T) {
	t.Parallel()
	dbt, p, name, slot, ctl := walOutbox(t)
	code, _, errOut := ctl("wal", "slot", "create")
	require.Equal(t, exitOK, code, errOut)

	// Rows a table-mode writer of the same outbox left.
	tdb, err := dbtest.OpenGorm(dbtest.Postgres, dbt.DSN, &gorm.Config{})
	require.NoError(t, err)
	tp, err := outbox.NewPlugin(outbox.Config{Name: name})
	require.NoError(t, err)
	require.NoError(t, tdb.Use(tp))
	require.NoError(t, tdb.Transaction(func(tx *gorm.DB) error {
		return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: []byte("a"), Value: []byte("1")}, &outbox.Message{Topic: "t", Key: []byte("b"), Value: []byte("2")})
	}))
	var maxID int64
	messages := p.Config().Tables.Messages
	require.NoError(t, dbt.Raw("SELECT max(id) FROM "+messages).Scan(&maxID).Error)
	code, out, errOut := ctl("wal", "switch", "table-mark")
	require.Equal(t, exitOK, code, errOut)
	require.Equal(t, strconv.FormatInt(maxID, 10)+"\n", out)
	mark := strings.TrimSpace(out)
	code, out, errOut = ctl("wal", "switch", "table-drained", mark)
	require.Equal(t, exitNotYet, code, out)
	require.Contains(t, errOut, "not drained: rows with id <= "+mark)
	code, out, _ = ctl("--json", "wal", "switch", "table-drained", mark)
	require.Equal(t, exitNotYet, code)
	var js switchJSON
	require.NoError(t, json.Unmarshal([]byte(out), &js))
	require.False(t, *js.OK)
	require.NoError(t, dbt.Exec("DELETE FROM "+messages).Error) // published by the table relays
	code, out, errOut = ctl("wal", "switch", "table-drained", mark)
	require.Equal(t, exitOK, code, errOut)
	require.Equal(t, "drained: no row with id <= "+mark+" is left in "+messages+"\n", out)

	leases := p.Config().Tables.Leases
	code, _, errOut = ctl("wal", "switch", "table-relays-stopped")
	require.Equal(t, exitOK, code, errOut)
	owner := "relay-1"
	require.NoError(t, dbt.Table(leases).Create(&outbox.LeaseRow{Bucket: 0, Owner: &owner, Term: 1, ExpiresAtMs: time.Now().Add(time.Hour).UnixMilli()}).Error)
	code, _, errOut = ctl("wal", "switch", "table-relays-stopped")
	require.Equal(t, exitNotYet, code)
	require.Contains(t, errOut, "not stopped: a table-mode relay holds bucket leases in "+leases)

	code, out, errOut = ctl("wal", "switch", "wal-mark")
	require.Equal(t, exitOK, code, errOut)
	lsn := strings.TrimSpace(out)
	require.Regexp(t, `^[0-9A-F]+/[0-9A-F]+$`, lsn)
	code, _, errOut = ctl("wal", "switch", "published-through", lsn)
	require.Equal(t, exitNotYet, code)
	require.Contains(t, errOut, "not yet published through "+lsn)
	// A reader confirms past the mark (here the slot is advanced to the
	// current position, as a reader that read everything does).
	require.NoError(t, dbt.Exec("SELECT pg_replication_slot_advance(?, pg_current_wal_lsn())", slot).Error)
	code, out, errOut = ctl("wal", "switch", "published-through", lsn)
	require.Equal(t, exitOK, code, errOut)
	require.Contains(t, out, "published through "+lsn+": slot "+slot+" confirmed ")

	for _, args := range [][]string{{"wal", "switch", "published-through", "12"}, {"wal", "switch", "table-drained", "x"},
		{"wal", "switch", "table-mark", "1"}, {"wal", "switch", "frob"}} {
		code, _, errOut = ctl(args...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}
