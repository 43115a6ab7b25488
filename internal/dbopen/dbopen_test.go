package dbopen

import (
	"testing"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

func TestWithMySQLDatabase(t *testing.T) {
	t.Parallel()
	const server = "root:@tcp(127.0.0.1:3306)/"
	require.Equal(t, server+"t_1?parseTime=true", WithMySQLDatabase(server+"test?parseTime=true", "t_1"))
	require.Equal(t, server+"t_1", WithMySQLDatabase(server+"test", "t_1"))
	require.Equal(t, server+"t_1", WithMySQLDatabase(server, "t_1"))
	require.Equal(t, "no slash", WithMySQLDatabase("no slash", "t_1"), "returned as it is")
}

func TestOpen(t *testing.T) {
	t.Parallel()
	db, err := Open(SQLite, "file:"+t.TempDir()+"/x.db", &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlDB.Close() })
	require.Equal(t, 1, sqlDB.Stats().MaxOpenConnections)
	var one int
	require.NoError(t, db.Raw("SELECT 1").Scan(&one).Error)
	require.Equal(t, 1, one)

	_, err = Open("oracle", "", &gorm.Config{})
	require.ErrorContains(t, err, `unknown dialect "oracle"`)
}
