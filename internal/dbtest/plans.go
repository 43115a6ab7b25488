package dbtest

import (
	"testing"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// PostgreSQL prepares the statements GORM sends, and after a few
// executions may plan a statement once for any parameter value (a generic
// plan). The helpers below let a test force generic plans and count how a
// table was scanned, so that a statement whose generic plan reads the
// whole table fails a test instead of slowing a production database.

// GenericPlans is appended to a PostgreSQL DSN to make every plan of the
// connection's prepared statements generic.
const GenericPlans = " plan_cache_mode=force_generic_plan"

// App is a GORM pool on the test's PostgreSQL schema whose backends carry
// a name of their own as application_name, so that CloseApp can wait for
// them to exit.
type App struct {
	*gorm.DB
	name string
}

// OpenApp opens a pool on d's PostgreSQL schema named app (made unique to
// the test's schema), with params (such as GenericPlans) appended to the
// DSN; it is closed when the test ends.
func (d *DB) OpenApp(t testing.TB, app, params string) *App {
	t.Helper()
	name := app + "-" + d.Namespace
	g, err := OpenGorm(Postgres, d.DSN+params+" application_name="+name, &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatalf("dbtest: open %s: %v", name, err)
	}
	sqlDB, err := g.DB()
	if err != nil {
		t.Fatalf("dbtest: %v", err)
	}
	t.Cleanup(func() { _ = sqlDB.Close() })
	return &App{DB: g, name: name}
}

// CloseApp closes a and waits until its backends have exited: a backend
// reports its table statistics when it exits, so Scans then counts
// everything a did.
func (d *DB) CloseApp(t testing.TB, a *App) {
	t.Helper()
	sqlDB, err := a.DB.DB()
	if err == nil {
		err = sqlDB.Close()
	}
	if err != nil {
		t.Fatalf("dbtest: close %s: %v", a.name, err)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		var n int64
		if err := d.Raw("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = ?", a.name).Scan(&n).Error; err != nil {
			t.Fatalf("dbtest: %v", err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("dbtest: %d backends of %s still there after a minute", n, a.name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Scans are the statistics counters of the scans of one table.
type Scans struct {
	Seq        int64 // sequential scans of the table
	PrimaryKey int64 // scans of its primary key
	Indexes    int64 // scans of its other indexes
}

// Scans reads the scan counters of table in the test's schema, as
// reported by the backends that have exited or flushed their statistics.
func (d *DB) Scans(t testing.TB, table string) Scans {
	t.Helper()
	var s Scans
	if err := d.Raw("SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = ? AND relname = ?",
		d.Namespace, table).Row().Scan(&s.Seq); err != nil {
		t.Fatalf("dbtest: scans of %s: %v", table, err)
	}
	if err := d.Raw(`SELECT
		COALESCE(SUM(s.idx_scan) FILTER (WHERE i.indisprimary), 0),
		COALESCE(SUM(s.idx_scan) FILTER (WHERE NOT i.indisprimary), 0)
		FROM pg_stat_user_indexes s JOIN pg_index i ON i.indexrelid = s.indexrelid
		WHERE s.schemaname = ? AND s.relname = ?`, d.Namespace, table).Row().Scan(&s.PrimaryKey, &s.Indexes); err != nil {
		t.Fatalf("dbtest: index scans of %s: %v", table, err)
	}
	return s
}
