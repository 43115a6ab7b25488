// Package metrics exports a relay's instrumentation as Prometheus metrics.
// It is the observability room of the relay step of write → table →
// relay → publisher, and the only package that imports Prometheus.
//
// A Collector is both a prometheus.Collector and a relay.Observer: hand it
// to the relay as relay.Config.Observer and register it on your own
// registry. Nothing is registered on the global registry.
//
//	m, err := metrics.New(metrics.Config{Outbox: "orders"})
//	if err != nil { ... }
//	registry.MustRegister(m)
//	r, err := relay.New(store, publisher, relay.Config{Observer: m})
//
// Every series carries one constant label, outbox, naming the outbox;
// bucket is a label only on the per-bucket backlog gauges, where
// BucketCount bounds it; failure kinds and dead-letter states are small
// fixed sets. No message id, key, tenant or relay id ever becomes a label:
// tell relays apart by the scrape target's own labels (instance, pod).
//
// # Backlog
//
// With a store that implements relay.BacklogSampler (the GORM store does),
// the started relay reads the whole backlog every SampleInterval on its
// own goroutine, at most one query at a time, bounded by SampleTimeout.
// The collector serves the last sample at scrape time; a scrape never
// queries the database. outbox_pending_available is 1 while a sample
// exists. Before the first sample, after a failed or timed-out one, when
// the relay does not sample (SampleOnBucketZeroOwnerOnly and another relay
// holds bucket 0) and after the relay stopped, it is 0 and the backlog
// gauges are absent: an unknown backlog is never reported as zero.
//
// The oldest-pending ages are computed at scrape time from the sampled
// creation times, so they keep growing between samples, as they would
// for a stuck message; a message published since the last sample keeps
// counting until the next one.
//
// With several relays per outbox, the backlog gauges of every relay
// describe the same table: aggregate them with max, never sum. Counters and
// the owned-buckets gauge are per relay and add up.
package metrics
