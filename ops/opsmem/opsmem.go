// Package opsmem is an outbox held in memory that implements the operator
// API (ops.Operator): pending messages, dead letters, bucket leases and
// relay heartbeats, with the semantics of the GORM store's tables. It
// backs the tests of the operator front ends (opshttp, opsui) next to the
// GORM store, and shows what an implementation of ops.Operator keeps.
// It is not a relay.Store: it holds what a store's tables hold, for
// reading and repair.
package opsmem

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/relay"
)

// Store is an in-memory outbox. The zero value is not usable; call New.
// Every method is safe for concurrent use.
type Store struct {
	mu         sync.Mutex
	buckets    int
	liveWindow time.Duration
	nextID     int64
	pending    []relay.Message  // by id
	dead       []ops.DeadLetter // full, with values and headers
	leases     map[int]*lease   // rows of the buckets a relay or a repair touched
	relays     map[string]beat  // heartbeats by relay id
}

type lease struct {
	owner   string
	term    int64
	expires time.Time
	paused  bool
}

type beat struct{ lastSeen, startedAt time.Time }

var _ ops.Operator = (*Store)(nil)

// New returns an empty outbox of buckets buckets (at least 1). A relay
// counts as live while its heartbeat is younger than
// relay.LeaseDurationDefault.
func New(buckets int) *Store {
	return &Store{buckets: max(buckets, 1), liveWindow: relay.LeaseDurationDefault, leases: map[int]*lease{}, relays: map[string]beat{}}
}

// ms keeps a time to the millisecond, as the SQL tables store it.
func ms(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return time.UnixMilli(t.UnixMilli())
}

func (s *Store) id(given int64) int64 {
	if given > 0 {
		s.nextID = max(s.nextID, given)
		return given
	}
	s.nextID++
	return s.nextID
}

// Insert adds pending messages in order, as a writer's transaction does.
// A message without an ID gets the next one; CreatedAt defaults to now.
func (s *Store) Insert(msgs ...relay.Message) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		m.ID = s.id(m.ID)
		if m.CreatedAt.IsZero() {
			m.CreatedAt = time.Now()
		}
		m.CreatedAt = ms(m.CreatedAt)
		s.pending = append(s.pending, m)
	}
	slices.SortFunc(s.pending, func(a, b relay.Message) int { return cmp.Compare(a.ID, b.ID) })
}

// InsertDead adds dead letters as the failure policy writes them. A dead
// letter without an ID gets the next one, without a State is failed;
// DeadAt defaults to now. ValueSize, MaybeDelivered and DeliveryNote are
// derived.
func (s *Store) InsertDead(dead ...ops.DeadLetter) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range dead {
		d.ID = s.id(d.ID)
		if d.State == "" {
			d.State = ops.DeadLetterFailed
		}
		if d.DeadAt.IsZero() {
			d.DeadAt = time.Now()
		}
		d.DeadAt, d.CreatedAt = ms(d.DeadAt), ms(d.CreatedAt)
		d.ValueSize = len(d.Value)
		d.SetDelivery()
		s.dead = append(s.dead, d)
	}
}

// Pending returns the pending messages by id.
func (s *Store) Pending() []relay.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.pending)
}

// SetLease records that owner holds bucket until expires, with a new term.
func (s *Store) SetLease(bucket int, owner string, expires time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.lease(bucket)
	l.owner, l.expires = owner, ms(expires)
	l.term++
}

// Heartbeat records a relay's heartbeat.
func (s *Store) Heartbeat(relayID string, lastSeen, startedAt time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.relays[relayID] = beat{lastSeen: ms(lastSeen), startedAt: ms(startedAt)}
}

func (s *Store) lease(bucket int) *lease {
	l := s.leases[bucket]
	if l == nil {
		l = &lease{}
		s.leases[bucket] = l
	}
	return l
}

// BucketCount implements ops.Operator.
func (s *Store) BucketCount() int { return s.buckets }

func age(now, t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return max(now.Sub(t), 0).Milliseconds()
}

