package publisher

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/gorm-outbox/outbox/internal/tracectx"
	"github.com/gorm-outbox/outbox/relay"
)

// maxPublishLinks bounds the links of one publish span, the default link
// limit of the OpenTelemetry SDK.
const maxPublishLinks = 128

// tracerName is the instrumentation scope of the publish spans.
const tracerName = "github.com/gorm-outbox/outbox"

// TracingPublisher wraps next so that each Publish call (one batch of one
// bucket) runs in a producer span named "send <topic>" (or "send" for a
// batch of several topics), linked to the trace context every message
// carries (at most 128 links). The span records the batch size, the
// bucket, the acknowledged count and, on failure, the error; never keys or
// values. The messages are passed on unchanged: their own traceparent,
// not the publish span, is what a consumer continues.
//
// tp provides the tracer; nil uses otel.GetTracerProvider() at each call.
// Without an installed SDK the spans are no-ops and cost next to nothing.
//
// When next implements relay.LeaseAware or relay.Reconciler (the
// transactional Kafka publisher implements both), so does the returned
// publisher, forwarding to it; when next has the relay's Pipeliner Send
// (Franz), so does the returned publisher, its span running from Send to
// the end of its wait. The
// returned publisher implements relay.ReadyChecker, forwarding to next's
// when it has one (the Kafka publishers do), so a relay still refuses to
// start on a wrapped publisher that was never started, and
// relay.SinkProber, forwarding to next's (the Kafka publishers have one;
// without one the probe fails, and the relay sleeps its backoffs out).
func TracingPublisher(next relay.Publisher, tp trace.TracerProvider) relay.Publisher {
	p := &tracingPublisher{next: next, tp: tp}
	la, isLA := next.(relay.LeaseAware)
	rc, isRC := next.(relay.Reconciler)
	switch {
	case isLA && isRC:
		return &strictTracingPublisher{tracingPublisher: p, LeaseAware: la, Reconciler: rc}
	case isLA:
		return &leaseAwareTracingPublisher{tracingPublisher: p, LeaseAware: la}
	case isRC:
		return &reconcilingTracingPublisher{tracingPublisher: p, Reconciler: rc}
	}
	if s, ok := next.(sender); ok {
		return &pipeliningTracingPublisher{tracingPublisher: p, sender: s}
	}
	return p
}

type tracingPublisher struct {
	next relay.Publisher
	tp   trace.TracerProvider
}

// leaseAwareTracingPublisher keeps the LeaseAware capability of the
// publisher it wraps.
type leaseAwareTracingPublisher struct {
	*tracingPublisher
	relay.LeaseAware
}

// reconcilingTracingPublisher keeps the Reconciler capability of the
// publisher it wraps.
type reconcilingTracingPublisher struct {
	*tracingPublisher
	relay.Reconciler
}

// strictTracingPublisher keeps both capabilities of the transactional
// publisher it wraps.
type strictTracingPublisher struct {
	*tracingPublisher
	relay.LeaseAware
	relay.Reconciler
}

// CheckReady implements relay.ReadyChecker: next's, or nil.
func (p *tracingPublisher) CheckReady(ctx context.Context) error {
	if rc, ok := p.next.(relay.ReadyChecker); ok {
		return rc.CheckReady(ctx)
	}
	return nil
}

// ProbeSink implements relay.SinkProber: next's, or an error, so that a
// relay never takes a publisher that cannot probe for a sink that answers.
func (p *tracingPublisher) ProbeSink(ctx context.Context) error {
	if sp, ok := p.next.(relay.SinkProber); ok {
		return sp.ProbeSink(ctx)
	}
	return errCannotProbe
}

// errCannotProbe is a forwarding ProbeSink's error when the publisher
// it wraps cannot probe its sink.
var errCannotProbe = errors.New("publisher: the wrapped publisher cannot probe its sink")

func (p *tracingPublisher) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	ctx, span := p.start(ctx, msgs)
	acked, err := p.next.Publish(ctx, msgs)
	end(span, acked, err)
	return acked, err
}

// sender is the Send of a publisher that pipelines a bucket's batches
// (Franz).
type sender interface {
	Send(ctx context.Context, msgs []relay.Message) (wait func() (int, error))
}

// pipeliningTracingPublisher keeps the Send of the publisher it wraps:
// the span runs from Send to the end of its wait.
type pipeliningTracingPublisher struct {
	*tracingPublisher
	sender sender
}

// Send implements the relay's Pipeliner, in a span as Publish.
func (p *pipeliningTracingPublisher) Send(ctx context.Context, msgs []relay.Message) (wait func() (int, error)) {
	ctx, span := p.start(ctx, msgs)
	w := p.sender.Send(ctx, msgs)
	return func() (int, error) {
		acked, err := w()
		end(span, acked, err)
		return acked, err
	}
}

// end records a publish's answer on its span and ends it.
func end(span trace.Span, acked int, err error) {
	span.SetAttributes(attribute.Int("outbox.acked", acked))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "publish failed")
	}
	span.End()
}

// start starts the span of a publish of msgs.
func (p *tracingPublisher) start(ctx context.Context, msgs []relay.Message) (context.Context, trace.Span) {
	tp := p.tp
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	name, topic := "send", ""
	if len(msgs) > 0 {
		topic = msgs[0].Topic
		for _, m := range msgs[1:] {
			if m.Topic != topic {
				topic = ""
				break
			}
		}
		if topic != "" {
			name += " " + topic
		}
	}
	attrs := []attribute.KeyValue{
		attribute.String("messaging.operation.type", "send"),
		attribute.Int("messaging.batch.message_count", len(msgs)),
	}
	if topic != "" {
		attrs = append(attrs, attribute.String("messaging.destination.name", topic))
	}
	if len(msgs) > 0 {
		attrs = append(attrs, attribute.Int("outbox.bucket", msgs[0].Bucket))
	}
	var links []trace.Link
	for i := range msgs {
		if len(links) == maxPublishLinks {
			break
		}
		sc := trace.SpanContextFromContext(tracectx.Extract(context.Background(), msgs[i].Headers))
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	return tp.Tracer(tracerName).Start(ctx, name,
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...), trace.WithLinks(links...))
}
