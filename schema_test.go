package outbox_test

import (
	"bufio"
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	mysqldriver "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
	gormschema "gorm.io/gorm/schema"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/migrations"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

var updateMigrations = flag.Bool("update-migrations", false, "rewrite the files under migrations/ from outbox.MigrationFiles")

// migrationDir is where the shipped files of a dialect and format live.
func migrationDir(dialect, format string) string {
	if format == outbox.FormatGoose {
		return filepath.Join("migrations", dialect, "goose")
	}
	return filepath.Join("migrations", dialect)
}

// The files under migrations/ are MigrationFiles for the default tables,
// byte for byte: they never drift from the Go function. Regenerate with
// go generate (go test -run TestMigrationFiles -update-migrations .).
func TestMigrationFiles(t *testing.T) {
	t.Parallel()
	for _, dialect := range dbtest.Dialects {
		for _, format := range []string{outbox.FormatGolangMigrate, outbox.FormatGoose} {
			files, err := outbox.MigrationFiles(dialect, outbox.Tables{}, format)
			require.NoError(t, err)
			dir := migrationDir(dialect, format)
			if *updateMigrations {
				require.NoError(t, os.MkdirAll(dir, 0o755))
				old, _ := filepath.Glob(filepath.Join(dir, "*.sql"))
				for _, f := range old {
					require.NoError(t, os.Remove(f))
				}
				for _, f := range files {
					require.NoError(t, os.WriteFile(filepath.Join(dir, f.Name), f.Content, 0o644))
				}
			}
			requireMigrationDir(t, dir, files, "outbox.MigrationFiles")
		}
	}
}

// requireMigrationDir checks that dir holds exactly files, byte for byte,
// and (unless they were just regenerated) that migrations.FS embeds the
// same bytes; source names the function that produces them.
func requireMigrationDir(t *testing.T, dir string, files []outbox.MigrationFile, source string) {
	t.Helper()
	var want []string
	for _, f := range files {
		want = append(want, f.Name)
		got, err := os.ReadFile(filepath.Join(dir, f.Name))
		require.NoError(t, err, "missing file: run go generate")
		require.Equal(t, string(f.Content), string(got), "%s/%s differs from %s: run go generate", dir, f.Name, source)
		if !*updateMigrations { // migrations.FS was embedded before the update
			embedded, err := fs.ReadFile(migrations.FS, filepath.ToSlash(filepath.Join(strings.TrimPrefix(dir, "migrations"+string(filepath.Separator)), f.Name)))
			require.NoError(t, err, "migrations.FS lacks %s", f.Name)
			require.Equal(t, got, embedded)
		}
	}
	onDisk, err := filepath.Glob(filepath.Join(dir, "*.sql"))
	require.NoError(t, err)
	for i := range onDisk {
		onDisk[i] = filepath.Base(onDisk[i])
	}
	require.ElementsMatch(t, want, onDisk, "%s holds files %s does not produce", dir, source)
}

func TestSchemaSQLArguments(t *testing.T) {
	t.Parallel()
	_, err := outbox.SchemaSQL("oracle", outbox.Tables{})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "dialect")

	_, err = outbox.SchemaSQL("postgres", outbox.Tables{Messages: "bad-name"})
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "Tables.Messages")

	_, err = outbox.MigrationFiles("postgres", outbox.Tables{}, "flyway")
	require.ErrorContains(t, err, "format")

	// Aliases and GORM's dialector names give the same statements.
	for alias, dialect := range map[string]string{"postgresql": "postgres", "pgx": "postgres", "mariadb": "mysql", "sqlite3": "sqlite", "MySQL": "mysql"} {
		a, err := outbox.SchemaSQL(alias, outbox.Tables{})
		require.NoError(t, err)
		b, err := outbox.SchemaSQL(dialect, outbox.Tables{})
		require.NoError(t, err)
		require.Equal(t, b, a, alias)
	}

	// Names and schema reach every statement, quoted.
	stmts, err := outbox.SchemaSQL("postgres", outbox.Tables{Schema: "billing", Messages: "msgs"})
	require.NoError(t, err)
	require.Contains(t, stmts[0], `CREATE TABLE IF NOT EXISTS "billing"."msgs" (`)
	require.Equal(t, `CREATE INDEX IF NOT EXISTS "idx_msgs_bucket_id" ON "billing"."msgs" ("bucket", "id")`, stmts[1])
	stmts, err = outbox.SchemaSQL("mysql", outbox.Tables{Schema: "billing"})
	require.NoError(t, err)
	require.Contains(t, stmts[0], "CREATE TABLE IF NOT EXISTS `billing`.`outbox_messages` (")
	require.Contains(t, stmts[0], "INDEX `idx_outbox_messages_bucket_id` (`bucket`, `id`)")
	stmts, err = outbox.SchemaSQL("sqlite", outbox.Tables{Schema: "aux"})
	require.NoError(t, err)
	require.Equal(t, `CREATE INDEX IF NOT EXISTS "aux"."idx_outbox_messages_bucket_id" ON "outbox_messages" ("bucket", "id")`, stmts[1])

	ms, err := outbox.Migrations("sqlite", outbox.Tables{})
	require.NoError(t, err)
	require.Len(t, ms, outbox.SchemaVersion)
	require.Equal(t, "000001_outbox", ms[0].ID())
	require.Equal(t, []string{
		`DROP TABLE IF EXISTS "outbox_dead_letters"`,
		`DROP TABLE IF EXISTS "outbox_relays"`,
		`DROP TABLE IF EXISTS "outbox_leases"`,
		`DROP TABLE IF EXISTS "outbox_messages"`,
	}, ms[0].Down)
}

