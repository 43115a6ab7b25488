// Package dbopen opens GORM connections by dialect name ("postgres",
// "mysql", "sqlite") for the tests and the benchmark.
package dbopen

import (
	"fmt"
	"strings"

	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
)

// Dialect names.
const (
	Postgres = "postgres"
	MySQL    = "mysql"
	SQLite   = "sqlite"
)

// Open opens a GORM connection for the dialect and DSN. A SQLite pool
// keeps one connection: SQLite serializes writes anyway, and a single
// connection avoids SQLITE_BUSY between pooled connections.
func Open(dialect, dsn string, cfg *gorm.Config) (*gorm.DB, error) {
	var dl gorm.Dialector
	switch dialect {
	case Postgres:
		dl = postgres.Open(dsn)
	case MySQL:
		dl = mysql.Open(dsn)
	case SQLite:
		dl = sqlite.Open(dsn)
	default:
		return nil, fmt.Errorf("dbopen: unknown dialect %q (postgres, mysql, sqlite)", dialect)
	}
	db, err := gorm.Open(dl, cfg)
	if err != nil {
		return nil, err
	}
	if dialect == SQLite {
		sqlDB, err := db.DB()
		if err != nil {
			return nil, err
		}
		sqlDB.SetMaxOpenConns(1)
	}
	return db, nil
}

// WithMySQLDatabase returns the MySQL DSN dsn with name as its database,
// keeping its parameters. A DSN without a slash is returned as it is.
func WithMySQLDatabase(dsn, name string) string {
	slash := strings.LastIndex(dsn, "/")
	if slash < 0 {
		return dsn
	}
	rest, q := dsn[slash+1:], ""
	if i := strings.IndexByte(rest, '?'); i >= 0 {
		q = rest[i:]
	}
	return dsn[:slash+1] + name + q
}
