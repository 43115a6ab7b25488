package gormrelay_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// The relay's own statements do not reach the application's GORM log
// (Info level, every statement "slow"), unless they fail; the
// application's statements, the plugin's insert in its transaction
// included, still do.
func TestLibraryStatementsLogOnlyFailures(t *testing.T) {
	t.Parallel()
	var buf dbtest.LogBuffer
	gl := dbtest.LogEverything(&buf)
	db := dbtest.Open(t, dbtest.Postgres, dbtest.Options{Config: &gorm.Config{Logger: gl}})
	p := wiredPlugin(t, db.DB, outbox.Config{BucketCount: 4})
	messages := p.Config().Tables.MessagesTable()
	buf.Take()

	enqueue(t, db.DB, "orders", 5)
	user := buf.Take()
	require.Contains(t, user, "SLOW SQL >= 1ns", "the application's statements log")
	require.Contains(t, user, `INSERT INTO "`+messages+`"`, "the plugin's insert, in the application's transaction, logs")

	rec := newRecorder()
	r, err := gormrelay.New(db.DB, p, rec.publisher("quiet", nil), gormrelay.WithRelayConfig(fastConfig(t, "quiet")))
	require.NoError(t, err)
	res, err := r.DrainOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, 5, res)
	require.Empty(t, buf.Take(), "a drain logs none of its statements")

	require.NoError(t, db.DB.Exec("DROP TABLE "+messages).Error)
	buf.Take()
	_, err = r.DrainOnce(context.Background())
	require.Error(t, err)
	failed := buf.Take()
	require.Contains(t, failed, messages, "a failing statement of the relay still logs")
	require.Contains(t, failed, "does not exist")
	require.NotContains(t, failed, "SLOW SQL")
}

// A relay started on missing tables fails with the schema check's error,
// and the check's probes (each failing on the missing table) do not reach
// the application's GORM log.
func TestSchemaProbesDoNotLog(t *testing.T) {
	t.Parallel()
	var buf dbtest.LogBuffer
	gl := dbtest.LogEverything(&buf)
	db := dbtest.Open(t, dbtest.Postgres, dbtest.Options{Config: &gorm.Config{Logger: gl}})
	p, err := outbox.NewPlugin(outbox.Config{BucketCount: 4})
	require.NoError(t, err)
	require.NoError(t, db.DB.Use(p))
	r, err := gormrelay.New(db.DB, p, newRecorder().publisher("probe", nil), gormrelay.WithRelayConfig(fastConfig(t, "probe")))
	require.NoError(t, err)
	buf.Take()
	err = r.Run(t.Context())
	require.ErrorIs(t, err, outbox.ErrSchemaOutdated)
	require.ErrorContains(t, err, "is missing")
	logged := buf.Take()
	require.NotContains(t, logged, "does not exist", "the schema probes log nothing")
	require.NotContains(t, logged, p.Config().Tables.MessagesTable())
}