// schemaConfigs are the table configurations the equivalence test runs:
// the defaults, and mixed-case names long enough that GORM shortens the
// index names with a hash, qualified by the test's schema where the
// database has schemas.
func schemaConfigs(db *dbtest.DB) map[string]outbox.Tables {
	custom := outbox.WithPrefix("Billing_Long_Prefix_For_Hashed_Index_Names_")
	if db.Dialect != dbtest.SQLite {
		custom.Schema = db.Namespace
	}
	return map[string]outbox.Tables{"defaults": {}, "custom": custom}
}

func tableNames(tables outbox.Tables) []string {
	cfg := outbox.Config{Tables: tables}.WithDefaults()
	return []string{cfg.Tables.Messages, cfg.Tables.Leases, cfg.Tables.Relays, cfg.Tables.DeadLetters}
}

// SchemaSQL and AutoMigrate build the same tables: same columns, types,
// nullability, defaults, keys and indexes, read back from the catalog.
// And AutoMigrate, run over tables made from the SQL, finds nothing to do.
func TestSchemaSQLMatchesAutoMigrate(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, viaGorm *dbtest.DB) {
		ctx := context.Background()
		viaSQL := dbtest.Open(t, viaGorm.Dialect)
		for name, tables := range schemaConfigs(viaGorm) {
			sqlTables := tables
			if sqlTables.Schema != "" {
				sqlTables.Schema = viaSQL.Namespace
			}
			require.NoError(t, tables.AutoMigrate(ctx, viaGorm.DB), name)
			stmts, err := outbox.SchemaSQL(viaSQL.Dialect, sqlTables)
			require.NoError(t, err)
			for _, s := range stmts {
				require.NoError(t, viaSQL.DB.Exec(s).Error, "%s: %s", name, s)
			}

			for _, table := range tableNames(tables) {
				want := describe(t, viaGorm, table)
				got := describe(t, viaSQL, table)
				require.NotEmpty(t, want.Columns, "%s: %s", name, table)
				require.Equal(t, want, got, "%s: table %s: SchemaSQL and AutoMigrate differ", name, table)
			}

			rec := &sqlRecorder{Interface: logger.Discard}
			require.NoError(t, sqlTables.AutoMigrate(ctx, viaSQL.DB.Session(&gorm.Session{Logger: rec})))
			require.Empty(t, schemaChanges(rec), "%s: AutoMigrate wants to change tables made by SchemaSQL", name)
		}
	})
}

