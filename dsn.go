package outbox

import (
	"fmt"
	"net/url"
	"strings"
)

// MySQLDSN turns mysql://user:pass@host:port/db?params, the URL form
// services commonly take, into the driver's
// user:pass@tcp(host:port)/db?parseTime=true&params. A DSN already in the
// driver's form after mysql:// (user:pass@tcp(...)/db) is passed through.
func MySQLDSN(raw string) (string, error) {
	rest := strings.TrimPrefix(raw, "mysql://")
	if strings.Contains(rest, "@tcp(") || strings.Contains(rest, "@unix(") || strings.HasPrefix(rest, "tcp(") || strings.HasPrefix(rest, "unix(") {
		return rest, nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("outbox: mysql:// DSN: %w", err)
	}
	if u.Host == "" {
		return "", fmt.Errorf("outbox: mysql:// DSN: no host (want mysql://user:pass@host:3306/database)")
	}
	host := u.Host
	if u.Port() == "" {
		host += ":3306"
	}
	q := u.Query()
	q.Set("parseTime", "true")
	userinfo := ""
	if u.User != nil {
		userinfo = u.User.Username()
		if p, ok := u.User.Password(); ok {
			userinfo += ":" + p
		}
		userinfo += "@"
	}
	return fmt.Sprintf("%stcp(%s)/%s?%s", userinfo, host, strings.TrimPrefix(u.Path, "/"), q.Encode()), nil
}
