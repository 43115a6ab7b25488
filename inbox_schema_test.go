package outbox_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// The inbox table's migrations are a set of their own, shipped under
// migrations/<dialect>/inbox/.
func inboxMigrationDir(dialect, format string) string {
	if format == outbox.FormatGoose {
		return filepath.Join("migrations", dialect, "inbox", "goose")
	}
	return filepath.Join("migrations", dialect, "inbox")
}

// The inbox files under migrations/ are inbox.MigrationFiles for the
// default table, byte for byte, and embedded in migrations.FS.
// Regenerated with the outbox files (go generate).
func TestInboxMigrationFiles(t *testing.T) {
	t.Parallel()
	for _, dialect := range dbtest.Dialects {
		for _, format := range []string{outbox.FormatGolangMigrate, outbox.FormatGoose} {
			files, err := inbox.MigrationFiles(dialect, "", "", format)
			require.NoError(t, err)
			dir := inboxMigrationDir(dialect, format)
			if *updateMigrations {
				require.NoError(t, os.MkdirAll(dir, 0o755))
				for _, f := range files {
					require.NoError(t, os.WriteFile(filepath.Join(dir, f.Name), f.Content, 0o644))
				}
			}
			requireMigrationDir(t, dir, files, "inbox.MigrationFiles")
		}
	}
	_, err := inbox.MigrationFiles("postgres", "", "", "flyway")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = inbox.SchemaSQL("oracle", "", "")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	_, err = inbox.SchemaSQL("postgres", "bad-name", "")
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	stmts, err := inbox.SchemaSQL("postgres", "seen", "billing")
	require.NoError(t, err)
	require.Contains(t, stmts[0], `CREATE TABLE IF NOT EXISTS "billing"."seen" (`)
	require.Equal(t, `CREATE INDEX IF NOT EXISTS "idx_seen_processed_at_ms" ON "billing"."seen" ("processed_at_ms")`, stmts[1])
}

// inbox.SchemaSQL and inbox.AutoMigrate build the same table, read back
// from the catalog, and AutoMigrate finds nothing to change on the
// SQL-made one. The shipped files run up, up again, down and up with both
// tools' semantics, and the inbox works on the result.
func TestInboxSchemaSQLMatchesAutoMigrate(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, viaGorm *dbtest.DB) {
		ctx := context.Background()
		viaSQL := dbtest.Open(t, viaGorm.Dialect)
		for name, table := range map[string]string{"defaults": "", "custom": "Long_Inbox_Table_Name_For_A_Hashed_Index_Name_xyz"} {
			schema, sqlSchema := "", ""
			if name == "custom" && viaGorm.Dialect != dbtest.SQLite {
				schema, sqlSchema = viaGorm.Namespace, viaSQL.Namespace
			}
			require.NoError(t, inbox.AutoMigrate(ctx, viaGorm.DB, table, schema))
			stmts, err := inbox.SchemaSQL(viaSQL.Dialect, table, sqlSchema)
			require.NoError(t, err)
			for _, s := range stmts {
				require.NoError(t, viaSQL.DB.Exec(s).Error, s)
			}
			tn := inbox.Config{Table: table}.WithDefaults().Table
			want, got := describe(t, viaGorm, tn), describe(t, viaSQL, tn)
			require.NotEmpty(t, want.Columns)
			require.Equal(t, want, got, "%s: inbox.SchemaSQL and inbox.AutoMigrate differ", name)
			rec := &sqlRecorder{Interface: logger.Discard}
			require.NoError(t, inbox.AutoMigrate(ctx, viaSQL.DB.Session(&gorm.Session{Logger: rec}), table, sqlSchema))
			require.Empty(t, schemaChanges(rec), "%s: AutoMigrate wants to change the table made by SchemaSQL", name)
		}

		for i, format := range []string{outbox.FormatGolangMigrate, outbox.FormatGoose} {
			db := dbtest.Open(t, viaGorm.Dialect)
			files, err := inbox.MigrationFiles(db.Dialect, "", "", format)
			require.NoError(t, err)
			dir := inboxMigrationDir(db.Dialect, format)
			up := func() { applyMigration(t, db, dir, format, files, true) }
			up()
			up()
			applyMigration(t, db, dir, format, files, false)
			require.False(t, db.DB.Migrator().HasTable(inbox.TableDefault), format)
			up()
			ib, err := inbox.New(db.DB, inbox.Config{})
			require.NoError(t, err)
			rec := inbox.Record{Topic: "t", Offset: int64(i), Headers: []inbox.Header{{Key: []byte(inbox.MessageIDHeaderDefault), Value: []byte("m")}}}
			noop := func(context.Context, *gorm.DB, inbox.Record) error { return nil }
			for _, want := range []inbox.Outcome{inbox.Processed, inbox.Duplicate} {
				res, err := ib.Process(ctx, rec, noop)
				require.NoError(t, err)
				require.Equal(t, want, res.Outcome, format)
			}
		}
	})
}
