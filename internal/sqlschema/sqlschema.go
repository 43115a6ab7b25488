// Package sqlschema renders the DDL of the project's tables (the outbox
// tables of the root package, the inbox table of package inbox) for
// PostgreSQL, MySQL/MariaDB and SQLite, and the migration files of
// golang-migrate and goose. It is the single source of the SQL, the
// shipped migration files and the schema checks; each package's tests
// prove its table definitions equivalent to its GORM models.
package sqlschema

import (
	"fmt"
	"strings"

	"gorm.io/gorm/schema"
)

// Dialects, as GORM's dialectors name them.
const (
	Postgres = "postgres"
	MySQL    = "mysql" // MySQL 8 and MariaDB 10.5+
	SQLite   = "sqlite"
)

// Migration file formats.
const (
	FormatGolangMigrate = "golang-migrate"
	FormatGoose         = "goose"
)

// Normalize maps a dialect name or alias to its constant; ok is false for
// an unknown dialect.
func Normalize(dialect string) (string, bool) {
	switch strings.ToLower(dialect) {
	case Postgres, "postgresql", "pgx", "pg":
		return Postgres, true
	case MySQL, "mariadb":
		return MySQL, true
	case SQLite, "sqlite3":
		return SQLite, true
	}
	return "", false
}

// Column is one column of a table, with its type and constraints in each
// dialect, spelled as GORM's migrator creates it, and the migration
// version that added it.
type Column struct {
	Name              string
	PG, MySQL, SQLite string
	Since             int
}

// Index is a secondary index; its name is idx_<table>_<Suffix>.
type Index struct {
	Suffix  string
	Columns []string
}

// Table describes one table under its unqualified name.
type Table struct {
	Name    string
	Columns []Column
	PK      string
	Indexes []Index
}

// DDL renders the statements of one dialect. Identifiers are quoted the
// way GORM quotes them; callers validate them first, which limits them
// to [A-Za-z_][A-Za-z0-9_]*.
type DDL struct {
	Dialect string // a normalized dialect
	Schema  string // qualifies every table; "" for none
}

// Quote quotes an identifier.
func (d DDL) Quote(name string) string {
	if d.Dialect == MySQL {
		return "`" + name + "`"
	}
	return `"` + name + `"`
}

// Table returns the quoted, schema-qualified table name.
func (d DDL) Table(name string) string {
	if d.Schema == "" {
		return d.Quote(name)
	}
	return d.Quote(d.Schema) + "." + d.Quote(name)
}

func (d DDL) columnList(cols []string) string {
	q := make([]string, len(cols))
	for i, c := range cols {
		q[i] = d.Quote(c)
	}
	return strings.Join(q, ", ")
}

// IndexName is the name GORM's default naming strategy gives the index:
// idx_<table>_<suffix>, shortened with a hash past the identifier limit
// GORM's dialector sets (63 characters on PostgreSQL, 64 elsewhere).
func (d DDL) IndexName(table, suffix string) string {
	limit := 64
	if d.Dialect == Postgres {
		limit = 63
	}
	return schema.NamingStrategy{IdentifierMaxLength: limit}.IndexName(table, suffix)
}

func (d DDL) typeOf(c Column) string {
	switch d.Dialect {
	case Postgres:
		return c.PG
	case MySQL:
		return c.MySQL
	}
	return c.SQLite
}

