package relay

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// outage is what a failed batch waits for when a probe can tell its end:
// the store (a read or delete of the drainer failed, the loop's
// acquisition or discovery failed) or the sink (a publish failed as
// unavailable). Anything else a batch fails on is no outage: its backoff
// is slept out.
type outage int

const (
	noOutage outage = iota
	storeOutage
	sinkOutage
	outageKinds
)

// outageWatch is the control loop's watch of one outage, the store's or
// the sink's: while something backs off for it, the loop probes every
// interval, one probe at a time, and the first probe that answers after
// the outage was seen ends those backoffs. Control loop only, but for
// the probe, which runs beside the loop and reports on probed.
type outageWatch struct {
	kind  outage
	probe func(context.Context) error // nil: nothing to probe with; backoffs are slept out
	every time.Duration
	// back is the line logged once at the end of an outage.
	back string

	probed chan error
	probes *sync.WaitGroup

	failures  uint64    // the failures counted so far, as last seen
	down      bool      // something backs off after a failure of this kind
	probeAt   time.Time // the next probe; zero: none planned
	probing   bool      // a probe runs; its result comes on probed
	downSeen  bool      // a failure or a probe failed since the last early retry
	early     bool      // the last backoffs ended early: the probe answered
	downSince time.Time // the first failure of the outage; zero when none
}

func newOutageWatch(kind outage, probe func(context.Context) error, every time.Duration, back string, probes *sync.WaitGroup) outageWatch {
	return outageWatch{kind: kind, probe: probe, every: every, back: back, probed: make(chan error, 1), probes: probes}
}

// update takes the watch's state at now: failures is the count of
// failures of its kind so far (a count that moved is a failure seen),
// down whether anything backs off for them. A failure counts as the
// outage seen, unless the previous backoffs ended early and no probe
// failed since: then a probe must fail first, so that a failure the
// probe does not see (the store answers, the read fails anyway) keeps
// its plain backoff instead of being retried every probe interval. Once
// nothing backs off, the outage is over.
func (w *outageWatch) update(failures uint64, down bool, now time.Time) {
	if w.probe == nil {
		return
	}
	w.down = down
	if !down {
		w.failures = failures
		w.downSeen, w.early, w.downSince, w.probeAt = false, false, time.Time{}, time.Time{}
		return
	}
	if failures != w.failures {
		w.failures = failures
		if w.downSince.IsZero() {
			w.downSince = now
		}
		if !w.early {
			w.downSeen = true
		}
	}
	if !w.probing && w.probeAt.IsZero() {
		w.probeAt = now.Add(w.every)
	}
}

// due reports whether the loop waits to probe.
func (w *outageWatch) due() bool {
	return w.probe != nil && w.down && !w.probing && !w.probeAt.IsZero()
}

// start starts a probe beside the loop when one is due by now. A probe is
// bounded by the probe interval or a second, whichever is longer.
func (w *outageWatch) start(ctx context.Context, now time.Time) {
	if !w.due() || now.Before(w.probeAt) {
		return
	}
	w.probing = true
	w.probes.Go(func() {
		pctx, cancel := context.WithTimeout(ctx, max(w.every, time.Second))
		defer cancel()
		w.probed <- w.probe(pctx)
	})
}

// answered takes a probe's result, and reports whether the outage is
// over: the probe answered after the outage was seen; the caller then
// retries what backs off for it at once. The end of an outage is logged
// once; the probes themselves log nothing.
func (w *outageWatch) answered(ctx context.Context, log *slog.Logger, err error, now time.Time) bool {
	w.probing = false
	w.probeAt = now.Add(w.every)
	if !w.down || ctx.Err() != nil {
		return false
	}
	if err != nil {
		w.downSeen, w.early = true, false
		return false
	}
	if !w.downSeen {
		return false
	}
	log.Info(w.back, "down_for", now.Sub(w.downSince).Round(time.Millisecond))
	w.downSeen, w.early = false, true
	return true
}
