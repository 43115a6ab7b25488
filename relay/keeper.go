package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// errReleased is the cause of a held lease's context when the relay gave
// the bucket up (fair share, pause, stop).
var errReleased = errors.New("relay: lease released")

// heldLease is one lease the relay holds. Its context ends when the lease
// is lost (a renewal, delete or the sink said so), when the local trust
// window ends without a renewal, or when the relay releases the bucket;
// its cause says which. A drainer publishes the bucket under this context
// only.
type heldLease struct {
	Lease
	ctx    context.Context
	cancel context.CancelCauseFunc
	// announced: a LeaseAware publisher was told of the lease (always
	// true without one). Drainers take only announced leases. Under
	// keeper.mu.
	announced bool
}

// keeper is the lease keeper: the only writer of the relay's lease state.
// It adopts the result of every acquisition and renewal, extends the
// trust deadline (on the monotonic clock, never backwards), drops lost
// leases and ends their contexts, and expires every lease when the trust
// window passes without a renewal. The engine's control loop calls
// acquire while drainers publish (the scheduler starts no new batch
// meanwhile, and the store keeps the leases of the buckets in flight); the
// renewal goroutine calls renew at any time, concurrently with drainers.
//
// The keeper calls nothing back: it reports what changed as lease events
// (leaseEvents), collected until the control loop takes them and
// signalled on a one-slot channel (changes), like a leadership elector's
// subscription. Its only outward calls are to the store and the Observer.
type keeper struct {
	cfg   Config
	log   *slog.Logger
	store Store
	// announce: a LeaseAware publisher must be told of a lease before a
	// drainer takes it.
	announce bool
	base     context.Context // parent of every lease context

	changed chan struct{} // one slot: events wait in pending

	mu      sync.Mutex
	held    map[int]*heldLease
	pending leaseEvents // reported, not yet taken
	// dropped are leases the relay stopped trusting on local evidence (its
	// trust window ended, a publish under them failed as lost) that the
	// store may still record as this relay's: released at stop with the
	// held ones, so peers need not wait for their expiry. The store's
	// owner + term guard makes releasing one a peer has since taken a
	// no-op. A bucket leaves the map when the relay holds it again.
	dropped      map[int]int64
	trustedUntil time.Time   // local monotonic deadline for trusting leases
	renewedAt    time.Time   // start of the last successful acquisition or renewal
	renewTriedAt time.Time   // start of the last attempt
	trustTimer   *time.Timer // expires the leases at trustedUntil
	waitingFor   string      // the Acquired.Waiting last logged, to log a change once
}

// leaseEvents are the lease changes the keeper reports, accumulated until
// taken.
type leaseEvents struct {
	ended    []int // buckets whose lease ended: forget their state unless held again
	gained   []int // buckets newly held: start them without backoff
	acquire  bool  // a lease was lost: run the full acquisition soon
	discover bool  // leases were gained or announced: look for their pending rows
	fatal    error // a misconfiguration the renewal met: the relay stops
}

func newKeeper(ctx context.Context, cfg Config, store Store, announce bool) *keeper {
	k := &keeper{cfg: cfg, log: cfg.Logger, store: store, announce: announce, base: ctx,
		changed: make(chan struct{}, 1), held: map[int]*heldLease{}, dropped: map[int]int64{}}
	k.trustTimer = time.AfterFunc(time.Hour, k.expireTrust)
	k.trustTimer.Stop()
	return k
}

// changes is signalled when lease events wait to be taken.
func (k *keeper) changes() <-chan struct{} { return k.changed }

// take returns the lease events reported since the last take.
func (k *keeper) take() leaseEvents {
	k.mu.Lock()
	defer k.mu.Unlock()
	ev := k.pending
	k.pending = leaseEvents{}
	return ev
}

// reportLocked adds to the pending events and signals them. k.mu must be
// held.
func (k *keeper) reportLocked(ev leaseEvents) {
	p := &k.pending
	p.ended = append(p.ended, ev.ended...)
	p.gained = append(p.gained, ev.gained...)
	p.acquire = p.acquire || ev.acquire
	p.discover = p.discover || ev.discover
	if p.fatal == nil {
		p.fatal = ev.fatal
	}
	select {
	case k.changed <- struct{}{}:
	default:
	}
}

