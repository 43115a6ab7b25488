// Command outboxctl is the operator's tool for a gorm-outbox outbox: it
// shows the backlog, leases and relays, lists and requeues dead letters,
// purges old ones, and pauses or resumes buckets. It talks to the database
// directly through gormrelay.Admin, used through the operator API
// (ops.Operator), and needs no running relay.
//
//	outboxctl [flags] status
//	outboxctl [flags] dead-letters list [--topic T] [--key K | --key-base64 B | --keyless] [--state failed|parked]
//	                                    [--bucket N] [--since T] [--until T] [--limit N] [--cursor C]
//	outboxctl [flags] dead-letters show ID
//	outboxctl [flags] dead-letters discard ID...
//	outboxctl [flags] requeue ID... | --key K | --key-base64 B | --all [--topic T]
//	outboxctl [flags] purge --older-than 72h|2024-05-01T00:00:00Z
//	outboxctl [flags] pause BUCKET
//	outboxctl [flags] resume BUCKET
//	outboxctl [flags] --mode wal wal slot status|create|drop [--force]
//	outboxctl [flags] --mode wal wal switch table-mark | table-drained MARK | table-relays-stopped | wal-mark | published-through LSN
//
// An outbox in WAL mode (outbox.ModeWAL, package pgwal) is operated with
// --mode wal (or OUTBOX_MODE=wal) and --name (or OUTBOX_NAME, the outbox's
// Config.Name; default the messages table name), plus --wal-slot and
// --wal-lease-table when the readers' pgwal.Config sets them: status then
// shows the replication slot, requeue emits dead letters into the WAL
// again (pgwal.Admin), "wal slot" creates, inspects and drops the slot,
// and "wal switch" runs the checks of the staged switch between the modes
// (docs/wal-mode.md): table-mark prints the messages table's highest id,
// wal-mark writes a marker into the WAL and prints its position
// (16/B374D848), and table-drained, table-relays-stopped and
// published-through exit 0 when they hold, 3 while they do not yet. Its dead-letter ids are negated WAL positions (-8939315240): an
// argument of negative ids is an id, not a flag ("dead-letters show
// -8939315240", "requeue -1,-2"); "--" before the ids works as well.
//
// Connection: --dsn (or OUTBOX_DSN; mysql://user:pass@host:3306/db URLs
// are accepted) and --driver postgres|mysql|sqlite (or OUTBOX_DRIVER;
// guessed from the DSN when unset, refused when the DSN plainly belongs to
// another driver). Tables: --prefix, or
// --messages-table and friends, --schema, and --buckets (the outbox's
// BucketCount). --json prints JSON for scripts instead of tables.
//
// Exit status: 0 on success, 1 when the operation failed (database error,
// missing tables, unknown dead letter or key, invalid bucket), 2 on a
// usage error, 3 when a "wal switch" check does not hold yet. The DSN is
// never printed, and its password is scrubbed from every error message.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/pgwal"
)

// Exit statuses.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
	// exitNotYet is a "wal switch" check that does not hold yet.
	exitNotYet = 3
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// usageError is a mistake on the command line.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

// globals are the flags every subcommand accepts, and the command's
// state.
type globals struct {
	dsn, driver              string
	prefix, schema           string
	messages, leases, relays string
	deadLetters              string
	buckets                  int
	mode, name               string
	walSlot, walLeases       string
	json, help               bool
	timeout, liveWindow      time.Duration
	connectTimeout           time.Duration

	out, errOut io.Writer
	getenv      func(string) string
	redact      redactor
	op          ops.Operator  // the outbox's operator API: every command but schema
	cfg         outbox.Config // the outbox the operator API works on
	db          *gorm.DB
	wal         *pgwal.Admin // set in WAL mode
	runCtx      context.Context
	closeDB     func()
}

