// Package pgxtrace counts the round trips of pgx connections, for the
// tests and the benchmark that compare them.
package pgxtrace

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// RoundTrips is a pgx tracer (pgx.ConnConfig.Tracer) that counts what a
// connection sends: every Exec, Query and Prepare (and so BEGIN and
// COMMIT), and every batch, which pgx sends as one pipeline: one round
// trip.
type RoundTrips struct{ n atomic.Int64 }

var (
	_ pgx.QueryTracer   = (*RoundTrips)(nil)
	_ pgx.PrepareTracer = (*RoundTrips)(nil)
	_ pgx.BatchTracer   = (*RoundTrips)(nil)
)

// Load returns the round trips counted so far.
func (c *RoundTrips) Load() int64 { return c.n.Load() }

func (c *RoundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *RoundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *RoundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *RoundTrips) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}
func (c *RoundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *RoundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *RoundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}
