package outbox

import (
	"context"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/gorm-outbox/outbox/internal/tracectx"
)

// The W3C Trace Context headers a message carries when it was written
// inside a trace.
const (
	TraceParentHeader = tracectx.TraceParent
	TraceStateHeader  = tracectx.TraceState
)

// injectTraceContext adds the traceparent and tracestate headers of the
// span in ctx to m, when ctx holds a valid span context and m carries
// neither header yet. It copies the header slice rather than appending to
// the caller's. Enqueue and publish rules run it on the statement's
// context before the message is validated, so the headers count against
// MaxMessageBytes.
func injectTraceContext(ctx context.Context, m *Message) {
	if ctx == nil || !trace.SpanContextFromContext(ctx).IsValid() {
		return
	}
	for _, h := range m.Headers {
		if tracectx.IsHeader(h.Key) {
			return
		}
	}
	carrier := propagation.MapCarrier{}
	tracectx.Propagator.Inject(ctx, carrier)
	parent := carrier[TraceParentHeader]
	if parent == "" {
		return
	}
	hs := make([]Header, len(m.Headers), len(m.Headers)+2)
	copy(hs, m.Headers)
	hs = append(hs, Header{Key: TraceParentHeader, Value: []byte(parent)})
	if state := carrier[TraceStateHeader]; state != "" {
		hs = append(hs, Header{Key: TraceStateHeader, Value: []byte(state)})
	}
	m.Headers = hs
}

// ExtractTraceContext returns ctx with the remote span context carried by
// headers (traceparent, tracestate), or ctx unchanged when they carry
// none. A consumer of a function publisher (relay.PublisherFunc) uses it
// to continue the trace of the request that wrote the message; Kafka
// consumers read the same record headers with their own propagator.
func ExtractTraceContext(ctx context.Context, headers []Header) context.Context {
	return tracectx.Extract(ctx, headers)
}