type tableInfo struct {
	Columns []string
	Indexes []string
	Extra   []string
}

// describe reads a table's definition from the database catalog, with the
// test's namespace replaced by "S" so two databases compare equal.
func describe(t *testing.T, db *dbtest.DB, table string) tableInfo {
	t.Helper()
	var info tableInfo
	rows := func(q string, args ...any) [][]string {
		t.Helper()
		r, err := db.DB.Raw(q, args...).Rows()
		require.NoError(t, err, q)
		defer r.Close()
		cols, err := r.Columns()
		require.NoError(t, err)
		var out [][]string
		for r.Next() {
			vals := make([]sql.NullString, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			require.NoError(t, r.Scan(ptrs...))
			row := make([]string, len(cols))
			for i, v := range vals {
				row[i] = strings.ReplaceAll(v.String, db.Namespace, "S")
				if !v.Valid {
					row[i] = "NULL"
				}
			}
			out = append(out, row)
		}
		require.NoError(t, r.Err())
		return out
	}
	join := func(rs [][]string) []string {
		out := make([]string, len(rs))
		for i, r := range rs {
			out[i] = strings.Join(r, " | ")
		}
		return out
	}
	switch db.Dialect {
	case dbtest.Postgres:
		info.Columns = join(rows(`SELECT column_name, data_type, COALESCE(character_maximum_length, 0)::text, is_nullable, column_default
			FROM information_schema.columns WHERE table_schema = ? AND table_name = ? ORDER BY ordinal_position`, db.Namespace, table))
		info.Indexes = join(rows(`SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = ? AND tablename = ? ORDER BY indexname`, db.Namespace, table))
		info.Extra = join(rows(`SELECT constraint_name, constraint_type FROM information_schema.table_constraints
			WHERE table_schema = ? AND table_name = ? AND constraint_type <> 'CHECK' ORDER BY constraint_name`, db.Namespace, table))
	case dbtest.MySQL:
		info.Columns = join(rows(`SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, COLUMN_DEFAULT, EXTRA, COLUMN_KEY
			FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY ORDINAL_POSITION`, db.Namespace, table))
		info.Indexes = join(rows(`SELECT INDEX_NAME, NON_UNIQUE, GROUP_CONCAT(COLUMN_NAME ORDER BY SEQ_IN_INDEX)
			FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? GROUP BY INDEX_NAME, NON_UNIQUE ORDER BY INDEX_NAME`, db.Namespace, table))
		info.Extra = join(rows(`SELECT ENGINE, TABLE_COLLATION FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?`, db.Namespace, table))
	case dbtest.SQLite:
		info.Columns = join(rows(`SELECT name, type, "notnull", dflt_value, pk FROM pragma_table_info(?) ORDER BY cid`, table))
		for _, ix := range rows(`SELECT name, "unique", origin, partial FROM pragma_index_list(?) ORDER BY name`, table) {
			cols := rows(`SELECT name FROM pragma_index_info(?) ORDER BY seqno`, ix[0])
			info.Indexes = append(info.Indexes, strings.Join(ix, " | ")+" | "+strings.Join(join(cols), ","))
		}
		info.Extra = join(rows(`SELECT instr(upper(sql), 'AUTOINCREMENT') > 0 FROM sqlite_master WHERE type = 'table' AND name = ?`, table))
	}
	return info
}

// schemaChanges returns the recorded statements that change the schema.
func schemaChanges(r *sqlRecorder) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, s := range r.sql {
		up := strings.ToUpper(strings.TrimSpace(s))
		if strings.HasPrefix(up, "CREATE") || strings.HasPrefix(up, "ALTER") || strings.HasPrefix(up, "DROP") {
			out = append(out, s)
		}
	}
	return out
}

// applyGolangMigrate runs a golang-migrate file as that tool does: the
// whole file in one multi-statement Exec.
func applyGolangMigrate(t *testing.T, db *dbtest.DB, path string) {
	t.Helper()
	script, err := os.ReadFile(path)
	require.NoError(t, err)
	conn := rawDB(t, db)
	_, err = conn.Exec(string(script))
	require.NoError(t, err, path)
}

