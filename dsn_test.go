package outbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
)

func TestMySQLDSN(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"mysql://u:p%40ss@db:3307/shop?tls=true":    "u:p@ss@tcp(db:3307)/shop?parseTime=true&tls=true",
		"mysql://root@localhost/shop":               "root@tcp(localhost:3306)/shop?parseTime=true",
		"mysql://root:pw@tcp(db:3306)/shop?x=1":     "root:pw@tcp(db:3306)/shop?x=1",
		"mysql://app@unix(/run/mysqld.sock)/orders": "app@unix(/run/mysqld.sock)/orders",
	} {
		got, err := outbox.MySQLDSN(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	_, err := outbox.MySQLDSN("mysql:///shop")
	require.ErrorContains(t, err, "no host")
}
