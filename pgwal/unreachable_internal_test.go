package pgwal

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestUnreachable: a database that is down, restarting or ended the
// session is retried at start; a refusal retrying cannot fix is not.
func TestUnreachable(t *testing.T) {
	for code, want := range map[string]bool{
		"57P01": true,  // terminated by an administrator
		"57P03": true,  // not yet accepting connections
		"08006": true,  // connection failure
		"53300": true,  // too many connections
		"42501": false, // insufficient privilege
		"42P07": false, // duplicate table
		"28P01": false, // password authentication failed
	} {
		err := fmt.Errorf("pgwal: create lease table x: %w", &pgconn.PgError{Code: code})
		require.Equal(t, want, unreachable(err), code)
	}
	require.False(t, unreachable(errors.New("syntax")))
}

// TestCreateRace: a CREATE that raced with the same CREATE in another
// session is retried; other refusals are not.
func TestCreateRace(t *testing.T) {
	for code, want := range map[string]bool{"42P07": true, "42710": true, "23505": true, "42501": false, "57P01": false} {
		require.Equal(t, want, createRace(fmt.Errorf("x: %w", &pgconn.PgError{Code: code})), code)
	}
}