// close stops the trust timer.
func (k *keeper) close() { k.trustTimer.Stop() }

// extendTrust moves the trust deadline to start + trustWindow if that is
// later, and re-arms the expiry timer. k.mu must be held.
func (k *keeper) extendTrust(start time.Time) {
	until := start.Add(k.cfg.trustWindow())
	if until.After(k.trustedUntil) {
		k.trustedUntil = until
	}
	if start.After(k.renewedAt) {
		k.renewedAt = start
	}
	k.trustTimer.Reset(time.Until(k.trustedUntil))
}

// acquire runs the store's lease maintenance and adopts its result. busy
// are the buckets whose batch is in flight: the store keeps their leases,
// so a lease it releases above the fair share is released between batches
// of that bucket.
func (k *keeper) acquire(ctx context.Context, busy []int) error {
	start := time.Now()
	k.mu.Lock()
	k.renewTriedAt = start
	k.mu.Unlock()
	res, err := k.store.AcquireLeases(ctx, AcquireRequest{
		RelayID:       k.cfg.RelayID,
		BucketCount:   k.cfg.BucketCount,
		LeaseDuration: k.cfg.LeaseDuration,
		Busy:          busy,
		Parallelism:   k.cfg.Parallelism,
	})
	if err != nil {
		return err
	}
	next := make(map[int]int64, len(res.Leases))
	for _, l := range res.Leases {
		if l.Bucket < 0 || l.Bucket >= k.cfg.BucketCount {
			k.log.Error("relay: store returned a lease outside the bucket range; ignoring it", "bucket", l.Bucket)
			continue
		}
		next[l.Bucket] = l.Term
	}
	// A held bucket the acquisition did not return was given up (fair
	// share, pause) or lost; its renewal there may have met a term an
	// operator advanced meanwhile: ask the store.
	k.mu.Lock()
	var gone []Lease
	for b, hl := range k.held {
		if _, ok := next[b]; !ok {
			gone = append(gone, hl.Lease)
		}
	}
	k.mu.Unlock()
	revokedGone := k.revoked(ctx, gone, nil)
	var gained, released, revoked []int
	k.mu.Lock()
	for b, hl := range k.held {
		t, ok := next[b]
		switch {
		case ok && t == hl.Term:
			continue
		case ok && t > hl.Term:
			// The store kept the bucket for this relay under a later term
			// than the one it trusted: the term was advanced under it (an
			// operator's requeue, purge or discard), not taken over.
			hl.cancel(fmt.Errorf("%w: %w: bucket %d term %d, now %d", ErrLeaseLost, ErrLeaseRevoked, b, hl.Term, t))
			revoked = append(revoked, b)
		case !ok && revokedGone[b]:
			hl.cancel(fmt.Errorf("%w: %w: bucket %d term %d (found at acquisition)", ErrLeaseLost, ErrLeaseRevoked, b, hl.Term))
			revoked = append(revoked, b)
		default:
			hl.cancel(errReleased)
		}
		delete(k.held, b)
		if !ok {
			released = append(released, b)
		}
	}
	for b, t := range next {
		delete(k.dropped, b)
		if _, ok := k.held[b]; ok {
			continue
		}
		lctx, cancel := context.WithCancelCause(k.base)
		k.held[b] = &heldLease{Lease: Lease{Bucket: b, Term: t}, ctx: lctx, cancel: cancel,
			announced: !k.announce}
		gained = append(gained, b)
	}
	k.extendTrust(start)
	slices.Sort(gained)
	slices.Sort(released)
	k.reportLocked(leaseEvents{ended: released, gained: gained, discover: len(gained) > 0})
	k.mu.Unlock()

	if len(gained) > 0 || len(released) > 0 {
		attrs := []any{"owned", len(next), "acquired", gained, "released", released,
			"live_relays", res.LiveRelays, "fair_share", res.FairShare}
		if len(released) > 0 {
			attrs = append(attrs, "released_why", releaseReasons(released, res.Paused, res.AboveShare, revoked))
		}
		k.log.Info("relay: leases changed", attrs...)
	}
	if len(revoked) > 0 {
		slices.Sort(revoked)
		k.log.Info(msgRevoked, "buckets", revoked, "found_at", "acquisition")
	}
	k.logWaiting(res.Waiting)
	k.observe(len(gained), 0)
	k.observeRevoked(len(revoked))
	return nil
}

