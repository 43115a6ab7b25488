package relay

import (
	"context"
	"time"
)

// SinkProber is an optional Publisher capability: telling, in one cheap
// round trip to the sink, whether the sink answers. After a publish failed
// as unavailable (IsUnavailable), the relay probes the publisher every
// max(BackoffMin, ProbeIntervalMin) while buckets back off for that
// reason; once a probe answers after the sink was seen down (the failed
// publish, or a probe that failed since), the relay retries the batches
// of those buckets at once instead of sleeping out their backoff (up to
// BackoffMax). A publish that fails again while the probe answers keeps
// its plain backoff, and so does every failure that is not unavailable (a
// message refused for good, an unknown topic): the probe cannot see
// those. Without a SinkProber the relay sleeps the backoff out.
// publisher.Kafka and publisher.Transactional implement it.
//
// Unlike ReadyChecker, which reads the publisher's own state, ProbeSink
// must reach the sink: a cached answer would end every backoff while the
// sink is still down.
type SinkProber interface {
	// ProbeSink returns nil when the sink answers a request. It must be
	// bounded by ctx and must not log a failure: the relay calls it while
	// the sink is down.
	ProbeSink(ctx context.Context) error
}

// sinkWatch is the control loop's state of the sink's outage: while
// buckets back off after unavailable publishes, the loop probes the
// publisher (SinkProber). Control loop only.
type sinkWatch struct {
	failures  uint64    // the scheduler's count of unavailable publishes, as last seen
	down      bool      // a bucket backs off after an unavailable publish
	probeAt   time.Time // the next probe
	probing   bool      // a probe runs; its result comes on probed
	probed    chan error
	downSeen  bool      // a publish or a probe failed since the last early retry
	early     bool      // the last backoffs ended early: the sink answered
	downSince time.Time // the first unavailable publish of the outage; zero when none
}

// watchSink takes the unavailable publishes since the last turn and
// starts a probe of the sink when one is due. A failed publish counts as
// the sink seen down, unless the previous backoffs ended early and no
// probe failed since: then a probe must fail first, so that a failure
// the probe does not see keeps its plain backoff instead of being
// retried every probe interval.
func (e *engine) watchSink(ctx context.Context, l *loop, now time.Time) {
	if e.sinkProber == nil {
		return
	}
	w := &l.sink
	n, down := e.sched.sinkFailures()
	w.down = down
	if !down {
		w.downSeen, w.early, w.downSince, w.probeAt = false, false, time.Time{}, time.Time{}
		return
	}
	if n != w.failures {
		w.failures = n
		if w.downSince.IsZero() {
			w.downSince = now
		}
		if !w.early {
			w.downSeen = true
		}
	}
	if w.probing {
		return
	}
	if w.probeAt.IsZero() {
		w.probeAt = now.Add(e.probeEvery())
	}
	if now.Before(w.probeAt) {
		return
	}
	w.probing = true
	l.probes.Go(func() {
		pctx, cancel := context.WithTimeout(ctx, max(e.probeEvery(), time.Second))
		defer cancel()
		w.probed <- e.sinkProber.ProbeSink(pctx)
	})
}

// sinkProbeDue reports whether the loop waits to probe the sink.
func (l *loop) sinkProbeDue() bool { return l.sink.down && !l.sink.probing && !l.sink.probeAt.IsZero() }

// sinkProbeAnswered takes a probe's result. A sink that answers after it
// was seen down ends the backoffs of the buckets backing off after an
// unavailable publish: they are retried at once. The end of an outage is
// logged once; the probes themselves log nothing.
func (e *engine) sinkProbeAnswered(ctx context.Context, l *loop, err error) {
	w := &l.sink
	w.probing = false
	now := time.Now()
	w.probeAt = now.Add(e.probeEvery())
	if !w.down || ctx.Err() != nil {
		return
	}
	if err != nil {
		w.downSeen, w.early = true, false
		return
	}
	if !w.downSeen {
		return
	}
	e.log.Info("relay: the sink answers again; retrying now", "down_for", now.Sub(w.downSince).Round(time.Millisecond))
	w.downSeen, w.early = false, true
	e.sched.retrySinkNow(now)
}
