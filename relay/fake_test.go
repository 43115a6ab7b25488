package relay_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox/relay"
)

// fakeStore is an in-memory relay.Store with the same lease semantics as
// the SQL store: owner + term + expiry guards, fair share, heartbeats. It
// reads the (possibly synctest-faked) wall clock.
type fakeStore struct {
	mu      sync.Mutex
	buckets int
	leases  []fakeLease
	relays  map[string]time.Time
	msgs    map[int][]relay.Message
	nextID  int64
	calls   map[string]int
	batches []int // bucket of every NextBatch call
	// probes is the buckets of every PendingBuckets call.
	probes [][]int
	// acquireBusy is, for every AcquireLeases call, how many of the
	// relay's held buckets it named busy.
	acquireBusy []int

	// allowed, if set, limits the buckets a relay may claim.
	allowed func(relayID string, bucket int) bool
	// fail, if set, makes an operation fail with the returned error.
	fail func(op string) error
	// renew, if set, replaces RenewLeases' result.
	renew func(held []relay.Lease) []relay.Lease
	// lostReply, if set, makes AcquireLeases apply its changes and then
	// fail with the returned error, as when a claim statement commits but
	// its caller gave up waiting for the reply.
	lostReply func() error
}

type fakeLease struct {
	owner   string
	term    int64
	expires time.Time
}

func newFakeStore(buckets int) *fakeStore {
	return &fakeStore{
		buckets: buckets,
		leases:  make([]fakeLease, buckets),
		relays:  map[string]time.Time{},
		msgs:    map[int][]relay.Message{},
		calls:   map[string]int{},
	}
}

// add appends messages to bucket with fresh ids; values are "bucket/seq".
func (s *fakeStore) add(bucket, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for range n {
		s.nextID++
		s.msgs[bucket] = append(s.msgs[bucket], relay.Message{
			ID:        s.nextID,
			MessageID: fmt.Sprintf("m%d", s.nextID),
			Bucket:    bucket,
			Topic:     "t",
			Value:     fmt.Appendf(nil, "%d/%d", bucket, len(s.msgs[bucket])),
		})
	}
}

func (s *fakeStore) pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ms := range s.msgs {
		n += len(ms)
	}
	return n
}

func (s *fakeStore) count(op string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[op]
}

func (s *fakeStore) owner(b int) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !time.Now().Before(s.leases[b].expires) {
		return ""
	}
	return s.leases[b].owner
}

// failLeases makes every acquisition and renewal fail with err, as when
// the database stops answering; nil ends that.
func (s *fakeStore) failLeases(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		s.fail = nil
		return
	}
	s.fail = func(op string) error {
		if op == "acquire" || op == "renew" {
			return err
		}
		return nil
	}
}

// begin counts op and returns the injected failure, with s.mu held.
func (s *fakeStore) begin(op string) error {
	s.mu.Lock()
	s.calls[op]++
	if s.fail != nil {
		return s.fail(op)
	}
	return nil
}

func (s *fakeStore) held(id string, l relay.Lease, now time.Time) bool {
	fl := s.leases[l.Bucket]
	return fl.owner == id && fl.term == l.Term && now.Before(fl.expires)
}