// msgRevoked is the line of leases an operator revoked.
const msgRevoked = "relay: leases revoked by an operator (a requeue, purge or discard of the bucket's dead letters advanced the lease term); the relay publishes them under the new term"

// renew extends the held leases through lr. It runs
// concurrently with drainers; a lease it finds lost has its context ended,
// which cancels a publish in flight for it.
func (k *keeper) renew(ctx context.Context, lr LeaseRenewer) error {
	k.mu.Lock()
	held, until := k.leasesLocked(), k.trustedUntil
	start := time.Now()
	k.renewTriedAt = start
	k.mu.Unlock()
	if len(held) == 0 {
		return nil
	}
	// A renewal that completes after the trust window is of no use.
	rctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	still, err := lr.RenewLeases(rctx, k.cfg.RelayID, held, k.cfg.LeaseDuration)
	if err != nil {
		return fmt.Errorf("relay: renew leases: %w", err)
	}
	kept := make(map[Lease]bool, len(still))
	for _, l := range still {
		kept[l] = true
	}
	revoked := k.revoked(ctx, held, kept)
	var lost, lostRevoked []int
	k.mu.Lock()
	for _, l := range held {
		if kept[l] {
			continue
		}
		if hl, ok := k.held[l.Bucket]; ok && hl.Term == l.Term {
			if revoked[l.Bucket] {
				hl.cancel(fmt.Errorf("%w: %w: bucket %d (found at renewal)", ErrLeaseLost, ErrLeaseRevoked, l.Bucket))
				lostRevoked = append(lostRevoked, l.Bucket)
			} else {
				hl.cancel(fmt.Errorf("%w: bucket %d taken over (found at renewal)", ErrLeaseLost, l.Bucket))
				lost = append(lost, l.Bucket)
			}
			delete(k.held, l.Bucket)
		}
	}
	k.extendTrust(start)
	if ended := append(slices.Clone(lost), lostRevoked...); len(ended) > 0 {
		k.reportLocked(leaseEvents{ended: ended, acquire: true})
	}
	k.mu.Unlock()
	if len(lost) > 0 {
		k.log.Warn("relay: leases lost at renewal", "buckets", lost)
	}
	if len(lostRevoked) > 0 {
		k.log.Info(msgRevoked, "buckets", lostRevoked, "found_at", "renewal")
	}
	k.observe(0, len(lost))
	k.observeRevoked(len(lostRevoked))
	return nil
}

