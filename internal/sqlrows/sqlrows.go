// Package sqlrows holds the SQL shape of an outbox message row that both
// the write side (package outbox) and the relay's store (package
// gormrelay) write: the INSERT column list, its chunk size and how a byte
// column is bound. It is internal so that the two sides agree without the
// root package exporting it.
package sqlrows

import "github.com/gorm-outbox/outbox/wire"

// InsertColumns are the columns a new message row is inserted with; the
// id and the failure columns take their defaults.
const InsertColumns = "(" + wire.InsertColumns + ")"

// InsertArgs is the number of values of one row in InsertColumns.
const InsertArgs = wire.InsertArgs

// InsertChunk bounds the rows of one INSERT: 500 rows of 13 parameters or
// fewer stay far below every supported database's parameter limit.
const InsertChunk = 500

// NullBytes turns a nil slice into an untyped nil so every driver writes
// NULL, and keeps an empty, non-nil slice as an empty value.
func NullBytes(b []byte) any {
	if b == nil {
		return nil
	}
	return b
}
