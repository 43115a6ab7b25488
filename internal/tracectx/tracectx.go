// Package tracectx reads and writes the W3C Trace Context of a message's
// headers. The write side (package outbox) injects it when a message is
// written inside a trace; the tracing publisher (package publisher) links
// each publish span to it.
package tracectx

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel/propagation"

	"github.com/gorm-outbox/outbox/wire"
)

// The W3C Trace Context header names.
const (
	TraceParent = "traceparent"
	TraceState  = "tracestate"
)

// Propagator is the W3C Trace Context propagator. It is used directly,
// not through otel.GetTextMapPropagator, so messages carry traceparent
// whatever global propagator the application configured (the global
// default propagates nothing).
var Propagator propagation.TraceContext

// IsHeader reports whether key names a Trace Context header, in any case.
func IsHeader(key string) bool {
	return strings.EqualFold(key, TraceParent) || strings.EqualFold(key, TraceState)
}

// Extract returns ctx with the remote span context carried by headers, or
// ctx unchanged when they carry none.
func Extract(ctx context.Context, headers []wire.Header) context.Context {
	return Propagator.Extract(ctx, carrier(headers))
}

// carrier reads W3C headers from a message's headers.
type carrier []wire.Header

func (c carrier) Get(key string) string {
	for _, h := range c {
		if strings.EqualFold(h.Key, key) {
			return string(h.Value)
		}
	}
	return ""
}

func (c carrier) Set(string, string) {} // read-only

func (c carrier) Keys() []string {
	keys := make([]string, len(c))
	for i, h := range c {
		keys[i] = h.Key
	}
	return keys
}
