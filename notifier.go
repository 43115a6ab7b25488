package outbox

import (
	"sync"

	"github.com/gorm-outbox/outbox/internal/bucketset"
)

// Notifier tells the local relay which buckets received committed
// messages. The plugin feeds it after a successful COMMIT of the outermost
// transaction, never before, and never for a rollback.
//
// It keeps one bit per bucket, so its memory is bounded by BucketCount no
// matter how many commits happen between two reads, and it coalesces: many
// commits produce one wake-up. Notify never blocks the committing
// goroutine.
//
// Hints are advisory: the relay still polls, so a lost hint (a commit the
// plugin could not observe, a process restart) costs latency, not
// messages.
type Notifier struct {
	pending *bucketset.Hints
	ready   chan struct{}

	subMu sync.RWMutex
	subs  []func(buckets []int)
}

// NewNotifier returns a notifier for bucketCount buckets.
func NewNotifier(bucketCount int) *Notifier {
	if bucketCount < 1 {
		bucketCount = 1
	}
	return &Notifier{
		pending: bucketset.NewHints(bucketCount),
		ready:   make(chan struct{}, 1),
	}
}

// Notify records that buckets received committed messages and wakes the
// reader. A bucket outside the configured range is recorded as "unknown",
// which makes the relay run a discovery query.
func (n *Notifier) Notify(buckets []int) {
	if len(buckets) == 0 {
		return
	}
	n.record(buckets)
	n.publish(buckets)
}

// NotifyReceived records hints that arrived from another process through a
// cross-process Transport and wakes the reader, like Notify, but does not
// pass them to subscribers: a received hint is never sent on again, so
// hints cannot echo between processes. UnknownBucket (or any bucket outside
// the configured range) requests a discovery query. It does not retain
// buckets.
func (n *Notifier) NotifyReceived(buckets []int) {
	if len(buckets) == 0 {
		return
	}
	n.record(buckets)
}

// record adds buckets to the pending set and wakes the reader.
func (n *Notifier) record(buckets []int) {
	n.pending.Add(buckets)
	n.wake()
}

// NotifyUnknown records that something committed in buckets that are not
// known, so the relay must discover pending buckets itself. Subscribers
// receive it as []int{UnknownBucket}.
func (n *Notifier) NotifyUnknown() {
	n.pending.AddUnknown()
	n.wake()
	n.publish([]int{UnknownBucket})
}

func (n *Notifier) wake() {
	select {
	case n.ready <- struct{}{}:
	default:
	}
}

// Ready returns a channel that receives a value when hints are pending.
// It is buffered by one: any number of Notify calls before a read produce
// one wake-up.
func (n *Notifier) Ready() <-chan struct{} { return n.ready }

// Take appends the pending bucket ids to dst in ascending order, clears
// them, and reports whether an unknown-bucket hint was pending.
func (n *Notifier) Take(dst []int) (buckets []int, unknown bool) {
	return n.pending.Take(dst)
}

// Subscribe registers fn to be called with the bucket ids of every
// committed transaction, on the committing goroutine, after the local
// wake-up. fn must not block: a cross-process transport hands the ids to
// its own goroutine. fn must not keep or modify the slice. Hints given to
// NotifyReceived are not passed to fn. It returns a function that removes
// the subscription.
func (n *Notifier) Subscribe(fn func(buckets []int)) (cancel func()) {
	n.subMu.Lock()
	defer n.subMu.Unlock()
	n.subs = append(n.subs, fn)
	idx := len(n.subs) - 1
	return func() {
		n.subMu.Lock()
		defer n.subMu.Unlock()
		if idx < len(n.subs) {
			n.subs[idx] = nil
		}
	}
}

func (n *Notifier) publish(buckets []int) {
	n.subMu.RLock()
	defer n.subMu.RUnlock()
	for _, fn := range n.subs {
		if fn != nil {
			fn(buckets)
		}
	}
}