func (s *fakeStore) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	err := s.begin("acquire")
	defer s.mu.Unlock()
	if err != nil {
		return relay.Acquired{}, err
	}
	if err := relay.CheckBucketCount(req.BucketCount, s.buckets, "the fake store"); err != nil {
		return relay.Acquired{}, err
	}
	now := time.Now()
	s.relays[req.RelayID] = now
	live := 0
	for _, seen := range s.relays {
		if now.Sub(seen) < req.LeaseDuration {
			live++
		}
	}
	share := relay.FairShare(s.buckets, live)
	var held []relay.Lease
	busy := 0
	for b := range s.leases {
		l := &s.leases[b]
		if l.owner == req.RelayID && now.Before(l.expires) && slices.Contains(req.Busy, b) {
			l.expires = laterTime(l.expires, now.Add(req.LeaseDuration)) // never released mid-batch
			held = append(held, relay.Lease{Bucket: b, Term: l.term})
			busy++
		}
	}
	for b := range s.leases {
		l := &s.leases[b]
		if l.owner == req.RelayID && now.Before(l.expires) && !slices.Contains(req.Busy, b) {
			if len(held) < share {
				l.expires = laterTime(l.expires, now.Add(req.LeaseDuration))
				held = append(held, relay.Lease{Bucket: b, Term: l.term})
			} else {
				l.owner, l.expires = "", time.Time{}
			}
		}
	}
	s.acquireBusy = append(s.acquireBusy, busy)
	for b := range s.leases {
		l := &s.leases[b]
		if len(held) >= share {
			break
		}
		if (l.owner == "" || !now.Before(l.expires)) && (s.allowed == nil || s.allowed(req.RelayID, b)) {
			l.owner, l.term, l.expires = req.RelayID, l.term+1, now.Add(req.LeaseDuration)
			held = append(held, relay.Lease{Bucket: b, Term: l.term})
		}
	}
	slices.SortFunc(held, func(a, b relay.Lease) int { return a.Bucket - b.Bucket })
	if s.lostReply != nil {
		if err := s.lostReply(); err != nil {
			return relay.Acquired{}, err
		}
	}
	return relay.Acquired{Leases: held, LiveRelays: live, FairShare: share}, nil
}

func (s *fakeStore) ReleaseLeases(ctx context.Context, id string, leases []relay.Lease) error {
	err := s.begin("release")
	defer s.mu.Unlock()
	if err != nil {
		return err
	}
	for b := range s.leases {
		if s.leases[b].owner == id {
			s.leases[b].owner, s.leases[b].expires = "", time.Time{}
		}
	}
	delete(s.relays, id)
	return nil
}

func (s *fakeStore) PendingBuckets(ctx context.Context, buckets []int) ([]int, error) {
	err := s.begin("pending")
	defer s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	s.probes = append(s.probes, slices.Clone(buckets))
	var out []int
	for _, b := range buckets {
		if len(s.msgs[b]) > 0 {
			out = append(out, b)
		}
	}
	slices.Sort(out)
	return out, nil
}

func (s *fakeStore) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	err := s.begin("batch")
	defer s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	s.batches = append(s.batches, bucket)
	ms := s.msgs[bucket]
	return slices.Clone(ms[:min(limit, len(ms))]), nil
}

// nextBatchExcept is relay.BatchSkipper for skippingStore.
func (s *fakeStore) nextBatchExcept(ctx context.Context, bucket, limit int, except []relay.Message) ([]relay.Message, error) {
	err := s.begin("except")
	defer s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	s.batches = append(s.batches, bucket)
	out := []relay.Message{}
	for _, m := range s.msgs[bucket] {
		if len(out) == limit {
			break
		}
		if !slices.ContainsFunc(except, func(e relay.Message) bool { return e.ID == m.ID }) {
			out = append(out, m)
		}
	}
	return out, nil
}

func (s *fakeStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	err := s.begin("mark")
	defer s.mu.Unlock()
	if err != nil {
		return err
	}
	if !s.held(id, l, time.Now()) {
		return fmt.Errorf("%w: bucket %d", relay.ErrLeaseLost, l.Bucket)
	}
	s.msgs[l.Bucket] = slices.DeleteFunc(s.msgs[l.Bucket], func(m relay.Message) bool {
		return slices.ContainsFunc(msgs, func(p relay.Message) bool { return p.ID == m.ID })
	})
	return nil
}

func (s *fakeStore) RenewLeases(ctx context.Context, id string, leases []relay.Lease, d time.Duration) ([]relay.Lease, error) {
	err := s.begin("renew")
	defer s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if s.renew != nil {
		return s.renew(leases), nil
	}
	now := time.Now()
	var out []relay.Lease
	for _, l := range leases {
		if s.held(id, l, now) {
			s.leases[l.Bucket].expires = laterTime(s.leases[l.Bucket].expires, now.Add(d))
			out = append(out, l)
		}
	}
	s.relays[id] = now
	return out, nil
}

