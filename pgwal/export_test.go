package pgwal

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// OpenWALOutbox opens a database of its own on the WAL mode server with
// an outbox in WAL mode of a name of its own, registered and migrated:
// the start of every reader test, internal (package pgwal) or not.
func OpenWALOutbox(t *testing.T) (*dbtest.DB, *outbox.Plugin) {
	t.Helper()
	dbt := dbtest.OpenWAL(t)
	p, err := outbox.NewPlugin(outbox.Config{Name: dbtest.Name("o_"), Mode: outbox.ModeWAL})
	require.NoError(t, err)
	require.NoError(t, dbt.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), dbt.DB))
	return dbt, p
}
