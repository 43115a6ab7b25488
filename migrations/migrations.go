package migrations

import "embed"

// FS holds the migration files: postgres/, mysql/ and sqlite/, each with
// the golang-migrate files at its top, the goose files in goose/ and the
// inbox set in inbox/ (inbox/goose/ for goose).
//
//go:embed postgres mysql sqlite
var FS embed.FS
