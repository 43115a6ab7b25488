package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/relay"
)

// timeline records, for one latency run with -timeline, when the relay
// read, published and deleted each batch and when this process could not
// run, so that the slow messages can be traced to a step. It is off by
// default: the wrappers it needs are only installed with -timeline.
type timeline struct {
	t0 time.Time
	// key names a message as the writer does: its message id, or its value
	// (rules8 writes a token there).
	key func(relay.Message) string

	// franz traces the Franz publisher's records and requests; nil for
	// sarama.
	franz *franzTrace

	mu     sync.Mutex
	ops    []tlOp
	pubOf  map[string]int // message → index in ops of its publish
	stalls []tlOp
}

type tlOp struct {
	kind       string // read, publish, delete, delete+read, discover, acquire, renew, stall
	bucket     int
	start, end time.Time
	n          int
}

func newTimeline(key func(relay.Message) string) *timeline {
	return &timeline{t0: time.Now(), key: key, pubOf: map[string]int{}}
}

func (t *timeline) op(kind string, bucket int, start time.Time, n int) {
	end := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ops = append(t.ops, tlOp{kind, bucket, start, end, n})
}

// probe records every moment this process's goroutines could not run for
// more than stallMin: a millisecond ticker's lateness. It costs a wake-up
// per millisecond, which is why it only runs with -timeline.
func (t *timeline) probe(stop <-chan struct{}) {
	const stallMin = 4 * time.Millisecond
	last := time.Now()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case now := <-tick.C:
			if now.Sub(last) > stallMin {
				t.mu.Lock()
				t.stalls = append(t.stalls, tlOp{kind: "stall", bucket: -1, start: last, end: now})
				t.mu.Unlock()
			}
			last = now
		}
	}
}

// timedStore times the store calls of the relay's batches and loop.
type timedStore struct {
	*gormrelay.Store
	tl *timeline
}

func (s timedStore) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	st := time.Now()
	m, err := s.Store.NextBatch(ctx, bucket, limit)
	s.tl.op("read", bucket, st, len(m))
	return m, err
}

func (s timedStore) NextBatchExcept(ctx context.Context, bucket, limit int, except []relay.Message) ([]relay.Message, error) {
	st := time.Now()
	m, err := s.Store.NextBatchExcept(ctx, bucket, limit, except)
	s.tl.op("read", bucket, st, len(m))
	return m, err
}

func (s timedStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	st := time.Now()
	err := s.Store.MarkPublished(ctx, id, l, msgs)
	s.tl.op("delete", l.Bucket, st, len(msgs))
	return err
}

func (s timedStore) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	st := time.Now()
	m, err := s.Store.MarkPublishedNext(ctx, id, l, msgs, limit)
	s.tl.op("delete+read", l.Bucket, st, len(msgs))
	return m, err
}

func (s timedStore) PendingBuckets(ctx context.Context, bs []int) ([]int, error) {
	st := time.Now()
	p, err := s.Store.PendingBuckets(ctx, bs)
	s.tl.op("discover", -1, st, len(p))
	return p, err
}

func (s timedStore) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	st := time.Now()
	a, err := s.Store.AcquireLeases(ctx, req)
	s.tl.op("acquire", -1, st, len(a.Leases))
	return a, err
}

func (s timedStore) RenewLeases(ctx context.Context, id string, ls []relay.Lease, d time.Duration) ([]relay.Lease, error) {
	st := time.Now()
	out, err := s.Store.RenewLeases(ctx, id, ls, d)
	s.tl.op("renew", -1, st, len(out))
	return out, err
}

// timedPub times each publish and remembers which one carried a message.
type timedPub struct {
	relay.Publisher
	tl *timeline
}

func (p timedPub) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	i := p.started(msgs)
	n, err := p.Publisher.Publish(ctx, msgs)
	p.ended(i)
	return n, err
}

// started records the publish of msgs as started and returns its op.
// Recorded before the call: the consumer may receive a message before
// the publisher has seen its acknowledgement.
func (p timedPub) started(msgs []relay.Message) int {
	b := -1
	if len(msgs) > 0 {
		b = msgs[0].Bucket
	}
	p.tl.mu.Lock()
	defer p.tl.mu.Unlock()
	i := len(p.tl.ops)
	p.tl.ops = append(p.tl.ops, tlOp{kind: "publish", bucket: b, start: time.Now(), n: len(msgs)})
	for _, m := range msgs {
		p.tl.pubOf[p.tl.key(m)] = i
	}
	return i
}