// rawDB opens a database/sql pool on db that accepts multi-statement
// scripts, as golang-migrate's drivers do.
func rawDB(t *testing.T, db *dbtest.DB) *sql.DB {
	t.Helper()
	var (
		conn *sql.DB
		err  error
	)
	switch db.Dialect {
	case dbtest.MySQL:
		cfg, perr := mysqldriver.ParseDSN(db.DSN)
		require.NoError(t, perr)
		cfg.MultiStatements = true
		conn, err = sql.Open("mysql", cfg.FormatDSN())
	case dbtest.Postgres:
		conn, err = sql.Open("pgx", db.DSN)
	default:
		// The SQLite test database allows one connection: use it.
		conn, err = db.DB.DB()
		return conn
	}
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// gooseStatements splits a goose file as goose does: the statements of
// the "-- +goose Up" or "-- +goose Down" section, each ending at a line
// whose last word ends with a semicolon.
func gooseStatements(t *testing.T, path, section string) []string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var (
		stmts   []string
		buf     strings.Builder
		current string
	)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch strings.TrimSpace(line) {
		case "-- +goose Up":
			require.Empty(t, current, "Up must come first, once")
			current = "Up"
			continue
		case "-- +goose Down":
			require.Equal(t, "Up", current, "Down must follow Up")
			require.Empty(t, strings.TrimSpace(buf.String()), "unterminated Up statement")
			current = "Down"
			continue
		}
		if buf.Len() == 0 && (strings.HasPrefix(strings.TrimSpace(line), "--") || strings.TrimSpace(line) == "") {
			continue
		}
		require.NotEmpty(t, current, "statement before -- +goose Up: %q", line)
		buf.WriteString(line + "\n")
		if strings.HasSuffix(strings.TrimSpace(line), ";") {
			if current == section {
				stmts = append(stmts, strings.TrimSpace(buf.String()))
			}
			buf.Reset()
		}
	}
	require.NoError(t, sc.Err())
	require.Empty(t, strings.TrimSpace(buf.String()), "unterminated statement")
	require.NotEmpty(t, stmts)
	return stmts
}

// applyGoose runs a section of a goose file as goose does: statement by
// statement in one transaction.
func applyGoose(t *testing.T, db *dbtest.DB, path, section string) {
	t.Helper()
	tx, err := rawDB(t, db).Begin()
	require.NoError(t, err)
	for _, s := range gooseStatements(t, path, section) {
		if _, err := tx.Exec(s); err != nil {
			_ = tx.Rollback()
			require.NoError(t, err, s)
		}
	}
	require.NoError(t, tx.Commit())
}

// applyMigration applies the up (or the down) migration of files, the
// files of format in dir, as the format's tool does.
func applyMigration(t *testing.T, db *dbtest.DB, dir, format string, files []outbox.MigrationFile, up bool) {
	t.Helper()
	switch {
	case format == outbox.FormatGoose && up:
		applyGoose(t, db, filepath.Join(dir, files[0].Name), "Up")
	case format == outbox.FormatGoose:
		applyGoose(t, db, filepath.Join(dir, files[0].Name), "Down")
	case up:
		applyGolangMigrate(t, db, filepath.Join(dir, files[0].Name))
	default:
		applyGolangMigrate(t, db, filepath.Join(dir, files[1].Name))
	}
}

// A relay runs on tables made only from the shipped migration files, in
// both formats: enqueue through the plugin, DrainOnce, rows gone. Down
// removes every table, and up runs again.
func TestMigrationFilesRunRelay(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, first *dbtest.DB) {
		for _, format := range []string{outbox.FormatGolangMigrate, outbox.FormatGoose} {
			db := first
			if format == outbox.FormatGoose {
				db = dbtest.Open(t, first.Dialect)
			}
			files, err := outbox.MigrationFiles(db.Dialect, outbox.Tables{}, format)
			require.NoError(t, err)
			dir := migrationDir(db.Dialect, format)
			up := func() { applyMigration(t, db, dir, format, files, true) }
			down := func() { applyMigration(t, db, dir, format, files, false) }
			up()
			up() // idempotent: adopting existing tables is a no-op

			relayOnce(t, db)

			down()
			for _, table := range tableNames(outbox.Tables{}) {
				require.False(t, db.DB.Migrator().HasTable(table), "%s: %s left after down", format, table)
			}
			up()
			relayOnce(t, db)
		}
	})
}

