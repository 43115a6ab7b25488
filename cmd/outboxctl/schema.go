package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/gorm-outbox/outbox"
)

// schemaCmd prints the DDL of the outbox tables for a dialect, or writes
// migration files for golang-migrate or goose. It needs no database.
func (g *globals) schemaCmd(fs *flag.FlagSet, args []string) error {
	var format, out string
	fs.StringVar(&format, "format", "sql", "sql (print the statements), golang-migrate or goose (write migration files)")
	fs.StringVar(&out, "out", "", "directory for the migration files (default: print them)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if g.help {
		return flag.ErrHelp
	}
	if len(pos) > 0 {
		return usagef("schema takes no arguments")
	}
	if g.driver == "" {
		g.driver = g.getenv("OUTBOX_DRIVER")
	}
	if g.driver == "" {
		return usagef("schema needs --driver postgres, mysql or sqlite")
	}
	tables := g.tables()
	if format == "sql" {
		stmts, err := outbox.SchemaSQL(g.driver, tables)
		if err != nil {
			return usageError{err.Error()}
		}
		_, err = fmt.Fprint(g.out, strings.Join(stmts, ";\n\n")+";\n")
		return err
	}
	files, err := outbox.MigrationFiles(g.driver, tables, format)
	if err != nil {
		return usageError{err.Error()}
	}
	for _, f := range files {
		if out == "" {
			fmt.Fprintf(g.out, "-- file: %s\n%s\n", f.Name, f.Content)
			continue
		}
		if err := os.MkdirAll(out, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(out, f.Name), []byte(f.Content), 0o644); err != nil {
			return err
		}
		fmt.Fprintf(g.errOut, "wrote %s\n", filepath.Join(out, f.Name))
	}
	return nil
}
