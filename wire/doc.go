// Package wire holds what the outbox's write side (package outbox, the
// GORM plugin) and its read side (package relay, the stores, the
// publishers) share: the record header, the configuration error every
// package of the module returns, the bucket function, the outbox row's
// column names, and the Kafka sink's limits on topic names and record
// sizes. It imports nothing from this module, so either side can use it
// without pulling in the other.
package wire
