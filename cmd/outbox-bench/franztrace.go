package main

import (
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/gorm-outbox/outbox/publisher"
)

// franzTrace records, for a latency run with -timeline on the Franz
// publisher, when franz-go took each record and when it saw the record
// acknowledged, and each produce request's round trip, so that a slow
// publish can be split into its wait in the client (for a request to
// carry it), the request on the wire and in the broker, and the client's
// work after the response. Its hooks run on franz-go's goroutines.
type franzTrace struct {
	key func(*kgo.Record) string // the timeline's name for the record's message

	mu       sync.Mutex
	buffered map[*kgo.Record]time.Time
	recs     map[string]franzRecSpan // by key
	reqs     []franzReq
}

// franzRecSpan is a record's time in franz-go: taken by Produce, then
// acknowledged (its promise about to run).
type franzRecSpan struct{ buffered, acked time.Time }

// franzReq is a produce request: created (waiting for the connection),
// written, and its response read.
type franzReq struct {
	created, written, read time.Time
	bytes                  int
}

var (
	_ kgo.HookBrokerE2E               = (*franzTrace)(nil)
	_ kgo.HookProduceRecordBuffered   = (*franzTrace)(nil)
	_ kgo.HookProduceRecordUnbuffered = (*franzTrace)(nil)
)

// franzRecordKey names a record as the timeline names its message: by
// its value (rules8 writes a token there) with byValue, else by its
// message id header.
func franzRecordKey(byValue bool) func(*kgo.Record) string {
	return func(r *kgo.Record) string {
		if byValue {
			return string(r.Value)
		}
		for _, h := range r.Headers {
			if h.Key == publisher.MessageIDHeaderDefault {
				return string(h.Value)
			}
		}
		return ""
	}
}

func newFranzTrace(key func(*kgo.Record) string) *franzTrace {
	return &franzTrace{key: key, buffered: map[*kgo.Record]time.Time{}, recs: map[string]franzRecSpan{}}
}

// franzOpts is the Franz publisher's options that trace it into t: none
// without a timeline.
func (t *timeline) franzOpts() []kgo.Opt {
	if t == nil || t.franz == nil {
		return nil
	}
	return []kgo.Opt{kgo.WithHooks(t.franz)}
}

func (f *franzTrace) OnProduceRecordBuffered(r *kgo.Record) {
	now := time.Now()
	f.mu.Lock()
	f.buffered[r] = now
	f.mu.Unlock()
}

func (f *franzTrace) OnProduceRecordUnbuffered(r *kgo.Record, err error) {
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.buffered[r]
	delete(f.buffered, r)
	if ok && err == nil {
		f.recs[f.key(r)] = franzRecSpan{at, now}
	}
}

// OnBrokerE2E records produce requests (key 0) that were answered.
func (f *franzTrace) OnBrokerE2E(_ kgo.BrokerMetadata, key int16, e2e kgo.BrokerE2E) {
	if key != 0 || e2e.Err() != nil {
		return
	}
	read := time.Now()
	written := read.Add(-e2e.ReadWait - e2e.TimeToRead)
	created := written.Add(-e2e.TimeToWrite - e2e.WriteWait)
	f.mu.Lock()
	f.reqs = append(f.reqs, franzReq{created, written, read, e2e.BytesWritten})
	f.mu.Unlock()
}

// summary describes the produce requests, and where the records of the
// messages named in slow spent their time in franz-go, in one line.
func (f *franzTrace) summary(slow []string) string {
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	f.mu.Lock()
	defer f.mu.Unlock()
	reqs := append([]franzReq(nil), f.reqs...)
	sort.Slice(reqs, func(i, j int) bool { return reqs[i].read.Before(reqs[j].read) })
	var waits, trips, inClient []time.Duration
	for _, q := range reqs {
		waits = append(waits, q.written.Sub(q.created))
		trips = append(trips, q.read.Sub(q.written))
	}
	for _, r := range f.recs {
		inClient = append(inClient, r.acked.Sub(r.buffered))
	}
	sortDurations(waits)
	sortDurations(trips)
	sortDurations(inClient)
	s := fmt.Sprintf("franz: records ×%d Produce → ack p50 %.2f p99 %.2f ms; produce requests ×%d (%.1f records each), wait to be written p50 %.2f p99 %.2f ms, written → response read p50 %.2f p99 %.2f ms, in flight at a write max %d",
		len(inClient), ms(percentile(inClient, 0.5)), ms(percentile(inClient, 0.99)),
		len(reqs), float64(len(inClient))/float64(max(1, len(reqs))),
		ms(percentile(waits, 0.5)), ms(percentile(waits, 0.99)),
		ms(percentile(trips, 0.5)), ms(percentile(trips, 0.99)), maxInFlight(reqs))
	// A slow record's request is taken to be the last one whose response
	// was read before its acknowledgement.
	var n int
	var before, wire, after time.Duration
	for _, id := range slow {
		r, ok := f.recs[id]
		if !ok {
			continue
		}
		k := sort.Search(len(reqs), func(k int) bool { return reqs[k].read.After(r.acked) }) - 1
		if k < 0 || reqs[k].written.Before(r.buffered) {
			continue // no request is known to have carried it
		}
		q := reqs[k]
		n++
		before += max(0, q.written.Sub(r.buffered))
		wire += q.read.Sub(q.written)
		after += r.acked.Sub(q.read)
	}
	if n > 0 {
		d := time.Duration(n)
		s += fmt.Sprintf("; %d of the slow messages' records: Produce → its request written %.1f ms, written → response read %.1f, response → ack %.1f (averages)",
			n, ms(before/d), ms(wire/d), ms(after/d))
	}
	return s
}

// maxInFlight is the most requests of reqs written and not yet answered
// at any one request's write.
func maxInFlight(reqs []franzReq) int {
	most := 0
	for _, q := range reqs {
		n := 0
		for _, o := range reqs {
			if !o.written.After(q.written) && o.read.After(q.written) {
				n++
			}
		}
		most = max(most, n)
	}
	return most
}
