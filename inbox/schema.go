package inbox

import (
	"context"
	"fmt"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/sqlschema"
)

// Row is one processed message: its id, the position it was read from,
// and when its handler's transaction committed. The id is the primary
// key: of two transactions recording the same id, one commits and the
// other fails on the key, which is what makes processing once.
//
// Column names avoid words reserved in MySQL (partition, offset). Times
// are Unix milliseconds, as in the outbox tables.
type Row struct {
	MessageID     string `gorm:"column:message_id;type:varchar(64);primaryKey"`
	Topic         string `gorm:"column:topic;type:varchar(249);not null"`
	Partition     int32  `gorm:"column:msg_partition;not null"`
	Offset        int64  `gorm:"column:msg_offset;not null"`
	ProcessedAtMs int64  `gorm:"column:processed_at_ms;not null;index"`
}

// TableName is the default table name; Inbox.AutoMigrate uses the
// configured one.
func (Row) TableName() string { return TableDefault }

// SchemaVersion is the version of the inbox table this release needs:
// the Version of the last migration Migrations returns. The inbox's
// migrations are a set of their own, numbered apart from the outbox's.
const SchemaVersion = 1

// inboxTable is the single source of the inbox table's DDL; the schema
// tests prove it equivalent to Row on every database.
func inboxTable(name string) sqlschema.Table {
	return sqlschema.Table{
		Name: name,
		Columns: []sqlschema.Column{
			sqlschema.C("message_id", "varchar(64)", "varchar(64)", "varchar(64)", 1),
			sqlschema.C("topic", "varchar(249) NOT NULL", "varchar(249) NOT NULL", "varchar(249) NOT NULL", 1),
			sqlschema.C("msg_partition", "integer NOT NULL", "int NOT NULL", "integer NOT NULL", 1),
			sqlschema.C("msg_offset", "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
			sqlschema.C("processed_at_ms", "bigint NOT NULL", "bigint NOT NULL", "integer NOT NULL", 1),
		},
		PK:      "message_id",
		Indexes: []sqlschema.Index{sqlschema.Ix("processed_at_ms", "processed_at_ms")},
	}
}

// complete fills in the defaults of the table fields and validates them.
func complete(table, schema string) (Config, error) {
	c := Config{Table: table, Schema: schema}.WithDefaults()
	return c, c.Validate()
}

// AutoMigrate creates or updates the inbox table under the configured
// name and schema. Running it again changes nothing. It is the opt-in for
// services that let GORM manage their schema; a service with a migration
// tool applies the files of github.com/gorm-outbox/outbox/migrations
// (<dialect>/inbox/) or MigrationFiles instead.
func (i *Inbox) AutoMigrate(ctx context.Context) error {
	return AutoMigrate(ctx, i.db, i.cfg.Table, i.cfg.Schema)
}

// AutoMigrate creates or updates an inbox table named table ("" for
// TableDefault) in schema ("" for the connection's) on db. The names are
// validated first: nothing runs for a name that is not a plain
// identifier.
func AutoMigrate(ctx context.Context, db *gorm.DB, table, schema string) error {
	c, err := complete(table, schema)
	if err != nil {
		return err
	}
	db = db.Session(&gorm.Session{NewDB: true, Context: ctx})
	if err := db.Table(c.qualified()).AutoMigrate(&Row{}); err != nil {
		return fmt.Errorf("inbox: migrate table %s: %w", c.qualified(), err)
	}
	return nil
}

// Migrations returns every migration of the inbox table for the dialect
// ("postgres", "mysql" or "sqlite"; db.Dialector.Name() fits), table name
// ("" for TableDefault) and schema, oldest first. Invalid names are
// refused with an *outbox.ConfigError. The statements are idempotent
// (CREATE ... IF NOT EXISTS, DROP ... IF EXISTS) and create what
// AutoMigrate creates, so they also adopt a table AutoMigrate made.
func Migrations(dialect, table, schema string) ([]outbox.Migration, error) {
	d, ok := sqlschema.Normalize(dialect)
	if !ok {
		return nil, &outbox.ConfigError{Field: "dialect", Value: fmt.Sprintf("%q", dialect), Reason: "must be postgres, mysql (MariaDB) or sqlite"}
	}
	c, err := complete(table, schema)
	if err != nil {
		return nil, err
	}
	ddl := sqlschema.DDL{Dialect: d, Schema: c.Schema}
	t := inboxTable(c.Table)
	return []outbox.Migration{{
		Version: 1,
		Name:    "inbox",
		Up:      ddl.Create(t, 1),
		Down:    ddl.Drop([]sqlschema.Table{t}),
	}}, nil
}

// SchemaSQL returns the statements that create the inbox table and its
// index: the Up statements of every migration, without trailing
// semicolons, to execute in order.
func SchemaSQL(dialect, table, schema string) ([]string, error) {
	ms, err := Migrations(dialect, table, schema)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Up...)
	}
	return out, nil
}

// MigrationFiles renders Migrations as the files of a migration tool:
// outbox.FormatGolangMigrate or outbox.FormatGoose. The files shipped
// under migrations/<dialect>/inbox/ are MigrationFiles for the default
// table name. Run them as their own set, with their own version table,
// next to the outbox's (see docs/inbox.md).
func MigrationFiles(dialect, table, schema, format string) ([]outbox.MigrationFile, error) {
	if format != outbox.FormatGolangMigrate && format != outbox.FormatGoose {
		return nil, &outbox.ConfigError{Field: "format", Value: fmt.Sprintf("%q", format), Reason: "must be golang-migrate or goose"}
	}
	ms, err := Migrations(dialect, table, schema)
	if err != nil {
		return nil, err
	}
	sms := make([]sqlschema.Migration, len(ms))
	for i, m := range ms {
		sms[i] = sqlschema.Migration(m)
	}
	d, _ := sqlschema.Normalize(dialect)
	var files []outbox.MigrationFile
	for _, f := range sqlschema.Files("gorm-outbox inbox", "inbox.MigrationFiles", d, format, sms) {
		files = append(files, outbox.MigrationFile(f))
	}
	return files, nil
}
