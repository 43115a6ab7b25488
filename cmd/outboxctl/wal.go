package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/pgwal"
)

// connectWAL builds the operator API of an outbox in WAL mode.
func (g *globals) connectWAL(db *gorm.DB, cfg outbox.Config) error {
	if db.Dialector.Name() != "postgres" {
		return usagef("--mode wal needs PostgreSQL (driver %s)", db.Dialector.Name())
	}
	p, err := outbox.NewPlugin(cfg)
	if err != nil {
		return usageError{err.Error()}
	}
	if err := db.Use(p); err != nil {
		return err
	}
	admin, err := pgwal.NewAdmin(db, p, pgwal.Config{Slot: g.walSlot, LeaseTable: g.walLeases})
	if err != nil {
		return usageError{err.Error()}
	}
	g.op, g.cfg, g.wal = admin, p.Config(), admin
	return nil
}

// walSlotJSON is the --json form of "wal slot status" and "wal slot drop".
type walSlotJSON struct {
	Slot        *ops.WALStatus     `json:"slot,omitempty"`
	Unconfirmed *pgwal.Unconfirmed `json:"unconfirmed,omitempty"`
	Created     *bool              `json:"created,omitempty"`
	Dropped     bool               `json:"dropped,omitempty"`
}

func (g *globals) walCmd(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var force bool
	fs.BoolVar(&force, "force", false, "wal slot drop: drop even when the slot holds unpublished messages, losing them")
	ctx, cancel, pos, err := g.startLazy(ctx, fs, args)
	if err != nil {
		return err
	}
	defer cancel()
	if len(pos) >= 2 && pos[0] == "switch" {
		if force {
			return usagef("--force is for wal slot drop only")
		}
		return g.walSwitch(ctx, pos[1:])
	}
	if len(pos) != 2 || pos[0] != "slot" {
		return usagef("wal takes: slot status, slot create, slot drop [--force], or switch CHECK (%s)", switchChecks)
	}
	sub := pos[1]
	switch sub {
	case "status", "create", "drop":
	default:
		return usagef("unknown wal slot command %q: status, create or drop", sub)
	}
	if force && sub != "drop" {
		return usagef("--force is for wal slot drop only")
	}
	if err := g.connectWALMode(ctx); err != nil {
		return err
	}
	switch sub {
	case "create":
		created, err := g.wal.EnsureSlot(ctx)
		if err != nil {
			return err
		}
		if g.json {
			return g.printJSON(walSlotJSON{Created: &created})
		}
		if created {
			fmt.Fprintf(g.out, "created slot %s\n", g.wal.WALConfig().Slot)
		} else {
			fmt.Fprintf(g.out, "slot %s exists\n", g.wal.WALConfig().Slot)
		}
		return nil
	case "drop":
		before, err := g.wal.WALStatus(ctx)
		if err != nil {
			return err
		}
		u, err := g.wal.DropSlot(ctx, force)
		var has *pgwal.SlotHasMessagesError
		if errors.As(err, &has) {
			return fmt.Errorf("%w (outboxctl --mode wal --wal-slot %s wal slot drop --force)", err, g.wal.WALConfig().Slot)
		}
		if err != nil {
			return err
		}
		if g.json {
			return g.printJSON(walSlotJSON{Unconfirmed: &u, Dropped: true})
		}
		if !before.Exists {
			fmt.Fprintf(g.out, "slot %s did not exist; deleted its publication and its lease, so that it is created afresh\n", before.Slot)
			return nil
		}
		fmt.Fprintf(g.out, "dropped slot %s, its publication and its lease", g.wal.WALConfig().Slot)
		if u.Messages > 0 {
			fmt.Fprintf(g.out, "; %d unpublished message(s) of %d key(s), written %s to %s, were lost", u.Messages, u.Keys,
				u.Oldest.UTC().Format(time.RFC3339), u.Newest.UTC().Format(time.RFC3339))
		}
		fmt.Fprintln(g.out)
		return nil
	}
	ws, err := g.wal.WALStatus(ctx)
	if err != nil {
		return err
	}
	var u *pgwal.Unconfirmed
	if ws.Exists && !ws.Active && !ws.Lost && ws.Foreign == "" {
		// No reader: read what the slot holds, without consuming it.
		got, err := g.wal.Unconfirmed(ctx)
		switch {
		case errors.Is(err, pgwal.ErrSlotActive):
			// A reader connected meanwhile.
		case err != nil:
			return err
		default:
			u = &got
			if got.Messages > 0 {
				ws.Oldest, ws.LagAgeMs, ws.LagSource = got.Oldest, max(time.Since(got.Oldest), 0).Milliseconds(), "slot"
			} else {
				ws.LagSource = "slot"
			}
		}
	}
	if g.json {
		return g.printJSON(walSlotJSON{Slot: &ws, Unconfirmed: u})
	}
	printWAL(g.out, ws, u)
	return nil
}