func (s *fakeStore) RecordFailure(ctx context.Context, id string, l relay.Lease, m relay.Message, cause error) error {
	err := s.begin("record")
	defer s.mu.Unlock()
	if err != nil {
		return err
	}
	if !s.held(id, l, time.Now()) {
		return relay.ErrLeaseLost
	}
	for i := range s.msgs[l.Bucket] {
		if s.msgs[l.Bucket][i].ID == m.ID {
			s.msgs[l.Bucket][i].Attempts++
		}
	}
	return nil
}

// basicStore hides the optional capabilities of a fakeStore.
type basicStore struct{ s *fakeStore }

func (b basicStore) AcquireLeases(ctx context.Context, req relay.AcquireRequest) (relay.Acquired, error) {
	return b.s.AcquireLeases(ctx, req)
}
func (b basicStore) ReleaseLeases(ctx context.Context, id string, ls []relay.Lease) error {
	return b.s.ReleaseLeases(ctx, id, ls)
}
func (b basicStore) PendingBuckets(ctx context.Context, bs []int) ([]int, error) {
	return b.s.PendingBuckets(ctx, bs)
}
func (b basicStore) NextBatch(ctx context.Context, bucket, limit int) ([]relay.Message, error) {
	return b.s.NextBatch(ctx, bucket, limit)
}
func (b basicStore) MarkPublished(ctx context.Context, id string, l relay.Lease, msgs []relay.Message) error {
	return b.s.MarkPublished(ctx, id, l, msgs)
}

// fakeHints is a relay.Hints like outbox.Notifier.
type fakeHints struct {
	mu      sync.Mutex
	buckets []int
	unknown bool
	ready   chan struct{}
}

func newFakeHints() *fakeHints { return &fakeHints{ready: make(chan struct{}, 1)} }

func (h *fakeHints) notify(buckets ...int) {
	h.mu.Lock()
	h.buckets = append(h.buckets, buckets...)
	h.mu.Unlock()
	select {
	case h.ready <- struct{}{}:
	default:
	}
}

func (h *fakeHints) Ready() <-chan struct{} { return h.ready }

func (h *fakeHints) Take(dst []int) ([]int, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	dst = append(dst, h.buckets...)
	h.buckets = h.buckets[:0]
	u := h.unknown
	h.unknown = false
	return dst, u
}

// markPublishedNext is relay.BatchAdvancer for advancingStore: the
// delete and the read of the next batch under one lock, as a database
// does them in one round trip.
func (s *fakeStore) markPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	err := s.begin("advance")
	defer s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if !s.held(id, l, time.Now()) {
		return nil, fmt.Errorf("%w: bucket %d", relay.ErrLeaseLost, l.Bucket)
	}
	s.msgs[l.Bucket] = slices.DeleteFunc(s.msgs[l.Bucket], func(m relay.Message) bool {
		return slices.ContainsFunc(msgs, func(p relay.Message) bool { return p.ID == m.ID })
	})
	ms := s.msgs[l.Bucket]
	return append([]relay.Message{}, ms[:min(limit, len(ms))]...), nil
}

// bucketCount is relay.BucketCounter for advancingStore.
func (s *fakeStore) bucketCount() int { return s.buckets }

// advancingStore is a fakeStore with every capability, BatchAdvancer and
// BucketCounter included.
type advancingStore struct{ *fakeStore }

func (a advancingStore) MarkPublishedNext(ctx context.Context, id string, l relay.Lease, msgs []relay.Message, limit int) ([]relay.Message, error) {
	return a.markPublishedNext(ctx, id, l, msgs, limit)
}

func (a advancingStore) BucketCount() int { return a.bucketCount() }

// skippingStore is advancingStore with BatchSkipper too.
type skippingStore struct{ advancingStore }

func (s skippingStore) NextBatchExcept(ctx context.Context, bucket, limit int, except []relay.Message) ([]relay.Message, error) {
	return s.nextBatchExcept(ctx, bucket, limit, except)
}

// insert appends msgs to their buckets with fresh ids, as committed.
func (s *fakeStore) insert(msgs []relay.Message) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		s.nextID++
		m.ID = s.nextID
		m.Attempts = 0
		s.msgs[m.Bucket] = append(s.msgs[m.Bucket], m)
	}
}

// laterTime returns the later of a and b: a lease's expiry only moves
// forward (relay.LeaseRenewer).
func laterTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}
