package migrations

import "embed"

// FS holds the migration files: postgres/, mysql/ and sqlite/, each with
// the golang-migrate files at its top and the goose files in goose/.
//
//go:embed postgres mysql sqlite
var FS embed.FS