// newFlagSet returns a flag set with the global flags bound to g.
func newFlagSet(g *globals) *flag.FlagSet {
	fs := flag.NewFlagSet("outboxctl", flag.ContinueOnError)
	g.register(fs)
	return fs
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.dsn, "dsn", "", "database DSN (default $OUTBOX_DSN); never printed")
	fs.StringVar(&g.driver, "driver", "", "postgres, mysql or sqlite (default $OUTBOX_DRIVER, else guessed from the DSN)")
	fs.StringVar(&g.prefix, "prefix", "", "table name prefix, as outbox.WithPrefix (default $OUTBOX_PREFIX)")
	fs.StringVar(&g.schema, "schema", "", "schema (PostgreSQL) or database (MySQL) of the tables")
	fs.StringVar(&g.messages, "messages-table", "", "messages table (default <prefix>outbox_messages)")
	fs.StringVar(&g.leases, "leases-table", "", "leases table (default <prefix>outbox_leases)")
	fs.StringVar(&g.relays, "relays-table", "", "relays table (default <prefix>outbox_relays)")
	fs.StringVar(&g.deadLetters, "dead-letters-table", "", "dead-letters table (default <prefix>outbox_dead_letters)")
	fs.IntVar(&g.buckets, "buckets", 0, "the outbox's BucketCount (default $OUTBOX_BUCKETS, else 8)")
	fs.StringVar(&g.mode, "mode", "", "table or wal: the outbox's outbox.Config.Mode (default $OUTBOX_MODE, else table)")
	fs.StringVar(&g.name, "name", "", "the outbox's Config.Name, which WAL mode's message prefix and default slot derive from (default $OUTBOX_NAME, else the messages table name)")
	fs.StringVar(&g.walSlot, "wal-slot", "", "WAL mode: the replication slot (pgwal.Config.Slot; default outbox_<name>)")
	fs.StringVar(&g.walLeases, "wal-lease-table", "", "WAL mode: the slot's lease table (pgwal.Config.LeaseTable; default <leases-table>_wal)")
	fs.BoolVar(&g.json, "json", false, "print JSON instead of tables")
	fs.DurationVar(&g.timeout, "timeout", 60*time.Second, "bound on the whole command")
	fs.DurationVar(&g.liveWindow, "live-window", 30*time.Second, "a relay is live while its heartbeat is younger than this (its LeaseDuration)")
	fs.BoolVar(&g.help, "h", false, "show help")
	fs.BoolVar(&g.help, "help", false, "show help")
}

const usageText = `outboxctl: operate a gorm-outbox outbox

Usage:
  outboxctl [flags] status
  outboxctl [flags] dead-letters list [--topic T] [--key K | --key-base64 B | --keyless]
                                      [--state failed|parked] [--bucket N] [--since T] [--until T]
                                      [--limit N] [--cursor C]
  outboxctl [flags] dead-letters show ID
  outboxctl [flags] dead-letters discard ID...
  outboxctl [flags] requeue ID... | --key K | --key-base64 B | --all [--topic T]
  outboxctl [flags] purge --older-than DURATION|TIME
  outboxctl [flags] pause BUCKET
  outboxctl [flags] resume BUCKET
  outboxctl [flags] --mode wal [--name N] [--wal-slot S] wal slot status|create|drop [--force]
  outboxctl [flags] --mode wal [--name N] [--wal-slot S] wal switch CHECK
      CHECK: table-mark | table-drained MARK | table-relays-stopped | wal-mark | published-through LSN
  outboxctl --driver postgres|mysql|sqlite [--prefix P] [--schema S] schema [--format sql|golang-migrate|goose] [--out DIR]

Times are RFC 3339 (2024-05-01T00:00:00Z) or a duration meaning that long ago (72h).
Requeueing a keyed dead letter requeues every dead letter of its key in its bucket,
in order, followed by the key's pending messages: the key stays blocked otherwise.

In WAL mode (--mode wal) status shows the replication slot, requeue emits the dead
letters into the WAL again, in order, and pause/resume are refused. "wal slot drop"
refuses to drop a slot holding unpublished messages unless --force. WAL mode's
dead-letter ids are negative (negated WAL positions): an argument of negative
ids is an id, not a flag (dead-letters show -8939315240).

"wal switch" runs the checks of the staged switch between the modes (docs/wal-mode.md)
with no reader or publisher: table-mark prints the messages table's highest id, wal-mark
writes a marker into the WAL and prints its position (16/B374D848); table-drained MARK,
table-relays-stopped and published-through LSN exit 0 when they hold and 3 while they
do not yet.

Exit status: 0 success, 1 operation failed, 2 usage error, 3 a wal switch check does not hold yet.

Flags (accepted before or after the command):
`