// relayPlugins keeps the plugin registered on each test database.
var relayPlugins sync.Map // *gorm.DB -> *outbox.Plugin

// relayOnce enqueues three messages through the plugin in one transaction
// and drains them with DrainOnce and a function publisher.
func relayOnce(t *testing.T, db *dbtest.DB) {
	t.Helper()
	ctx := context.Background()
	pv, loaded := relayPlugins.Load(db.DB)
	if !loaded {
		p, err := outbox.NewPlugin(outbox.Config{})
		require.NoError(t, err)
		require.NoError(t, db.DB.Use(p))
		relayPlugins.Store(db.DB, p)
		t.Cleanup(func() { relayPlugins.Delete(db.DB) })
		pv = p
	}
	p := pv.(*outbox.Plugin)
	require.NoError(t, db.DB.Transaction(func(tx *gorm.DB) error {
		for i := range 3 {
			if err := p.EnqueueJSON(tx, "orders", fmt.Appendf(nil, "order-%d", i), map[string]int{"n": i}); err != nil {
				return err
			}
		}
		return nil
	}))

	store, err := gormrelay.NewStore(db.DB, p.Config())
	require.NoError(t, err)
	require.NoError(t, store.CheckSchema(ctx))
	var (
		mu   sync.Mutex
		seen []string
	)
	r, err := relay.New(store, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range msgs {
			seen = append(seen, string(m.Key)+"="+string(m.Value))
		}
		return len(msgs), nil
	}), relay.Config{Logger: dbtest.Logger(t)})
	require.NoError(t, err)
	n, err := r.DrainOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	slices.Sort(seen)
	require.Equal(t, []string{`order-0={"n":0}`, `order-1={"n":1}`, `order-2={"n":2}`}, seen)
	var left int64
	require.NoError(t, db.DB.Table(p.Config().Tables.MessagesTable()).Count(&left).Error)
	require.Zero(t, left)
}

