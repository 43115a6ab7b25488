package relay

import "context"

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
