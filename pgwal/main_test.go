package pgwal_test

import (
	"testing"

	"github.com/gorm-outbox/outbox/internal/dbtest"
)

func TestMain(m *testing.M) { dbtest.VerifyTestMain(m) }