// A relay started on tables older than it needs stops with a
// *relay.MisconfigurationError wrapping a *SchemaError that names the
// missing column and the migration, before it touches a row.
func TestStoreCheckSchema(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		cfg := outbox.Config{Tables: outbox.WithPrefix("old_")}
		stmts, err := outbox.SchemaSQL(db.Dialect, cfg.Tables)
		require.NoError(t, err)
		for _, s := range stmts {
			require.NoError(t, db.DB.Exec(s).Error)
		}
		store, err := gormrelay.NewStore(db.DB, cfg)
		require.NoError(t, err)
		require.NoError(t, store.CheckSchema(ctx))

		// An outbox from an older release: a column this one needs is
		// missing.
		require.NoError(t, db.DB.Exec("ALTER TABLE old_outbox_messages DROP COLUMN next_attempt_at_ms").Error)
		err = store.CheckSchema(ctx)
		var se *outbox.SchemaError
		require.ErrorAs(t, err, &se)
		require.Equal(t, outbox.SchemaError{Table: "old_outbox_messages", Column: "next_attempt_at_ms", Migration: "000001_outbox"}, *se)
		require.ErrorIs(t, err, outbox.ErrSchemaOutdated)
		require.EqualError(t, err, "outbox: table old_outbox_messages has no column next_attempt_at_ms: apply the outbox migrations up to 000001_outbox (github.com/gorm-outbox/outbox/migrations, or outbox.Migrations) or run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)) or Tables.AutoMigrate before starting the relay")

		// The relay stops on it at start.
		r, err := relay.New(store, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
			t.Error("published on an outdated schema")
			return 0, nil
		}), relay.Config{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		_, err = r.DrainOnce(ctx)
		var me *relay.MisconfigurationError
		require.ErrorAs(t, err, &me)
		require.Equal(t, "Tables", me.Setting)
		require.ErrorAs(t, err, &se)
		require.Equal(t, "next_attempt_at_ms", se.Column)

		// A missing table.
		require.NoError(t, cfg.Tables.AutoMigrate(ctx, db.DB)) // adds the column back
		require.NoError(t, store.CheckSchema(ctx))
		require.NoError(t, db.DB.Migrator().DropTable(cfg.Tables.RelaysTable()))
		err = store.CheckSchema(ctx)
		require.ErrorAs(t, err, &se)
		require.Equal(t, outbox.SchemaError{Table: "old_outbox_relays", Migration: "000001_outbox"}, *se)
		require.EqualError(t, err, "outbox: table old_outbox_relays is missing: create the outbox tables before starting the relay: run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)) or Tables.AutoMigrate, or apply the outbox migrations up to 000001_outbox (github.com/gorm-outbox/outbox/migrations, or outbox.Migrations)")
		_, err = r.DrainOnce(ctx)
		require.ErrorAs(t, err, &me)
		require.ErrorContains(t, err, "relay: misconfiguration: Tables: an outbox table is missing (AutoMigrate or the outbox migrations were not run): outbox: table old_outbox_relays is missing")

		// Migrated: the relay runs.
		require.NoError(t, cfg.Tables.AutoMigrate(ctx, db.DB))
		require.NoError(t, store.CheckSchema(ctx))
		r, err = relay.New(store, relay.PublisherFunc(func(_ context.Context, msgs []relay.Message) (int, error) {
			return len(msgs), nil
		}), relay.Config{Logger: dbtest.Logger(t)})
		require.NoError(t, err)
		_, err = r.DrainOnce(ctx)
		require.NoError(t, err)
	})
}

func ExampleSchemaSQL() {
	// The DDL of the outbox tables for a migration tool, here for SQLite
	// and prefixed table names; db.Dialector.Name() gives the dialect.
	stmts, err := outbox.SchemaSQL("sqlite", outbox.WithPrefix("billing_"))
	if err != nil {
		panic(err)
	}
	for _, s := range stmts {
		first, _, _ := strings.Cut(s, "\n")
		fmt.Println(first)
	}
	// Output:
	// CREATE TABLE IF NOT EXISTS "billing_outbox_messages" (
	// CREATE INDEX IF NOT EXISTS "idx_billing_outbox_messages_bucket_id" ON "billing_outbox_messages" ("bucket", "id")
	// CREATE TABLE IF NOT EXISTS "billing_outbox_leases" (
	// CREATE TABLE IF NOT EXISTS "billing_outbox_relays" (
	// CREATE TABLE IF NOT EXISTS "billing_outbox_dead_letters" (
	// CREATE INDEX IF NOT EXISTS "idx_billing_outbox_dead_letters_bucket_id" ON "billing_outbox_dead_letters" ("bucket", "id")
	// CREATE INDEX IF NOT EXISTS "idx_billing_outbox_dead_letters_dead_at_ms" ON "billing_outbox_dead_letters" ("dead_at_ms")
}

// The GORM models spell the row's columns in struct tags, which cannot
// use the wire constants: they must name the same columns in the same
// order.
func TestRowModelsSpellTheWireColumns(t *testing.T) {
	t.Parallel()
	columns := func(model any) []string {
		s, err := gormschema.Parse(model, &sync.Map{}, gormschema.NamingStrategy{})
		require.NoError(t, err)
		return s.DBNames
	}
	msg := strings.Split(wire.MessageColumns, ", ")
	require.Equal(t, append(slices.Clone(msg), wire.ColNextAttemptAtMs, wire.ColLastError), columns(&outbox.MessageRow{}))
	require.Equal(t, append(slices.Clone(msg), wire.ColLastError, wire.ColDeadAtMs, wire.ColState), columns(&outbox.DeadLetterRow{}))
}