// revoked returns the buckets of the leases of held missing from kept
// that the store reports revoked by an operator (RevocationChecker); none
// when the store cannot tell or its check fails (logged).
func (k *keeper) revoked(ctx context.Context, held []Lease, kept map[Lease]bool) map[int]bool {
	rc, ok := k.store.(RevocationChecker)
	if !ok {
		return nil
	}
	var missing []Lease
	for _, l := range held {
		if !kept[l] {
			missing = append(missing, l)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	found, err := rc.RevokedLeases(ctx, k.cfg.RelayID, missing)
	if err != nil {
		k.log.Warn("relay: could not tell whether lost leases were revoked by an operator; counting them as lost", "err", err)
		return nil
	}
	out := make(map[int]bool, len(found))
	for _, l := range found {
		out[l.Bucket] = true
	}
	return out
}

// observeRevoked reports n leases an operator revoked to a
// RevocationObserver.
func (k *keeper) observeRevoked(n int) {
	if n == 0 {
		return
	}
	if o, ok := k.cfg.Observer.(RevocationObserver); ok {
		o.LeasesRevoked(n)
	}
	k.cfg.Observer.OwnedBuckets(k.ownedCount())
}

// renewLoop renews the leases whenever the renewal is due and no
// acquisition did it: while the acquisition waits for a slow publish to
// finish, or the control loop is busy. It runs only with a LeaseRenewer.
func (k *keeper) renewLoop(ctx context.Context, lr LeaseRenewer) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var retryAt time.Time
	for {
		k.mu.Lock()
		due := later(k.renewedAt.Add(k.cfg.LeaseRenewInterval), k.renewTriedAt.Add(k.cfg.LeaseRenewInterval/4))
		has := len(k.held) > 0
		k.mu.Unlock()
		due = later(due, retryAt)
		wait := time.Until(due)
		if !has {
			wait = k.cfg.LeaseRenewInterval / 4
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !has || time.Now().Before(due) {
			continue
		}
		err := k.renew(ctx, lr)
		if ctx.Err() != nil {
			return
		}
		retryAt = time.Time{}
		if err != nil {
			if IsMisconfiguration(err) {
				k.mu.Lock()
				k.reportLocked(leaseEvents{fatal: err})
				k.mu.Unlock()
				return
			}
			k.log.Warn("relay: renew leases failed", "err", err)
			retryAt = time.Now().Add(k.cfg.LeaseRenewInterval / 4)
		}
	}
}

// expireTrust drops every lease once the trust window has ended without
// a renewal. It runs on the trust timer and from the control loop.
func (k *keeper) expireTrust() {
	k.mu.Lock()
	expired := len(k.held) > 0 && !time.Now().Before(k.trustedUntil)
	var dropped []int
	if expired {
		for b, hl := range k.held {
			hl.cancel(fmt.Errorf("%w: bucket %d: local lease deadline passed without a renewal", ErrLeaseLost, b))
			k.dropped[b] = hl.Term
			dropped = append(dropped, b)
		}
		k.held = map[int]*heldLease{}
		slices.Sort(dropped)
		k.reportLocked(leaseEvents{ended: dropped, acquire: true})
	}
	k.mu.Unlock()
	if !expired {
		return
	}
	k.log.Warn("relay: lease deadline passed without a successful renewal; stopped publishing until leases are acquired again", "buckets", len(dropped))
	k.observe(0, len(dropped))
}

// drop forgets a lease a drainer found lost (a refused delete, a fenced
// publish, a renewal or trust expiry during its publish).
func (k *keeper) drop(l Lease, cause error) {
	k.mu.Lock()
	hl, held := k.held[l.Bucket]
	newer := held && hl.Term != l.Term
	held = held && hl.Term == l.Term
	if held {
		hl.cancel(cause)
		delete(k.held, l.Bucket)
		k.dropped[l.Bucket] = l.Term
	}
	// Acquired again under a new term while the lost batch was in
	// flight (newer): the scheduler forgot the bucket with that batch, so
	// its rows are looked for again.
	k.reportLocked(leaseEvents{acquire: true, discover: newer})
	k.mu.Unlock()
	switch {
	case !held:
	case errors.Is(cause, ErrLeaseRevoked):
		k.log.Info(msgRevoked, "buckets", []int{l.Bucket}, "found_at", "guarded write")
		k.observeRevoked(1)
	default:
		k.observe(0, 1)
	}
}

// releaseAll takes every lease out of the keeper, ending their contexts,
// and returns them for the store's release, with the dropped ones.
func (k *keeper) releaseAll() []Lease {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := k.leasesLocked()
	for _, hl := range k.held {
		hl.cancel(errReleased)
	}
	for b, t := range k.dropped {
		out = append(out, Lease{Bucket: b, Term: t})
	}
	slices.SortFunc(out, func(a, b Lease) int { return a.Bucket - b.Bucket })
	k.held, k.dropped = map[int]*heldLease{}, map[int]int64{}
	return out
}

// lease returns the held lease of bucket b if the relay still trusts it
// and it was announced to a LeaseAware publisher.
func (k *keeper) lease(b int) (*heldLease, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	hl, ok := k.held[b]
	if !ok || !hl.announced || !time.Now().Before(k.trustedUntil) || hl.ctx.Err() != nil {
		return nil, false
	}
	return hl, true
}

// announced marks leases as told to the LeaseAware publisher, so drainers
// may take them, and has their buckets looked at for pending rows.
func (k *keeper) announced(hls []*heldLease) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, hl := range hls {
		hl.announced = true
	}
	if len(hls) > 0 {
		k.reportLocked(leaseEvents{discover: true})
	}
}

// trustedHeld returns the held leases while the trust window lasts, by
// bucket.
func (k *keeper) trustedHeld() []*heldLease {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !time.Now().Before(k.trustedUntil) {
		return nil
	}
	out := make([]*heldLease, 0, len(k.held))
	for _, hl := range k.held {
		out = append(out, hl)
	}
	slices.SortFunc(out, func(a, b *heldLease) int { return a.Bucket - b.Bucket })
	return out
}

// trusts reports whether l is held under its term and trusted.
func (k *keeper) trusts(l Lease) bool {
	hl, ok := k.lease(l.Bucket)
	return ok && hl.Term == l.Term
}

func (k *keeper) leasesLocked() []Lease {
	out := make([]Lease, 0, len(k.held))
	for _, hl := range k.held {
		out = append(out, hl.Lease)
	}
	slices.SortFunc(out, func(a, b Lease) int { return a.Bucket - b.Bucket })
	return out
}

// leases returns every held lease, trusted or not, by bucket.
func (k *keeper) leases() []Lease {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.leasesLocked()
}

// trustedLeases returns the held leases while the trust window lasts, by
// bucket.
func (k *keeper) trustedLeases() []Lease {
	held := k.trustedHeld()
	out := make([]Lease, len(held))
	for i, hl := range held {
		out[i] = hl.Lease
	}
	return out
}

func (k *keeper) ownedCount() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !time.Now().Before(k.trustedUntil) {
		return 0
	}
	return len(k.held)
}