// ended records op i's publish as ended.
func (p timedPub) ended(i int) {
	end := time.Now()
	p.tl.mu.Lock()
	p.tl.ops[i].end = end
	p.tl.mu.Unlock()
}

// timedPipeliner is timedPub of a relay.Pipeliner, keeping Send: a
// publish runs from its Send to the end of its wait.
type timedPipeliner struct{ timedPub }

func (p timedPipeliner) Send(ctx context.Context, msgs []relay.Message) func() (int, error) {
	i := p.started(msgs)
	wait := p.Publisher.(relay.Pipeliner).Send(ctx, msgs)
	return func() (int, error) {
		n, err := wait()
		p.ended(i)
		return n, err
	}
}

// timed wraps pub so that its publishes are recorded in tl, keeping a
// Pipeliner's Send.
func timed(pub relay.Publisher, tl *timeline) relay.Publisher {
	if _, ok := pub.(relay.Pipeliner); ok {
		return timedPipeliner{timedPub{pub, tl}}
	}
	return timedPub{pub, tl}
}

// tlMessage is one message's path: commit, the batch read that carried
// it, its publish, and the consumer's receipt.
type tlMessage struct {
	id                                                 string
	commit, readStart, readEnd, pubStart, pubEnd, recv time.Time
	bucket                                             int
	// busy: the bucket's previous batch was still in flight at commit.
	busy bool
}

// trace joins the writer's records with the relay's: for each message,
// the batch read that carried it is the last read of its bucket that
// ended before its publish started.
func (t *timeline) trace(ids []string, committed []time.Time, recv map[string]time.Time) []tlMessage {
	t.mu.Lock()
	defer t.mu.Unlock()
	reads := map[int][]tlOp{} // by bucket, in end order
	// busy: by bucket, the union of its reads, publishes and deletes. A
	// batch's delete can run beside the next batch's publish (relay.
	// BatchSkipper), so a batch is in flight from its read's start to
	// the later of its publish's and its delete's ends.
	busy := map[int][]tlOp{}
	for _, o := range t.ops {
		switch o.kind {
		case "read", "delete+read":
			reads[o.bucket] = append(reads[o.bucket], o)
		}
		switch o.kind {
		case "read", "delete+read", "publish", "delete":
			end := o.end
			if end.IsZero() {
				end = time.Now() // a publish not acknowledged yet
			}
			busy[o.bucket] = append(busy[o.bucket], tlOp{start: o.start, end: end})
		}
	}
	for b, ops := range busy {
		busy[b] = unionOps(ops)
	}
	for _, rs := range reads {
		sort.Slice(rs, func(i, j int) bool { return rs[i].end.Before(rs[j].end) })
	}
	out := make([]tlMessage, 0, len(ids))
	for i, id := range ids {
		pi, ok := t.pubOf[id]
		at, got := recv[id]
		if !ok || !got {
			continue
		}
		p := t.ops[pi]
		if p.end.IsZero() {
			p.end = at // received, its acknowledgement not yet seen
		}
		m := tlMessage{id: id, commit: committed[i], pubStart: p.start, pubEnd: p.end, recv: at, bucket: p.bucket}
		rs := reads[p.bucket]
		k := sort.Search(len(rs), func(k int) bool { return rs[k].end.After(p.start) }) - 1
		if k >= 0 {
			m.readStart, m.readEnd = rs[k].start, rs[k].end
		}
		spans := busy[p.bucket]
		k = sort.Search(len(spans), func(k int) bool { return spans[k].end.After(m.commit) })
		m.busy = k < len(spans) && spans[k].start.Before(m.commit)
		out = append(out, m)
	}
	return out
}

// unionOps merges ops's intervals: the periods covered by one or more of
// them, sorted, none overlapping.
func unionOps(ops []tlOp) []tlOp {
	sort.Slice(ops, func(i, j int) bool { return ops[i].start.Before(ops[j].start) })
	var out []tlOp
	for _, o := range ops {
		if n := len(out); n > 0 && !o.start.After(out[n-1].end) {
			if o.end.After(out[n-1].end) {
				out[n-1].end = o.end
			}
			continue
		}
		out = append(out, tlOp{start: o.start, end: o.end})
	}
	return out
}

