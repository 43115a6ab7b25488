// Package pgnotifytest opens pgnotify transports on the test PostgreSQL
// server.
package pgnotifytest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/pgnotify"
)

// New returns a transport on channel of the test PostgreSQL server whose
// connections are named app, reconnecting after 20 to 200 ms. edit adjusts
// its configuration. It is closed when the test ends, after the cleanups
// registered later (a bridge started on it) ran.
func New(t *testing.T, channel, app string, edit ...func(*pgnotify.Config)) *pgnotify.Transport {
	t.Helper()
	cfg := pgnotify.Config{
		DSN:                 dbtest.PostgresDSN(),
		Channel:             channel,
		ApplicationName:     app,
		ReconnectBackoffMin: 20 * time.Millisecond,
		ReconnectBackoffMax: 200 * time.Millisecond,
		Logger:              dbtest.Logger(t),
	}
	for _, e := range edit {
		e(&cfg)
	}
	tr, err := pgnotify.New(cfg)
	require.NoError(t, err)
	t.Cleanup(tr.Close)
	return tr
}
