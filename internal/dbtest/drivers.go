package dbtest

import (
	// database/sql drivers for the admin connections.
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
)
