package outbox_test

import (
	"context"
	"testing"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func TestMigrateSmoke(t *testing.T) {
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		tb := outbox.Config{Tables: outbox.WithPrefix("x_")}.WithDefaults().Tables
		if err := tb.AutoMigrate(context.Background(), db.DB); err != nil {
			t.Fatal(err)
		}
		if err := tb.AutoMigrate(context.Background(), db.DB); err != nil {
			t.Fatal(err)
		}
	})
}