// run is the whole program, for tests.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	g := &globals{out: stdout, errOut: stderr, getenv: getenv, connectTimeout: 10 * time.Second, runCtx: ctx}
	defer func() {
		if g.closeDB != nil {
			g.closeDB()
		}
	}()
	err := g.dispatch(ctx, args)
	var notYet errNotYet
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &notYet):
		if notYet.msg != "" {
			fmt.Fprintln(stderr, notYet.msg)
		}
		return exitNotYet
	case errors.As(err, new(usageError)), errors.Is(err, flag.ErrHelp):
		if !errors.Is(err, flag.ErrHelp) {
			g.printErr(err)
		}
		if errors.Is(err, flag.ErrHelp) || g.help {
			g.usage()
			return exitOK
		}
		fmt.Fprintln(stderr, "run 'outboxctl -h' for usage")
		return exitUsage
	default:
		g.printErr(g.explain(ctx, err))
		return exitFail
	}
}

func (g *globals) usage() {
	fmt.Fprint(g.errOut, usageText)
	fs := newFlagSet(&globals{})
	fs.SetOutput(g.errOut)
	fs.PrintDefaults()
}

// printErr prints err on stderr, as JSON with --json, with the DSN's
// password scrubbed.
func (g *globals) printErr(err error) {
	msg := g.redact.redact(err.Error())
	if g.json {
		b, _ := json.Marshal(map[string]string{"error": msg})
		fmt.Fprintln(g.errOut, string(b))
		return
	}
	fmt.Fprintln(g.errOut, "outboxctl: "+msg)
}

// negativeIDs matches an argument of negative dead-letter ids (WAL mode's
// ids are negated WAL positions), one or a comma-separated list: it is a
// positional argument, not a flag.
var negativeIDs = regexp.MustCompile(`^-[0-9]+(,-?[0-9]+)*,?$`)

// parse parses flags anywhere among the arguments and returns the
// positional ones. An argument of negative ids (negativeIDs) is
// positional unless it is the value of the flag before it.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for i := 0; i < len(args); i++ {
		if args[i] == "--" {
			break
		}
		if !negativeIDs.MatchString(args[i]) || (i > 0 && takesValue(fs, args[i-1])) {
			continue
		}
		more, err := parseFlags(fs, args[:i])
		if err != nil {
			return nil, err
		}
		pos = append(append(pos, more...), args[i])
		args, i = args[i+1:], -1
	}
	more, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	return append(pos, more...), nil
}