// connectWALMode connects to an outbox that --mode wal (or OUTBOX_MODE)
// says is in WAL mode.
func (g *globals) connectWALMode(ctx context.Context) error {
	if g.mode == "" {
		g.mode = g.getenv("OUTBOX_MODE")
	}
	if g.mode != "wal" {
		return usagef("wal commands need --mode wal (or OUTBOX_MODE=wal)")
	}
	return g.connect(ctx)
}

// switchChecks names the checks of "wal switch".
const switchChecks = "table-mark, table-drained MARK, table-relays-stopped, wal-mark, published-through LSN"

// errNotYet is a switch check that does not hold yet: exit status 3.
type errNotYet struct{ msg string }

func (e errNotYet) Error() string { return e.msg }

// switchJSON is the --json form of "wal switch".
type switchJSON struct {
	Check string `json:"check"`
	// OK is the answer of a yes/no check (table-drained,
	// table-relays-stopped, published-through).
	OK *bool `json:"ok,omitempty"`
	// Mark is table-mark's answer and table-drained's argument.
	Mark *int64 `json:"mark,omitempty"`
	// LSN is wal-mark's answer and published-through's argument, in
	// PostgreSQL's form (16/B374D848); Confirmed the slot's position.
	LSN       string `json:"lsn,omitempty"`
	Confirmed string `json:"confirmed_lsn,omitempty"`
}

// walSwitch runs one check of the staged switch between the modes
// (docs/wal-mode.md, Switching modes) through pgwal.Admin: no reader, no
// publisher. A yes/no check that does not hold yet exits 3, so a script
// can wait for it: until outboxctl ... wal switch table-drained 42; do sleep 5; done.
func (g *globals) walSwitch(ctx context.Context, args []string) error {
	check, arg := args[0], ""
	want := 0
	switch check {
	case "table-drained", "published-through":
		want = 1
	case "table-mark", "table-relays-stopped", "wal-mark":
	default:
		return usagef("unknown wal switch check %q: %s", check, switchChecks)
	}
	if len(args)-1 != want {
		return usagef("wal switch %s takes %d argument(s)", check, want)
	}
	if want == 1 {
		arg = args[1]
	}
	var mark int64
	var lsn pglogrepl.LSN
	var err error
	switch check {
	case "table-drained":
		if mark, err = strconv.ParseInt(arg, 10, 64); err != nil || mark < 0 {
			return usagef("wal switch table-drained: MARK is the id table-mark printed, not %q", arg)
		}
	case "published-through":
		if lsn, err = pglogrepl.ParseLSN(arg); err != nil {
			return usagef("wal switch published-through: LSN is the position wal-mark printed (like 16/B374D848), not %q", arg)
		}
	}
	if err := g.connectWALMode(ctx); err != nil {
		return err
	}
	out := switchJSON{Check: check}
	var ok bool
	var line, notYet string
	switch check {
	case "table-mark":
		if mark, err = g.wal.TableMark(ctx); err != nil {
			return err
		}
		out.Mark, line = &mark, strconv.FormatInt(mark, 10)
	case "table-drained":
		if ok, err = g.wal.TableDrained(ctx, mark); err != nil {
			return err
		}
		out.Mark = &mark
		line = fmt.Sprintf("drained: no row with id <= %d is left in %s", mark, g.cfg.Tables.Messages)
		notYet = fmt.Sprintf("not drained: rows with id <= %d are still in %s (the table relays publish them)", mark, g.cfg.Tables.Messages)
	case "table-relays-stopped":
		if ok, err = g.wal.TableRelaysStopped(ctx); err != nil {
			return err
		}
		line = "stopped: no table-mode relay holds a bucket lease in " + g.cfg.Tables.Leases
		notYet = "not stopped: a table-mode relay holds bucket leases in " + g.cfg.Tables.Leases + " (a relay that died holds them until they lapse)"
	case "wal-mark":
		if lsn, err = g.wal.WALMark(ctx); err != nil {
			return err
		}
		out.LSN, line = lsn.String(), lsn.String()
	case "published-through":
		if ok, err = g.wal.PublishedThrough(ctx, lsn); err != nil {
			return err
		}
		ws, err := g.wal.WALStatus(ctx)
		if err != nil {
			return err
		}
		out.LSN, out.Confirmed = lsn.String(), ws.ConfirmedLSN
		line = fmt.Sprintf("published through %s: slot %s confirmed %s", lsn, ws.Slot, ws.ConfirmedLSN)
		notYet = fmt.Sprintf("not yet published through %s: slot %s confirmed %s", lsn, ws.Slot, ws.ConfirmedLSN)
	}
	if want == 1 || check == "table-relays-stopped" {
		out.OK = &ok
	}
	if g.json {
		if err := g.printJSON(out); err != nil {
			return err
		}
	} else if out.OK == nil || ok {
		fmt.Fprintln(g.out, line)
	}
	if out.OK != nil && !ok {
		if g.json {
			return errNotYet{}
		}
		return errNotYet{notYet}
	}
	return nil
}

