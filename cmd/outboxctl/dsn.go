package main

import (
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"

	mysqldrv "github.com/go-sql-driver/mysql"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// Driver names accepted by --driver, and their aliases.
var driverAliases = map[string]string{
	"postgres": "postgres", "postgresql": "postgres", "pgx": "postgres", "pg": "postgres",
	"mysql": "mysql", "mariadb": "mysql",
	"sqlite": "sqlite", "sqlite3": "sqlite",
}

// resolveDriver returns the driver for name, or guesses it from the DSN
// when name is empty.
func resolveDriver(name, dsn string) (string, error) {
	if name != "" {
		d, ok := driverAliases[strings.ToLower(name)]
		if !ok {
			return "", fmt.Errorf("unknown driver %q: use postgres, mysql or sqlite", name)
		}
		return d, nil
	}
	switch {
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"),
		strings.Contains(dsn, "host="), strings.Contains(dsn, "dbname="):
		return "postgres", nil
	case strings.Contains(dsn, "@tcp("), strings.Contains(dsn, "@unix("), strings.HasPrefix(dsn, "mysql://"):
		return "mysql", nil
	case strings.HasPrefix(dsn, "file:"), strings.HasSuffix(dsn, ".db"), strings.HasSuffix(dsn, ".sqlite"),
		strings.HasSuffix(dsn, ".sqlite3"), dsn == ":memory:":
		return "sqlite", nil
	}
	return "", fmt.Errorf("cannot tell the database from the DSN: set --driver (or OUTBOX_DRIVER) to postgres, mysql or sqlite")
}

// checkDriver refuses a DSN that plainly belongs to another driver than the
// one given, naming both: otherwise the driver's parser fails with a
// message about syntax that does not say the two were mixed up.
func checkDriver(driver, dsn string) error {
	looks, err := resolveDriver("", dsn)
	if err != nil || looks == driver {
		return nil
	}
	return fmt.Errorf("--driver (or OUTBOX_DRIVER) is %s but the DSN looks like a %s DSN: fix one of them, or leave --driver unset to guess it from the DSN", driver, looks)
}

// sqliteFile returns the file a SQLite DSN names, or "" for an in-memory
// database.
func sqliteFile(dsn string) string {
	path, query, _ := strings.Cut(strings.TrimPrefix(dsn, "file:"), "?")
	if path == ":memory:" || path == "" || strings.Contains(query, "mode=memory") {
		return ""
	}
	return path
}

// openDB opens a GORM connection with its logger silenced: GORM would
// otherwise print failing SQL to stdout.
func openDB(driver, dsn string) (*gorm.DB, error) {
	var dl gorm.Dialector
	switch driver {
	case "postgres":
		dl = postgres.Open(dsn)
	case "mysql":
		if strings.HasPrefix(dsn, "mysql://") {
			converted, err := outbox.MySQLDSN(dsn)
			if err != nil {
				return nil, err
			}
			dsn = converted
		}
		dl = mysql.Open(dsn)
	case "sqlite":
		// The driver would create a missing file and then report missing
		// tables: a mistyped path is named instead.
		if f := sqliteFile(dsn); f != "" {
			if _, err := os.Stat(f); err != nil {
				return nil, fmt.Errorf("SQLite database file: %w", err)
			}
		}
		dl = sqlite.Open(dsn)
	default:
		return nil, fmt.Errorf("unknown driver %q", driver)
	}
	return gorm.Open(dl, &gorm.Config{Logger: logger.Discard, SkipDefaultTransaction: true})
}

var (
	kvPassword   = regexp.MustCompile(`(?i)\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|[^\s]+)`)
	queryPassRes = regexp.MustCompile(`(?i)(?:^|[?&])(?:password|_auth_pass|pass)=([^&]+)`)
)

// secrets extracts the password of a DSN in every form the three drivers
// accept (URL userinfo, key=value, MySQL user:pass@, query parameters),
// with the encodings it may appear in, so that redact can scrub it from
// any text.
func secrets(dsn string) []string {
	var out []string
	add := func(s string) {
		if s == "" {
			return
		}
		out = append(out, s, url.QueryEscape(s), url.PathEscape(s))
		if u, err := url.QueryUnescape(s); err == nil && u != s {
			out = append(out, u)
		}
	}
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok {
			add(p)
		}
	}
	for _, m := range kvPassword.FindAllStringSubmatch(dsn, -1) {
		v := m[1]
		add(v)
		if strings.HasPrefix(v, "'") && strings.HasSuffix(v, "'") && len(v) >= 2 {
			add(strings.ReplaceAll(v[1:len(v)-1], `\'`, "'"))
		}
	}
	for _, m := range queryPassRes.FindAllStringSubmatch(dsn, -1) {
		add(m[1])
	}
	if cfg, err := mysqldrv.ParseDSN(strings.TrimPrefix(dsn, "mysql://")); err == nil {
		add(cfg.Passwd)
	}
	// user:pass@ before a host, whatever the parser thought
	if at := strings.LastIndex(dsn, "@"); at > 0 {
		head := dsn[:at]
		if i := strings.LastIndex(head, "//"); i >= 0 {
			head = head[i+2:]
		}
		if _, pass, ok := strings.Cut(head, ":"); ok {
			add(pass)
		}
	}
	// Longest first, so a password containing another is scrubbed whole.
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if len(out[j]) > len(out[i]) {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// redactor scrubs a DSN's password from text.
type redactor []string

func (r redactor) redact(s string) string {
	for _, p := range r {
		if p != "" {
			s = strings.ReplaceAll(s, p, "*****")
		}
	}
	return s
}