// parseFlags is parse without negative ids.
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		// After "--" everything is positional.
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func (g *globals) dispatch(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usagef("no command given")
	}
	// The command is the first positional argument; global flags may come
	// before it.
	fs := newFlagSet(g)
	cmdArgs := args
	var cmd string
	for i, a := range args {
		if !strings.HasPrefix(a, "-") {
			// Is it a flag's value? Only when the previous flag takes one.
			if i > 0 && takesValue(fs, args[i-1]) {
				continue
			}
			cmd = a
			cmdArgs = append(append([]string{}, args[:i]...), args[i+1:]...)
			break
		}
	}
	if cmd == "" {
		if _, err := parse(fs, args); err != nil {
			return err
		}
		if g.help {
			return flag.ErrHelp
		}
		return usagef("no command given")
	}

	switch cmd {
	case "status":
		return g.status(ctx, fs, cmdArgs)
	case "dead-letters", "dead-letter", "dl":
		return g.deadLettersCmd(ctx, fs, cmdArgs)
	case "requeue":
		return g.requeue(ctx, fs, cmdArgs)
	case "purge":
		return g.purge(ctx, fs, cmdArgs)
	case "pause", "resume":
		return g.pause(ctx, fs, cmdArgs, cmd == "pause")
	case "schema":
		return g.schemaCmd(fs, cmdArgs)
	case "wal":
		return g.walCmd(ctx, fs, cmdArgs)
	case "help":
		return flag.ErrHelp
	}
	return usagef("unknown command %q", cmd)
}

// takesValue reports whether arg is a flag of fs given without "=" that
// consumes the next argument.
func takesValue(fs *flag.FlagSet, arg string) bool {
	name := strings.TrimLeft(arg, "-")
	if name == "" || strings.Contains(name, "=") || arg == "--" {
		return false
	}
	f := fs.Lookup(name)
	if f == nil {
		return false
	}
	bf, ok := f.Value.(interface{ IsBoolFlag() bool })
	return !ok || !bf.IsBoolFlag()
}