// printWAL prints a WAL slot's status, and what it holds when known.
func printWAL(w io.Writer, ws ops.WALStatus, u *pgwal.Unconfirmed) {
	state := "inactive (no reader connected)"
	switch {
	case ws.Foreign != "":
		state = "NOT THIS OUTBOX'S: " + ws.Foreign
	case ws.Lost:
		state = "LOST: " + ws.LostReason
	case !ws.Exists:
		state = "MISSING: messages written now are not kept for the readers (outboxctl wal slot create)"
	case ws.Active:
		state = "active"
	}
	tw := newTable(w)
	fmt.Fprintf(tw, "SLOT\t%s\n", ws.Slot)
	fmt.Fprintf(tw, "STATE\t%s\n", state)
	reader := "none"
	if ws.Reader.Held {
		reader = fmt.Sprintf("%s (term %d, lease expires in %s)", ws.Reader.Owner, ws.Reader.Term, age(time.Until(ws.Reader.ExpiresAt)))
	} else if ws.Reader.Owner != "" && ws.Reader.ExpiresAt.IsZero() {
		reader = fmt.Sprintf("none (last %s, term %d, lease released)", ws.Reader.Owner, ws.Reader.Term)
	} else if ws.Reader.Owner != "" {
		reader = fmt.Sprintf("none (last %s, term %d, lease expired %s ago)", ws.Reader.Owner, ws.Reader.Term, age(time.Since(ws.Reader.ExpiresAt)))
	}
	fmt.Fprintf(tw, "READER\t%s\n", reader)
	confirmed := ws.ConfirmedLSN
	if confirmed == "" {
		confirmed = "-"
	}
	fmt.Fprintf(tw, "CONFIRMED\t%s (current %s)\n", confirmed, ws.CurrentLSN)
	fmt.Fprintf(tw, "LAG BYTES\t%d (WAL retained: current - confirmed)\n", ws.RetainedBytes)
	lag := "unknown: no reader holds the slot's lease, or it has not read yet the WAL written before its term began"
	switch ws.LagSource {
	case "reader":
		lag = age(ws.LagAge()) + " (age of the oldest message the reader has not published)"
	case "lease":
		lag = age(ws.LagAge()) + " (age of the oldest message the reader had not published at its last lease renewal)"
		if ws.Oldest.IsZero() {
			lag = "0 (the reader held no unpublished message at its last lease renewal)"
		}
	case "slot":
		lag = age(ws.LagAge()) + " (age of the oldest unconfirmed message in the slot)"
	}
	fmt.Fprintf(tw, "LAG TIME\t%s\n", lag)
	if u != nil {
		fmt.Fprintf(tw, "UNCONFIRMED\t%d message(s) of %d key(s)\n", u.Messages, u.Keys)
	}
	tw.Flush()
}