// Create returns the CREATE TABLE and CREATE INDEX statements of t for
// the columns added up to version.
func (d DDL) Create(t Table, version int) []string {
	var sb strings.Builder
	sb.WriteString("CREATE TABLE IF NOT EXISTS " + d.Table(t.Name) + " (\n")
	var defs []string
	for _, c := range t.Columns {
		if c.Since <= version {
			defs = append(defs, "  "+d.Quote(c.Name)+" "+d.typeOf(c))
		}
	}
	// SQLite declares an AUTOINCREMENT key on its column.
	if !(d.Dialect == SQLite && strings.Contains(d.typeOf(t.Columns[0]), "PRIMARY KEY")) {
		defs = append(defs, "  PRIMARY KEY ("+d.Quote(t.PK)+")")
	}
	if d.Dialect == MySQL {
		// MySQL declares indexes inside CREATE TABLE, as GORM does: MySQL
		// has no CREATE INDEX IF NOT EXISTS.
		for _, ix := range t.Indexes {
			defs = append(defs, "  INDEX "+d.Quote(d.IndexName(t.Name, ix.Suffix))+" ("+d.columnList(ix.Columns)+")")
		}
	}
	sb.WriteString(strings.Join(defs, ",\n"))
	sb.WriteString("\n)")
	if d.Dialect == MySQL {
		// The tables need transactions: never let a server default put
		// them on a non-transactional engine.
		sb.WriteString(" ENGINE=InnoDB")
	}
	stmts := []string{sb.String()}
	if d.Dialect == MySQL {
		return stmts
	}
	for _, ix := range t.Indexes {
		iname := d.Quote(d.IndexName(t.Name, ix.Suffix))
		on := d.Table(t.Name)
		if d.Dialect == SQLite && d.Schema != "" {
			// SQLite qualifies the index, not the table it is on.
			iname = d.Quote(d.Schema) + "." + iname
			on = d.Quote(t.Name)
		}
		stmts = append(stmts, "CREATE INDEX IF NOT EXISTS "+iname+" ON "+on+" ("+d.columnList(ix.Columns)+")")
	}
	return stmts
}

// Drop returns the DROP TABLE statements of tables, last table first.
func (d DDL) Drop(tables []Table) []string {
	out := make([]string, 0, len(tables))
	for i := len(tables) - 1; i >= 0; i-- {
		out = append(out, "DROP TABLE IF EXISTS "+d.Table(tables[i].Name))
	}
	return out
}

// Migration is one numbered step of a table set.
type Migration struct {
	Version  int
	Name     string
	Up, Down []string
}

// ID is the file name stem: the version on six digits and the name.
func (m Migration) ID() string { return fmt.Sprintf("%06d_%s", m.Version, m.Name) }

// File is one file of a migration tool's directory.
type File struct {
	Name    string
	Content []byte
}

// Files renders migrations as the files of format (FormatGolangMigrate
// or FormatGoose) for the normalized dialect. set names the table set in
// each file's header ("gorm-outbox", "gorm-outbox inbox"), generator the
// function that produced them. The format must be checked by the caller.
func Files(set, generator, dialect, format string, ms []Migration) []File {
	var files []File
	for _, m := range ms {
		// The header depends on the migration only, so a released file
		// never changes when later migrations are added.
		header := fmt.Sprintf("-- %s schema migration %d (%s), %s dialect.\n"+
			"-- Generated by %s; do not edit.\n", set, m.Version, m.Name, dialect, generator)
		switch format {
		case FormatGolangMigrate:
			files = append(files,
				File{Name: m.ID() + ".up.sql", Content: []byte(header + "\n" + Script(m.Up))},
				File{Name: m.ID() + ".down.sql", Content: []byte(header + "\n" + Script(m.Down))})
		case FormatGoose:
			files = append(files, File{
				Name: fmt.Sprintf("%05d_%s.sql", m.Version, m.Name),
				Content: []byte(header + "\n-- +goose Up\n" + Script(m.Up) +
					"\n-- +goose Down\n" + Script(m.Down)),
			})
		}
	}
	return files
}

// Script joins statements into a script, one statement per paragraph,
// each ending with a semicolon at the end of its last line (where goose
// looks for it).
func Script(stmts []string) string {
	var sb strings.Builder
	for i, s := range stmts {
		if i > 0 {
			sb.WriteString("\n")
		}
		sb.WriteString(s)
		sb.WriteString(";\n")
	}
	return sb.String()
}

// C returns a column: its name, its type in each dialect and the version
// that added it.
func C(name, pg, mysql, sqlite string, since int) Column {
	return Column{Name: name, PG: pg, MySQL: mysql, SQLite: sqlite, Since: since}
}

// Ix returns an index on columns.
func Ix(suffix string, columns ...string) Index { return Index{Suffix: suffix, Columns: columns} }