// summary describes where the messages slower than threshold spent
// their time, and how long the relay's steps took, in one line.
func (t *timeline) summary(msgs []tlMessage, threshold time.Duration) string {
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	var n, busy int
	var wait, read, pub, recv time.Duration
	var slow []string
	for _, m := range msgs {
		if m.recv.Sub(m.commit) > threshold {
			slow = append(slow, m.id)
		}
		if m.recv.Sub(m.commit) <= threshold || m.readStart.IsZero() {
			continue
		}
		n++
		if m.busy {
			busy++
		}
		wait += m.readStart.Sub(m.commit)
		read += m.pubStart.Sub(m.readStart)
		pub += m.pubEnd.Sub(m.pubStart)
		recv += m.recv.Sub(m.pubEnd)
	}
	s := fmt.Sprintf("%d messages above %.1f ms", n, ms(threshold))
	if n > 0 {
		d := time.Duration(n)
		s += fmt.Sprintf(" spent on average: commit → batch read start %.1f ms (bucket's previous batch in flight at commit for %d%%), read %.1f, publish %.1f, ack → receipt %.1f;",
			ms(wait/d), 100*busy/n, ms(read/d), ms(pub/d), ms(recv/d))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	byKind := map[string][]time.Duration{}
	var kinds []string
	for _, o := range t.ops {
		if _, ok := byKind[o.kind]; !ok {
			kinds = append(kinds, o.kind)
		}
		byKind[o.kind] = append(byKind[o.kind], o.end.Sub(o.start))
	}
	for _, k := range kinds {
		d := byKind[k]
		sortDurations(d)
		s += fmt.Sprintf(" %s ×%d p50 %.2f p99 %.2f ms;", k, len(d), ms(percentile(d, 0.5)), ms(percentile(d, 0.99)))
	}
	var stalled time.Duration
	for _, o := range t.stalls {
		stalled += o.end.Sub(o.start)
	}
	s += fmt.Sprintf(" process stalled > 4 ms %d times, %.0f ms in all", len(t.stalls), ms(stalled))
	if t.franz != nil {
		s += "; " + t.franz.summary(slow)
	}
	return s
}

// write saves the messages and the relay's steps as tab-separated files
// in dir, times in milliseconds from the run's start.
func (t *timeline) write(dir, mode string, msgs []tlMessage) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	at := func(ts time.Time) string {
		if ts.IsZero() {
			return ""
		}
		return fmt.Sprintf("%.3f", float64(ts.Sub(t.t0).Microseconds())/1000)
	}
	if err := writeTSV(filepath.Join(dir, mode+"-messages.tsv"), "commit\tread_start\tread_end\tpublish_start\tpublish_end\treceipt\tbucket\tbucket_busy", func(w *bufio.Writer) {
		for _, m := range msgs {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%t\n", at(m.commit), at(m.readStart), at(m.readEnd), at(m.pubStart), at(m.pubEnd), at(m.recv), m.bucket, m.busy)
		}
	}); err != nil {
		return err
	}
	// The files' times count from t0; the start file sets them against
	// the wall clock (a broker's GC log, say).
	if err := os.WriteFile(filepath.Join(dir, mode+"-start.txt"), []byte(t.t0.Format(time.RFC3339Nano)+"\n"), 0o644); err != nil {
		return err
	}
	if f := t.franz; f != nil {
		f.mu.Lock()
		reqs := append([]franzReq(nil), f.reqs...)
		f.mu.Unlock()
		if err := writeTSV(filepath.Join(dir, mode+"-franz-requests.tsv"), "created\twritten\tread\tbytes", func(w *bufio.Writer) {
			for _, q := range reqs {
				fmt.Fprintf(w, "%s\t%s\t%s\t%d\n", at(q.created), at(q.written), at(q.read), q.bytes)
			}
		}); err != nil {
			return err
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return writeTSV(filepath.Join(dir, mode+"-steps.tsv"), "step\tbucket\tstart\tend\tmessages", func(w *bufio.Writer) {
		for _, o := range append(append([]tlOp(nil), t.ops...), t.stalls...) {
			fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%d\n", o.kind, o.bucket, at(o.start), at(o.end), o.n)
		}
	})
}

func writeTSV(path, header string, rows func(*bufio.Writer)) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	fmt.Fprintln(w, header)
	rows(w)
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
