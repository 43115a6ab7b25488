package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"gorm.io/gorm"
	gormlogger "gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/sqlschema"
	"github.com/gorm-outbox/outbox/wire"
)

//go:generate go test -run TestMigrationFiles -update-migrations .

// Dialects accepted by SchemaSQL, Migrations and MigrationFiles. They are
// the names GORM's dialectors report, so db.Dialector.Name() can be passed
// as is. "postgresql", "mariadb" and "sqlite3" are accepted as aliases.
const (
	DialectPostgres = sqlschema.Postgres
	DialectMySQL    = sqlschema.MySQL // MySQL 8 and MariaDB 10.5+
	DialectSQLite   = sqlschema.SQLite
)

// Migration file formats accepted by MigrationFiles.
const (
	// FormatGolangMigrate is github.com/golang-migrate/migrate: a pair of
	// files per migration, 000001_outbox.up.sql and 000001_outbox.down.sql.
	FormatGolangMigrate = sqlschema.FormatGolangMigrate
	// FormatGoose is github.com/pressly/goose: one file per migration,
	// 00001_outbox.sql, with "-- +goose Up" and "-- +goose Down" sections.
	FormatGoose = sqlschema.FormatGoose
)

// SchemaVersion is the version of the outbox tables this release needs:
// the Version of the last migration that Migrations returns. The relay's
// store checks at start that the tables have every column up to this
// version (see CheckSchema).
const SchemaVersion = 1

// Migration is one step of the outbox schema, as SQL statements without
// trailing semicolons, in the order they must run. Migrations are
// append-only: a released migration never changes, a later release adds
// the next one.
type Migration struct {
	// Version numbers the migrations from 1 without gaps.
	Version int
	// Name is a short snake_case description, e.g. "outbox".
	Name string
	// Up creates or changes the tables; Down reverts exactly that.
	Up, Down []string
}

// ID is the migration's file name stem: the version on six digits and
// the name, e.g. "000001_outbox".
func (m Migration) ID() string { return fmt.Sprintf("%06d_%s", m.Version, m.Name) }

// MigrationFile is one file of a migration tool's directory.
type MigrationFile struct {
	// Name is the base name, e.g. "000001_outbox.up.sql".
	Name    string
	Content []byte
}

// SchemaError reports outbox tables that are missing (never migrated) or
// older than this release needs: a table or a column is missing. CheckSchema returns it, and the
// relay stops on it at start with a *relay.MisconfigurationError that
// wraps it. It wraps ErrSchemaOutdated.
type SchemaError struct {
	// Table is the schema-qualified table name.
	Table string
	// Column is the missing column, or "" when the whole table is missing.
	Column string
	// Migration is the ID of the migration that creates what is missing,
	// e.g. "000001_outbox".
	Migration string
}

// ErrSchemaOutdated is wrapped by every *SchemaError.
var ErrSchemaOutdated = errors.New("outbox: the outbox tables are missing or older than this release needs")

func (e *SchemaError) Error() string {
	if e.Column == "" {
		return fmt.Sprintf("outbox: table %s is missing: create the outbox tables before starting the relay: run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)) or Tables.AutoMigrate, or apply the outbox migrations up to %s (github.com/gorm-outbox/outbox/migrations, or outbox.Migrations)", e.Table, e.Migration)
	}
	return fmt.Sprintf("outbox: table %s has no column %s: apply the outbox migrations up to %s (github.com/gorm-outbox/outbox/migrations, or outbox.Migrations) or run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)) or Tables.AutoMigrate before starting the relay", e.Table, e.Column, e.Migration)
}

// Is lets errors.Is(err, ErrSchemaOutdated) match.
func (e *SchemaError) Is(target error) bool { return target == ErrSchemaOutdated }

// tableDef describes one outbox table. It is the single source of the
// DDL, the migration files and the store's schema check; the schema tests
// prove it equivalent to the GORM models of model.go on every database.
type tableDef struct {
	name func(Tables) string // unqualified name
	sqlschema.Table
}

func (t tableDef) under(tables Tables) sqlschema.Table {
	st := t.Table
	st.Name = t.name(tables)
	return st
}