func (k *keeper) trustDeadline() time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.trustedUntil
}

// holds reports whether the relay holds bucket b, trusted or not.
func (k *keeper) holds(b int) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.held[b]
	return ok
}

// observe reports n leases gained and m lost without a release, and the
// size of the trusted lease set, to the Observer.
func (k *keeper) observe(gained, lost int) {
	if gained > 0 {
		k.cfg.Observer.LeasesAcquired(gained)
	}
	if lost > 0 {
		k.cfg.Observer.LeasesExpired(lost)
	}
	k.cfg.Observer.OwnedBuckets(k.ownedCount())
}

// logWaiting says, once per change, which buckets the relay waits for and
// until when: after an unclean exit the restarted relay (a new relay id)
// cannot take its predecessor's buckets before their leases expire.
func (k *keeper) logWaiting(waiting []HeldLease) {
	byOwner := map[string][]HeldLease{}
	var owners []string
	for _, h := range waiting {
		if byOwner[h.Owner] == nil {
			owners = append(owners, h.Owner)
		}
		byOwner[h.Owner] = append(byOwner[h.Owner], h)
	}
	slices.Sort(owners)
	key := ""
	for _, o := range owners {
		key += fmt.Sprint(o, bucketsOf(byOwner[o]), ";")
	}
	if key == k.waitingFor {
		return
	}
	k.waitingFor = key
	for _, o := range owners {
		until := byOwner[o][0].ExpiresAt
		for _, h := range byOwner[o][1:] {
			if h.ExpiresAt.After(until) {
				until = h.ExpiresAt
			}
		}
		k.log.Info("relay: waiting for buckets another relay holds beyond its fair share; "+
			"it releases them at its next renewal, or, if it exited without releasing them, they are taken over when its leases expire",
			"owner", o, "buckets", bucketsOf(byOwner[o]), "until", until)
	}
}

func bucketsOf(hs []HeldLease) []int {
	bs := make([]int, len(hs))
	for i, h := range hs {
		bs[i] = h.Bucket
	}
	slices.Sort(bs)
	return bs
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// releaseReasons says why each released bucket was given up, for the
// log: paused by an operator, above the fair share, its term advanced by an
// operator (revoked), or lost (its lease expired before the renewal, or
// the store did not say).
func releaseReasons(released, paused, aboveShare, revoked []int) string {
	var p, a, r, lost []string
	for _, b := range released {
		switch s := strconv.Itoa(b); {
		case slices.Contains(revoked, b):
			r = append(r, s)
		case slices.Contains(paused, b):
			p = append(p, s)
		case slices.Contains(aboveShare, b):
			a = append(a, s)
		default:
			lost = append(lost, s)
		}
	}
	var parts []string
	if len(p) > 0 {
		parts = append(parts, strings.Join(p, ",")+" paused by an operator")
	}
	if len(a) > 0 {
		parts = append(parts, strings.Join(a, ",")+" above the fair share")
	}
	if len(r) > 0 {
		parts = append(parts, strings.Join(r, ",")+" revoked by an operator")
	}
	if len(lost) > 0 {
		parts = append(parts, strings.Join(lost, ",")+" lost (the lease expired before its renewal)")
	}
	return strings.Join(parts, "; ")
}