// connect applies the environment, opens the database and builds the
// Admin.
func (g *globals) connect(ctx context.Context) error {
	if g.help {
		return flag.ErrHelp
	}
	if g.dsn == "" {
		g.dsn = g.getenv("OUTBOX_DSN")
	}
	g.redact = secrets(g.dsn)
	if g.dsn == "" {
		return usagef("no database: set --dsn or OUTBOX_DSN")
	}
	if g.driver == "" {
		g.driver = g.getenv("OUTBOX_DRIVER")
	}
	driver, err := resolveDriver(g.driver, g.dsn)
	if err != nil {
		return usageError{err.Error()}
	}
	if err := checkDriver(driver, g.dsn); err != nil {
		return usageError{err.Error()}
	}
	if g.prefix == "" {
		g.prefix = g.getenv("OUTBOX_PREFIX")
	}
	if g.buckets == 0 {
		if s := g.getenv("OUTBOX_BUCKETS"); s != "" {
			if g.buckets, err = strconv.Atoi(s); err != nil {
				return usagef("OUTBOX_BUCKETS=%q is not a number", s)
			}
		}
	}
	if g.mode == "" {
		g.mode = g.getenv("OUTBOX_MODE")
	}
	if g.name == "" {
		g.name = g.getenv("OUTBOX_NAME")
	}
	cfg := outbox.Config{Tables: g.tables(), BucketCount: g.buckets, Name: g.name}
	switch g.mode {
	case "", "table":
	case "wal":
		cfg.Mode = outbox.ModeWAL
	default:
		return usagef("--mode %q is neither table nor wal", g.mode)
	}

	db, err := openDB(driver, g.dsn)
	if err != nil {
		return fmt.Errorf("open %s database: %w", driver, err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return fmt.Errorf("open %s database: %w", driver, err)
	}
	// Closing the pool aborts the queries in flight when the program is
	// interrupted; run closes it at the end otherwise. The command's own
	// deadline ends its queries through ctx, and leaves the pool open for
	// explain.
	stop := context.AfterFunc(g.runCtx, func() { sqlDB.Close() })
	g.closeDB = func() {
		stop()
		sqlDB.Close()
	}
	pctx, cancel := context.WithTimeout(ctx, g.connectTimeout)
	defer cancel()
	if err := sqlDB.PingContext(pctx); err != nil {
		return fmt.Errorf("connect to the %s database: %w", driver, err)
	}
	g.db = db
	if cfg.Mode == outbox.ModeWAL {
		return g.connectWAL(db, cfg)
	}
	admin, err := gormrelay.NewAdmin(db, cfg)
	if err != nil {
		return usageError{err.Error()}
	}
	g.op, g.cfg = admin.WithLiveWindow(g.liveWindow), admin.Config()
	return nil
}

// missingTablesError says which outbox tables the database does not have
// and how to point outboxctl at the right ones.
type missingTablesError struct {
	missing []string
	schema  string
	err     error
}

func (e *missingTablesError) Error() string {
	where := "the connection's default schema"
	if e.schema != "" {
		where = "schema " + e.schema
	}
	return fmt.Sprintf("outbox table(s) %s not found in %s. The service's outbox.Config.Tables names them: "+
		"pass its schema with --schema (a PostgreSQL schema or MySQL database) and its prefix with --prefix "+
		"(outbox.WithPrefix), or each name with --messages-table, --leases-table, --relays-table, --dead-letters-table; "+
		"a new outbox creates them with Plugin.AutoMigrate or the DDL of 'outboxctl schema'",
		strings.Join(e.missing, ", "), where)
}

func (e *missingTablesError) Unwrap() error { return e.err }

// explain replaces a failed query's error by a missingTablesError when
// the database answers but outbox tables are missing.
func (g *globals) explain(ctx context.Context, err error) error {
	if g.db == nil || errors.As(err, new(usageError)) {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.connectTimeout)
	defer cancel()
	db := g.db.WithContext(ctx)
	var one int
	if db.Raw("SELECT 1").Row().Scan(&one) != nil {
		return err // the database does not answer: not a schema problem
	}
	t := g.cfg.Tables
	var missing []string
	for _, name := range []string{t.MessagesTable(), t.LeasesTable(), t.RelaysTable(), t.DeadLettersTable()} {
		if db.Exec("SELECT 1 FROM "+db.Statement.Quote(name)+" WHERE 1 = 0").Error != nil {
			missing = append(missing, name)
		}
	}
	if len(missing) == 0 {
		return err
	}
	return &missingTablesError{missing: missing, schema: t.Schema, err: err}
}

// tables returns the table names the flags and OUTBOX_PREFIX select.
func (g *globals) tables() outbox.Tables {
	if g.prefix == "" {
		g.prefix = g.getenv("OUTBOX_PREFIX")
	}
	tables := outbox.WithPrefix(g.prefix)
	tables.Schema = g.schema
	for _, o := range []struct {
		dst *string
		v   string
	}{{&tables.Messages, g.messages}, {&tables.Leases, g.leases}, {&tables.Relays, g.relays}, {&tables.DeadLetters, g.deadLetters}} {
		if o.v != "" {
			*o.dst = o.v
		}
	}
	return tables
}

// start parses a subcommand's arguments, bounds the command and
// connects.
func (g *globals) start(ctx context.Context, fs *flag.FlagSet, args []string) (context.Context, context.CancelFunc, []string, error) {
	ctx, cancel, pos, err := g.startLazy(ctx, fs, args)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := g.connect(ctx); err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return ctx, cancel, pos, nil
}

func (g *globals) printJSON(v any) error {
	enc := json.NewEncoder(g.out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (g *globals) status(ctx context.Context, fs *flag.FlagSet, args []string) error {
	ctx, cancel, pos, err := g.start(ctx, fs, args)
	if err != nil {
		return err
	}
	defer cancel()
	if len(pos) > 0 {
		return usagef("status takes no arguments")
	}
	st, err := g.op.Status(ctx)
	if err != nil {
		return err
	}
	if g.json {
		return g.printJSON(st)
	}
	if st.WAL != nil {
		printWALStatus(g.out, st, g.cfg)
		return nil
	}
	printStatus(g.out, st, g.cfg)
	return nil
}

func (g *globals) deadLettersCmd(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var (
		q                   ops.DeadLetterQuery
		key, keyB64         string
		state, since, until string
		bucket              = -1
		hasKey              bool
		topic, cursor       string
		limit               int
		keyless             bool
	)
	fs.StringVar(&topic, "topic", "", "list: only this topic")
	fs.Func("key", "list: only this key (text)", func(s string) error { key, hasKey = s, true; return nil })
	fs.StringVar(&keyB64, "key-base64", "", "list: only this key (base64)")
	fs.BoolVar(&keyless, "keyless", false, "list: only keyless messages")
	fs.StringVar(&state, "state", "", "list: failed or parked")
	fs.IntVar(&bucket, "bucket", -1, "list: only this bucket")
	fs.StringVar(&since, "since", "", "list: died at or after this time")
	fs.StringVar(&until, "until", "", "list: died before this time")
	fs.IntVar(&limit, "limit", ops.DeadLetterPageDefault, "list: page size")
	fs.StringVar(&cursor, "cursor", "", "list: continue after a previous page")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if g.help {
		return flag.ErrHelp
	}
	if len(pos) == 0 {
		return usagef("dead-letters needs a subcommand: list, show ID or discard ID...")
	}
	sub, rest := pos[0], pos[1:]
	var ids []int64
	switch sub {
	case "list", "ls":
		if len(rest) > 0 {
			return usagef("dead-letters list takes no arguments")
		}
		q = ops.DeadLetterQuery{Topic: topic, State: ops.DeadLetterState(state), Limit: limit, Cursor: cursor, Keyless: keyless}
		if q.Key, err = keyArg(hasKey, key, keyB64); err != nil {
			return err
		}
		if bucket >= 0 {
			q.Bucket = &bucket
		}
		now := time.Now()
		if q.Since, err = ops.ParseTime(since, now); err != nil {
			return usagef("--since: %v", err)
		}
		if q.Until, err = ops.ParseTime(until, now); err != nil {
			return usagef("--until: %v", err)
		}
	case "show", "discard", "rm":
		if ids, err = parseIDs(rest); err != nil {
			return err
		}
		if sub == "show" && len(ids) != 1 {
			return usagef("dead-letters show takes one id")
		}
	default:
		return usagef("unknown dead-letters subcommand %q: use list, show or discard", sub)
	}

	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	if err := g.connect(ctx); err != nil {
		return err
	}
	switch sub {
	case "list", "ls":
		page, err := g.op.DeadLetters(ctx, q)
		if err != nil {
			return err
		}
		if g.json {
			if page.Items == nil {
				page.Items = []ops.DeadLetter{}
			}
			return g.printJSON(page)
		}
		printDeadLetters(g.out, page)
	case "show":
		d, err := g.op.DeadLetter(ctx, ids[0])
		if err != nil {
			return err
		}
		if g.json {
			return g.printJSON(d)
		}
		printDeadLetter(g.out, d)
		if d.State == ops.DeadLetterParked {
			return g.printBlockers(ctx, d)
		}
	default:
		n, err := g.op.DiscardDeadLetters(ctx, ids...)
		if err != nil {
			return err
		}
		if g.json {
			return g.printJSON(map[string]int64{"discarded": n})
		}
		fmt.Fprintf(g.out, "discarded %d dead letter(s)\n", n)
	}
	return nil
}

func keyArg(hasText bool, text, b64 string) ([]byte, error) {
	switch {
	case hasText && b64 != "":
		return nil, usagef("give --key or --key-base64, not both")
	case hasText:
		return []byte(text), nil
	case b64 != "":
		k, err := decodeBase64(b64)
		if err != nil {
			return nil, usagef("--key-base64: %v", err)
		}
		return k, nil
	}
	return nil, nil
}

func parseIDs(args []string) ([]int64, error) {
	if len(args) == 0 {
		return nil, usagef("no dead-letter id given")
	}
	ids := make([]int64, 0, len(args))
	for _, a := range args {
		for _, part := range strings.Split(a, ",") {
			if part == "" {
				continue
			}
			id, err := strconv.ParseInt(part, 10, 64)
			if err != nil {
				return nil, usagef("dead-letter id %q is not a number", part)
			}
			ids = append(ids, id)
		}
	}
	return ids, nil
}

func (g *globals) requeue(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var (
		key, keyB64, topic string
		hasKey, all        bool
	)
	fs.Func("key", "requeue every dead letter of this key (text)", func(s string) error { key, hasKey = s, true; return nil })
	fs.StringVar(&keyB64, "key-base64", "", "requeue every dead letter of this key (base64)")
	fs.BoolVar(&all, "all", false, "requeue every dead letter (with --topic: of that topic)")
	fs.StringVar(&topic, "topic", "", "with --all: only this topic")
	ctx, cancel, pos, err := g.startLazy(ctx, fs, args)
	if err != nil {
		return err
	}
	defer cancel()
	k, err := keyArg(hasKey, key, keyB64)
	if err != nil {
		return err
	}
	modes := 0
	for _, set := range []bool{len(pos) > 0, k != nil, all} {
		if set {
			modes++
		}
	}
	if modes != 1 {
		return usagef("requeue takes exactly one of: ids, --key, --key-base64, --all")
	}
	if topic != "" && !all {
		return usagef("--topic goes with --all")
	}
	var ids []int64
	if len(pos) > 0 {
		if ids, err = parseIDs(pos); err != nil {
			return err
		}
	}
	if err := g.connect(ctx); err != nil {
		return err
	}
	var res ops.RequeueResult
	switch {
	case ids != nil:
		res, err = g.op.RequeueIDs(ctx, ids...)
	case k != nil:
		res, err = g.op.RequeueKey(ctx, k)
		if err == nil && res.Requeued == 0 {
			return fmt.Errorf("%w: no dead letter has key %s", ops.ErrNotFound, printable(k, 0))
		}
	default:
		res, err = g.op.RequeueAll(ctx, topic)
	}
	if err != nil {
		if res.Requeued > 0 {
			err = fmt.Errorf("%w (after requeueing %d dead letter(s))", err, res.Requeued)
		}
		return err
	}
	if g.json {
		return g.printJSON(res)
	}
	fmt.Fprintf(g.out, "requeued %d dead letter(s)", res.Requeued)
	if res.Moved > 0 {
		fmt.Fprintf(g.out, ", moved %d pending message(s) of their keys behind them", res.Moved)
	}
	if len(res.Buckets) > 0 {
		fmt.Fprintf(g.out, " in bucket(s) %s", joinInts(res.Buckets))
	}
	fmt.Fprintln(g.out)
	if len(res.NotFound) > 0 {
		fmt.Fprintf(g.out, "not dead letters: %s\n", joinInts(res.NotFound))
	}
	if ids != nil && len(res.NotFound) == len(ids) {
		return fmt.Errorf("%w: none of the ids is a dead letter", ops.ErrNotFound)
	}
	return nil
}

// startLazy parses the arguments and bounds the command, without
// connecting: the caller validates the arguments first.
func (g *globals) startLazy(ctx context.Context, fs *flag.FlagSet, args []string) (context.Context, context.CancelFunc, []string, error) {
	pos, err := parse(fs, args)
	if err != nil {
		return nil, nil, nil, err
	}
	if g.help {
		return nil, nil, nil, flag.ErrHelp
	}
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	return ctx, cancel, pos, nil
}

func (g *globals) purge(ctx context.Context, fs *flag.FlagSet, args []string) error {
	var olderThan string
	fs.StringVar(&olderThan, "older-than", "", "purge dead letters that died before this time or this long ago (required)")
	ctx, cancel, pos, err := g.startLazy(ctx, fs, args)
	if err != nil {
		return err
	}
	defer cancel()
	if len(pos) > 0 {
		return usagef("purge takes no arguments")
	}
	if olderThan == "" {
		return usagef("purge needs --older-than (a duration such as 720h, or an RFC 3339 time)")
	}
	t, err := ops.ParseTime(olderThan, time.Now())
	if err != nil {
		return usagef("--older-than: %v", err)
	}
	if err := g.connect(ctx); err != nil {
		return err
	}
	n, err := g.op.PurgeDeadLetters(ctx, t)
	if err != nil {
		return err
	}
	if g.json {
		return g.printJSON(map[string]any{"purged": n, "older_than": t})
	}
	fmt.Fprintf(g.out, "purged %d dead letter(s) that died before %s\n", n, t.Format(time.RFC3339))
	return nil
}

func (g *globals) pause(ctx context.Context, fs *flag.FlagSet, args []string, paused bool) error {
	ctx, cancel, pos, err := g.startLazy(ctx, fs, args)
	if err != nil {
		return err
	}
	defer cancel()
	verb := map[bool]string{true: "pause", false: "resume"}[paused]
	if len(pos) != 1 {
		return usagef("%s takes one bucket number", verb)
	}
	b, err := strconv.Atoi(pos[0])
	if err != nil {
		return usagef("bucket %q is not a number", pos[0])
	}
	if err := g.connect(ctx); err != nil {
		return err
	}
	// Whether the bucket was paused before, where the operator can tell
	// (table mode), so that a pause or resume that changes nothing says so.
	was, known := false, false
	if pr, ok := g.op.(interface {
		BucketPaused(context.Context, int) (bool, error)
	}); ok {
		if was, err = pr.BucketPaused(ctx, b); err != nil {
			return err
		}
		known = true
	}
	if paused {
		err = g.op.PauseBucket(ctx, b)
	} else {
		err = g.op.ResumeBucket(ctx, b)
	}
	if err != nil {
		return err
	}
	if g.json {
		out := map[string]any{"bucket": b, "paused": paused}
		if known {
			out["changed"] = was != paused
		}
		return g.printJSON(out)
	}
	switch {
	case known && was == paused && paused:
		fmt.Fprintf(g.out, "bucket %d was already paused\n", b)
	case known && was == paused:
		fmt.Fprintf(g.out, "bucket %d was not paused; nothing changed\n", b)
	case paused:
		fmt.Fprintf(g.out, "bucket %d paused: its relay releases it at its next lease refresh\n", b)
	default:
		fmt.Fprintf(g.out, "bucket %d resumed\n", b)
	}
	return nil
}

// printBlockers prints, for parked dead letter d, the failed dead letters
// of its key in its bucket, which it waits behind, and how to requeue them
// all.
func (g *globals) printBlockers(ctx context.Context, d ops.DeadLetter) error {
	b := d.Bucket
	q := ops.DeadLetterQuery{State: ops.DeadLetterFailed, Bucket: &b, Key: d.Key, Keyless: d.Key == nil, Limit: ops.DeadLetterPageMax}
	page, err := g.op.DeadLetters(ctx, q)
	if err != nil {
		return err
	}
	fmt.Fprintln(g.out)
	if len(page.Items) == 0 {
		fmt.Fprintf(g.out, "It waited behind a failed message of its key in bucket %d, which is no dead letter any more (requeued or discarded): requeue this one (outboxctl requeue %d).\n", d.Bucket, d.ID)
		return nil
	}
	slices.SortFunc(page.Items, func(a, b ops.DeadLetter) int { return cmp.Compare(a.ID, b.ID) })
	fmt.Fprintf(g.out, "It waits behind the failed dead letter(s) of its key in bucket %d:\n", d.Bucket)
	for _, f := range page.Items {
		fmt.Fprintf(g.out, "  %d (message %s, topic %s): %s\n", f.ID, f.MessageID, f.Topic, errorSummary(f.LastError))
	}
	fmt.Fprintf(g.out, "Fix the cause, then requeue the key, in order, failed and parked together: outboxctl requeue %d\n", page.Items[0].ID)
	return nil
}