// Status implements ops.Operator.
func (s *Store) Status(ctx context.Context) (ops.Status, error) {
	if err := ctx.Err(); err != nil {
		return ops.Status{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	st := ops.Status{SampledAt: now, BucketCount: s.buckets, Buckets: make([]ops.BucketStatus, s.buckets)}
	for i := range st.Buckets {
		st.Buckets[i] = ops.BucketStatus{Bucket: i, Lease: ops.LeaseInfo{Bucket: i}}
	}
	for _, m := range s.pending {
		st.Pending++
		if st.Oldest.IsZero() || m.CreatedAt.Before(st.Oldest) {
			st.Oldest = m.CreatedAt
		}
		if m.Bucket >= 0 && m.Bucket < s.buckets {
			b := &st.Buckets[m.Bucket]
			b.Pending++
			if b.Oldest.IsZero() || m.CreatedAt.Before(b.Oldest) {
				b.Oldest = m.CreatedAt
			}
		}
	}
	st.OldestAgeMs = age(now, st.Oldest)
	for i := range st.Buckets {
		st.Buckets[i].OldestAgeMs = age(now, st.Buckets[i].Oldest)
	}
	for _, d := range s.dead {
		st.DeadLetters.Add(d.State, 1)
		if d.Bucket >= 0 && d.Bucket < s.buckets {
			st.Buckets[d.Bucket].DeadLetters.Add(d.State, 1)
		}
	}
	held := map[string]int{}
	for b, l := range s.leases {
		info := ops.LeaseInfo{Bucket: b, Owner: l.owner, Term: l.term, Paused: l.paused}
		if l.owner != "" {
			info.ExpiresAt = l.expires
			info.Held = l.expires.After(now)
		}
		if info.Held {
			held[l.owner]++
		}
		if b >= 0 && b < s.buckets {
			st.Buckets[b].Lease = info
		}
	}
	for id, r := range s.relays {
		info := ops.RelayInfo{ID: id, LastSeen: r.lastSeen, StartedAt: r.startedAt, Live: now.Sub(r.lastSeen) < s.liveWindow, Buckets: held[id]}
		st.Relays = append(st.Relays, info)
		if info.Live {
			st.LiveRelays++
		}
	}
	slices.SortFunc(st.Relays, func(a, b ops.RelayInfo) int { return cmp.Compare(a.ID, b.ID) })
	return st, nil
}

// OldestPending implements ops.Operator: the oldest of the buckets'
// heads.
func (s *Store) OldestPending(ctx context.Context) (time.Duration, int, bool, error) {
	if err := ctx.Err(); err != nil {
		return 0, 0, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[int]bool{}
	var oldest time.Time
	bucket, ok := 0, false
	for _, m := range s.pending { // by id: the first of a bucket is its head
		if seen[m.Bucket] {
			continue
		}
		seen[m.Bucket] = true
		if !ok || m.CreatedAt.Before(oldest) {
			oldest, bucket, ok = m.CreatedAt, m.Bucket, true
		}
	}
	if !ok {
		return 0, 0, false, nil
	}
	return max(time.Since(oldest), 0), bucket, true, nil
}

func matches(q ops.DeadLetterQuery, d ops.DeadLetter) bool {
	switch {
	case q.Topic != "" && d.Topic != q.Topic,
		q.Key != nil && (d.Key == nil || !bytes.Equal(d.Key, q.Key)),
		q.Keyless && d.Key != nil,
		q.State != "" && d.State != q.State,
		q.Bucket != nil && d.Bucket != *q.Bucket,
		!q.Since.IsZero() && d.DeadAt.UnixMilli() < q.Since.UnixMilli(),
		!q.Until.IsZero() && d.DeadAt.UnixMilli() >= q.Until.UnixMilli():
		return false
	}
	return true
}

// listed is d as a listing shows it: without value and headers.
func listed(d ops.DeadLetter) ops.DeadLetter {
	d.Value, d.Headers = nil, nil
	return d
}

// DeadLetters implements ops.Operator.
func (s *Store) DeadLetters(ctx context.Context, q ops.DeadLetterQuery) (ops.DeadLetterPage, error) {
	limit, after, err := q.Check()
	if err != nil {
		return ops.DeadLetterPage{}, err
	}
	if err := ctx.Err(); err != nil {
		return ops.DeadLetterPage{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var items []ops.DeadLetter
	for _, d := range s.dead {
		at := d.DeadAt.UnixMilli()
		if matches(q, d) && (after == nil || at < after.DeadAtMs || (at == after.DeadAtMs && d.ID < after.ID)) {
			items = append(items, listed(d))
		}
	}
	slices.SortFunc(items, func(a, b ops.DeadLetter) int {
		return cmp.Or(b.DeadAt.Compare(a.DeadAt), cmp.Compare(b.ID, a.ID))
	})
	page := ops.DeadLetterPage{Items: items}
	if len(items) > limit {
		page.Items = items[:limit]
		page.Next = ops.CursorAfter(page.Items[limit-1])
	}
	return page, nil
}

// DeadLetter implements ops.Operator.
func (s *Store) DeadLetter(ctx context.Context, id int64) (ops.DeadLetter, error) {
	if err := ctx.Err(); err != nil {
		return ops.DeadLetter{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.dead {
		if d.ID == id {
			d.Headers = slices.Clone(d.Headers)
			return d, nil
		}
	}
	return ops.DeadLetter{}, fmt.Errorf("%w: dead letter %d", ops.ErrNotFound, id)
}

// CountDeadLetters implements ops.Operator.
func (s *Store) CountDeadLetters(ctx context.Context) (ops.DeadLetterCounts, error) {
	if err := ctx.Err(); err != nil {
		return ops.DeadLetterCounts{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var c ops.DeadLetterCounts
	for _, d := range s.dead {
		c.Add(d.State, 1)
	}
	return c, nil
}

// group is one unit of requeue, as the GORM store's: every dead letter of
// one key in one bucket, or some keyless dead letters of one bucket.
type group struct {
	bucket  int
	key     []byte
	keyless []int64
}

// RequeueIDs implements ops.Operator.
func (s *Store) RequeueIDs(ctx context.Context, ids ...int64) (ops.RequeueResult, error) {
	if err := ctx.Err(); err != nil {
		return ops.RequeueResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var res ops.RequeueResult
	var groups []group
	keyless := map[int][]int64{}
	for _, id := range ids {
		i := slices.IndexFunc(s.dead, func(d ops.DeadLetter) bool { return d.ID == id })
		if i < 0 {
			if !slices.Contains(res.NotFound, id) {
				res.NotFound = append(res.NotFound, id)
			}
			continue
		}
		d := s.dead[i]
		if d.Key == nil {
			if !slices.Contains(keyless[d.Bucket], id) {
				keyless[d.Bucket] = append(keyless[d.Bucket], id)
			}
			continue
		}
		if !slices.ContainsFunc(groups, func(g group) bool { return g.bucket == d.Bucket && bytes.Equal(g.key, d.Key) }) {
			groups = append(groups, group{bucket: d.Bucket, key: d.Key})
		}
	}
	for _, b := range sortedKeys(keyless) {
		groups = append(groups, group{bucket: b, keyless: keyless[b]})
	}
	s.requeue(groups, &res)
	return res, nil
}

func sortedKeys[V any](m map[int]V) []int {
	var ks []int
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// RequeueKey implements ops.Operator.
func (s *Store) RequeueKey(ctx context.Context, key []byte) (ops.RequeueResult, error) {
	if key == nil {
		return ops.RequeueResult{}, fmt.Errorf("%w: a key is required (keyless dead letters are requeued by id or all at once)", ops.ErrInvalidRequest)
	}
	if err := ctx.Err(); err != nil {
		return ops.RequeueResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	buckets := map[int]bool{}
	for _, d := range s.dead {
		if d.Key != nil && bytes.Equal(d.Key, key) {
			buckets[d.Bucket] = true
		}
	}
	var res ops.RequeueResult
	var groups []group
	for _, b := range sortedKeys(buckets) {
		groups = append(groups, group{bucket: b, key: key})
	}
	s.requeue(groups, &res)
	return res, nil
}

// RequeueAll implements ops.Operator.
func (s *Store) RequeueAll(ctx context.Context, topic string) (ops.RequeueResult, error) {
	if err := ctx.Err(); err != nil {
		return ops.RequeueResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var groups []group
	keyless := map[int][]int64{}
	for _, d := range s.dead {
		if topic != "" && d.Topic != topic {
			continue
		}
		if d.Key == nil {
			keyless[d.Bucket] = append(keyless[d.Bucket], d.ID)
		} else if !slices.ContainsFunc(groups, func(g group) bool { return g.bucket == d.Bucket && bytes.Equal(g.key, d.Key) }) {
			groups = append(groups, group{bucket: d.Bucket, key: d.Key})
		}
	}
	slices.SortFunc(groups, func(x, y group) int { return cmp.Or(cmp.Compare(x.bucket, y.bucket), bytes.Compare(x.key, y.key)) })
	for _, b := range sortedKeys(keyless) {
		groups = append(groups, group{bucket: b, keyless: keyless[b]})
	}
	var res ops.RequeueResult
	s.requeue(groups, &res)
	return res, nil
}

// requeue moves each group's dead letters, and for a key its pending
// messages, back to the backlog in original id order under new ids, and
// advances the bucket's lease term, as the GORM store does. s.mu is held.
func (s *Store) requeue(groups []group, res *ops.RequeueResult) {
	for _, g := range groups {
		var back []ops.DeadLetter
		s.dead = slices.DeleteFunc(s.dead, func(d ops.DeadLetter) bool {
			take := d.Bucket == g.bucket && ((g.key != nil && d.Key != nil && bytes.Equal(d.Key, g.key)) ||
				(g.key == nil && d.Key == nil && slices.Contains(g.keyless, d.ID)))
			if take {
				back = append(back, d)
			}
			return take
		})
		if len(back) == 0 {
			continue
		}
		s.lease(g.bucket).term++
		var moved []relay.Message
		if g.key != nil {
			s.pending = slices.DeleteFunc(s.pending, func(m relay.Message) bool {
				take := m.Bucket == g.bucket && m.Key != nil && bytes.Equal(m.Key, g.key)
				if take {
					moved = append(moved, m)
				}
				return take
			})
		}
		all := moved
		for _, d := range back {
			all = append(all, relay.Message{ID: d.ID, MessageID: d.MessageID, Bucket: d.Bucket, Topic: d.Topic, Key: d.Key,
				Value: d.Value, Headers: d.Headers, Partition: d.Partition, CreatedAt: d.CreatedAt})
		}
		slices.SortStableFunc(all, func(a, b relay.Message) int { return cmp.Compare(a.ID, b.ID) })
		for _, m := range all {
			m.ID, m.Attempts = s.id(0), 0
			s.pending = append(s.pending, m)
		}
		res.AddGroup(g.bucket, int64(len(back)), int64(len(moved)))
	}
}

// DiscardDeadLetters implements ops.Operator.
func (s *Store) DiscardDeadLetters(ctx context.Context, ids ...int64) (int64, error) {
	return s.deleteDead(ctx, func(d ops.DeadLetter) bool { return slices.Contains(ids, d.ID) })
}

// PurgeDeadLetters implements ops.Operator.
func (s *Store) PurgeDeadLetters(ctx context.Context, olderThan time.Time) (int64, error) {
	if olderThan.IsZero() {
		return 0, fmt.Errorf("%w: a time is required", ops.ErrInvalidRequest)
	}
	return s.deleteDead(ctx, func(d ops.DeadLetter) bool { return d.DeadAt.UnixMilli() < olderThan.UnixMilli() })
}

// deleteDead deletes the matching dead letters and advances the term of
// every bucket it deleted in.
func (s *Store) deleteDead(ctx context.Context, match func(ops.DeadLetter) bool) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	buckets := map[int]bool{}
	s.dead = slices.DeleteFunc(s.dead, func(d ops.DeadLetter) bool {
		if match(d) {
			n++
			buckets[d.Bucket] = true
			return true
		}
		return false
	})
	for b := range buckets {
		s.lease(b).term++
	}
	return n, nil
}

// PauseBucket implements ops.Operator.
func (s *Store) PauseBucket(ctx context.Context, bucket int) error {
	return s.setPaused(ctx, bucket, true)
}

// ResumeBucket implements ops.Operator.
func (s *Store) ResumeBucket(ctx context.Context, bucket int) error {
	return s.setPaused(ctx, bucket, false)
}

func (s *Store) setPaused(ctx context.Context, bucket int, paused bool) error {
	if bucket < 0 || bucket >= s.buckets {
		return fmt.Errorf("%w: bucket %d outside 0..%d", ops.ErrInvalidRequest, bucket, s.buckets-1)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lease(bucket).paused = paused
	return nil
}

// DeletePending deletes the pending messages match selects, as a relay
// deletes what it published, and returns how many.
func (s *Store) DeletePending(match func(relay.Message) bool) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.pending)
	s.pending = slices.DeleteFunc(s.pending, match)
	return n - len(s.pending)
}