// messageColumns are the columns a dead letter keeps of its message, in
// the order both tables have them.
var messageColumns = []sqlschema.Column{
	sqlschema.C(wire.ColMessageID, "varchar(64) NOT NULL", "varchar(64) NOT NULL", "varchar(64) NOT NULL", 1),
	sqlschema.C(wire.ColBucket, "integer NOT NULL", "int NOT NULL", "integer NOT NULL", 1),
	sqlschema.C(wire.ColTopic, "varchar(249) NOT NULL", "varchar(249) NOT NULL", "varchar(249) NOT NULL", 1),
	sqlschema.C(wire.ColKey, "bytea", "longblob", "blob", 1),
	sqlschema.C(wire.ColValue, "bytea", "longblob", "blob", 1),
	sqlschema.C(wire.ColHeaders, "bytea", "longblob", "blob", 1),
	sqlschema.C(wire.ColPartition, "integer", "int", "integer", 1),
	sqlschema.C(wire.ColCreatedAtMs, "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
	sqlschema.C(wire.ColAttempts, "integer NOT NULL DEFAULT 0", "int NOT NULL DEFAULT 0", "integer NOT NULL DEFAULT 0", 1),
}

// The column types are exactly those GORM's migrators emit for the models
// in model.go, so that AutoMigrate finds nothing to change on tables made
// from this SQL, and vice versa.
var outboxTables = []tableDef{
	{
		name: func(t Tables) string { return t.Messages },
		Table: sqlschema.Table{
			Columns: slices.Concat(
				[]sqlschema.Column{sqlschema.C("id", "bigserial", "bigint AUTO_INCREMENT", "integer PRIMARY KEY AUTOINCREMENT", 1)},
				messageColumns,
				[]sqlschema.Column{
					sqlschema.C(wire.ColNextAttemptAtMs, "bigint NOT NULL DEFAULT 0", "bigint NOT NULL DEFAULT 0", "integer NOT NULL DEFAULT 0", 1),
					sqlschema.C(wire.ColLastError, "text", "text", "text", 1),
				},
			),
			PK:      "id",
			Indexes: []sqlschema.Index{sqlschema.Ix("bucket_id", "bucket", "id")},
		},
	},
	{
		name: func(t Tables) string { return t.Leases },
		Table: sqlschema.Table{
			Columns: []sqlschema.Column{
				sqlschema.C("bucket", "integer", "int", "integer", 1),
				sqlschema.C("owner", "varchar(128)", "varchar(128)", "varchar(128)", 1),
				sqlschema.C("term", "bigint NOT NULL DEFAULT 0", "bigint NOT NULL DEFAULT 0", "integer NOT NULL DEFAULT 0", 1),
				sqlschema.C("expires_at_ms", "bigint NOT NULL DEFAULT 0", "bigint NOT NULL DEFAULT 0", "integer NOT NULL DEFAULT 0", 1),
				sqlschema.C("paused", "boolean NOT NULL DEFAULT false", "boolean NOT NULL DEFAULT false", "numeric NOT NULL DEFAULT false", 1),
			},
			PK: "bucket",
		},
	},
	{
		name: func(t Tables) string { return t.Relays },
		Table: sqlschema.Table{
			Columns: []sqlschema.Column{
				sqlschema.C("relay_id", "varchar(128)", "varchar(128)", "varchar(128)", 1),
				sqlschema.C("last_seen_ms", "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
				sqlschema.C("started_at_ms", "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
			},
			PK: "relay_id",
		},
	},
	{
		name: func(t Tables) string { return t.DeadLetters },
		Table: sqlschema.Table{
			Columns: slices.Concat(
				[]sqlschema.Column{sqlschema.C("id", "bigint", "bigint", "integer", 1)},
				messageColumns,
				[]sqlschema.Column{
					sqlschema.C(wire.ColLastError, "text", "text", "text", 1),
					sqlschema.C(wire.ColDeadAtMs, "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
					sqlschema.C(wire.ColState, "varchar(16) NOT NULL", "varchar(16) NOT NULL", "varchar(16) NOT NULL", 1),
				},
			),
			PK: "id",
			Indexes: []sqlschema.Index{
				sqlschema.Ix("bucket_id", "bucket", "id"),
				sqlschema.Ix("dead_at_ms", "dead_at_ms"),
			},
		},
	},
}

// migrationNames names each migration by version; index 0 is version 1.
var migrationNames = []string{"outbox"}

// normalizeDialect maps a dialect name or alias to its Dialect constant.
func normalizeDialect(dialect string) (string, error) {
	if d, ok := sqlschema.Normalize(dialect); ok {
		return d, nil
	}
	return "", &ConfigError{Package: "outbox", Field: "dialect", Value: fmt.Sprintf("%q", dialect), Reason: "must be postgres, mysql (MariaDB) or sqlite"}
}

// completeTables fills in the default names and validates them like
// Config.Validate.
func completeTables(tables Tables) (Tables, error) {
	cfg := Config{Tables: tables}.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return Tables{}, err
	}
	return cfg.Tables, nil
}

// Migrations returns every migration of the outbox tables for the dialect
// and table names, oldest first. Zero fields of tables take their default
// names; invalid names are refused with a *ConfigError, like NewPlugin.
//
// Apply them in order with your migration tool (MigrationFiles writes them
// in its format) or by executing the statements yourself. The statements
// are idempotent (CREATE ... IF NOT EXISTS, DROP ... IF EXISTS), so the
// first migration also adopts tables that Tables.AutoMigrate created
// earlier.
func Migrations(dialect string, tables Tables) ([]Migration, error) {
	dialect, err := normalizeDialect(dialect)
	if err != nil {
		return nil, err
	}
	if tables, err = completeTables(tables); err != nil {
		return nil, err
	}
	d := sqlschema.DDL{Dialect: dialect, Schema: tables.Schema}
	ms := make([]Migration, 0, SchemaVersion)
	// Version 1 creates the tables; a later version adds its ALTER
	// statements here, and its columns to outboxTables with Since set to
	// it.
	m := Migration{Version: 1, Name: migrationNames[0]}
	all := make([]sqlschema.Table, len(outboxTables))
	for i, t := range outboxTables {
		all[i] = t.under(tables)
		m.Up = append(m.Up, d.Create(all[i], 1)...)
	}
	m.Down = d.Drop(all)
	ms = append(ms, m)
	return ms, nil
}

// SchemaSQL returns the statements that create the outbox tables and
// their indexes, as this release needs them, for the dialect
// ("postgres", "mysql" or "sqlite"; db.Dialector.Name() fits) and table
// names (zero fields take their defaults; Schema qualifies every table).
// The statements have no trailing semicolons; execute them in order. They
// are the Up statements of every migration, and create the same columns,
// types, nullability and indexes as Tables.AutoMigrate.
func SchemaSQL(dialect string, tables Tables) ([]string, error) {
	ms, err := Migrations(dialect, tables)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Up...)
	}
	return out, nil
}

// MigrationFiles renders Migrations(dialect, tables) as the files of a
// migration tool: FormatGolangMigrate ("golang-migrate") or FormatGoose
// ("goose"). The files shipped under migrations/<dialect>/ in this module
// are MigrationFiles for the default table names; call it yourself for
// custom names or a schema.
func MigrationFiles(dialect string, tables Tables, format string) ([]MigrationFile, error) {
	if format != FormatGolangMigrate && format != FormatGoose {
		return nil, &ConfigError{Package: "outbox", Field: "format", Value: fmt.Sprintf("%q", format), Reason: "must be golang-migrate or goose"}
	}
	ms, err := Migrations(dialect, tables)
	if err != nil {
		return nil, err
	}
	sms := make([]sqlschema.Migration, len(ms))
	for i, m := range ms {
		sms[i] = sqlschema.Migration(m)
	}
	d, _ := normalizeDialect(dialect)
	var files []MigrationFile
	for _, f := range sqlschema.Files("gorm-outbox", "outbox.MigrationFiles", d, format, sms) {
		files = append(files, MigrationFile(f))
	}
	return files, nil
}

// CheckSchema verifies that the outbox tables of tables exist in db and
// have every column this release needs, with one
// "SELECT <columns> FROM <table> WHERE 1 = 0" per table: no rows are read
// and nothing is locked. A missing table or column is reported as a
// *SchemaError naming it and the migration that adds it; an unreachable
// database as a plain error. ctx bounds the whole check. Its probes run
// with a silent GORM logger: a probe failing on a missing table is the
// answer, not an error for the application's log.
//
// The relay's store (package gormrelay) calls it at its first lease
// acquisition and stops the relay with a *relay.MisconfigurationError
// wrapping the *SchemaError. Call it yourself in a readiness probe or
// after running migrations.
func CheckSchema(ctx context.Context, db *gorm.DB, tables Tables) error {
	db = db.Session(&gorm.Session{NewDB: true, Context: ctx, Logger: gormlogger.Discard})
	for _, t := range outboxTables {
		name := tables.qualified(t.name(tables))
		quoted := db.Statement.Quote(name)
		cols := make([]string, 0, len(t.Columns))
		for _, c := range t.Columns {
			if c.Since <= SchemaVersion {
				cols = append(cols, db.Statement.Quote(c.Name))
			}
		}
		err := db.Exec("SELECT " + strings.Join(cols, ", ") + " FROM " + quoted + " WHERE 1 = 0").Error
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return fmt.Errorf("outbox: check schema: %w", context.Cause(ctx))
		}
		var one int
		if db.Raw("SELECT 1").Row().Scan(&one) != nil {
			return fmt.Errorf("outbox: check schema: %w", err) // unreachable: not a schema problem
		}
		if db.Exec("SELECT 1 FROM "+quoted+" WHERE 1 = 0").Error != nil {
			return &SchemaError{Table: name, Migration: migrationID(1)}
		}
		for _, c := range t.Columns {
			if c.Since <= SchemaVersion && db.Exec("SELECT "+db.Statement.Quote(c.Name)+" FROM "+quoted+" WHERE 1 = 0").Error != nil {
				return &SchemaError{Table: name, Column: c.Name, Migration: migrationID(c.Since)}
			}
		}
		return fmt.Errorf("outbox: check schema of %s: %w", name, err)
	}
	return nil
}

func migrationID(version int) string {
	return Migration{Version: version, Name: migrationNames[version-1]}.ID()
}
