package gormrelay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/gormlog"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

// AdminTimeoutDefault bounds one Admin operation (a read, or one
// transaction of a requeue or purge). A timed-out operation fails with an
// error naming it.
const AdminTimeoutDefault = 30 * time.Second

// Admin errors, the operator API's (ops.ErrNotFound,
// ops.ErrInvalidRequest). Each is returned wrapped; test with errors.Is.
var (
	ErrNotFound       = ops.ErrNotFound
	ErrInvalidRequest = ops.ErrInvalidRequest
)

// Admin is the operational API of one outbox: it reads and repairs the
// outbox tables directly and works without a running relay.
//
// Reads never lock or change anything. Repairs (requeue, purge, discard,
// pause) run in short transactions. Only dead letters are ever deleted by
// the Admin; pending messages are moved (requeue keeps a key's order),
// never deleted.
type Admin struct {
	db         *gorm.DB
	cfg        outbox.Config
	notify     func(buckets []int) // wakes local relays after a requeue; nil without a plugin
	liveWindow time.Duration
}

// NewAdmin returns the operational API for the outbox configured by cfg
// on db. It validates cfg like NewPlugin.
func NewAdmin(db *gorm.DB, cfg outbox.Config) (*Admin, error) {
	if db == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "db", Value: nil, Reason: "a *gorm.DB is required"}
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Admin{db: db.Session(&gorm.Session{NewDB: true, SkipHooks: true, Logger: gormlog.OnlyFailures(db.Logger)}), cfg: cfg, liveWindow: relay.LeaseDurationDefault}, nil
}

// PluginAdmin returns the operational API of the plugin's outbox on db. A
// requeue through it also wakes the relays of this process that wait on
// the plugin's Notifier.
func PluginAdmin(db *gorm.DB, p *outbox.Plugin) *Admin {
	return &Admin{db: db.Session(&gorm.Session{NewDB: true, SkipHooks: true, Logger: gormlog.OnlyFailures(db.Logger)}), cfg: p.Config(),
		notify: p.Notifier().Notify, liveWindow: relay.LeaseDurationDefault}
}

// WithLiveWindow returns a copy of the Admin that counts a relay as live
// while its heartbeat is younger than d. Set it to the relays'
// relay.Config.LeaseDuration. Default relay.LeaseDurationDefault (30s).
func (a *Admin) WithLiveWindow(d time.Duration) *Admin {
	c := *a
	if d > 0 {
		c.liveWindow = d
	}
	return &c
}

// Config returns the outbox configuration the Admin works on.
func (a *Admin) Config() outbox.Config { return a.cfg }

// op starts an admin operation: a context bounded by AdminTimeoutDefault,
// with a cause naming the operation.
func (a *Admin) op(ctx context.Context, name string) (*gorm.DB, context.CancelFunc) {
	ctx, cancel := context.WithTimeoutCause(ctx, AdminTimeoutDefault,
		fmt.Errorf("outbox: admin %s: timed out after %s", name, AdminTimeoutDefault))
	return a.db.WithContext(ctx), cancel
}

func (a *Admin) fail(db *gorm.DB, name string, err error) error {
	ctx := db.Statement.Context
	if ctx != nil && ctx.Err() != nil {
		if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, ctx.Err()) {
			return fmt.Errorf("%w: %w", cause, err)
		}
	}
	return fmt.Errorf("outbox: admin %s: %w", name, err)
}

func (a *Admin) quote(table string) string { return a.db.Statement.Quote(table) }

// Backlog reads what is waiting to be published: the pending count and
// the oldest pending message, in total and per bucket, and the number of
// dead letters, with the query the relay's backlog sampler runs
// (readBacklog). It is bounded by the admin timeout.
func (a *Admin) Backlog(ctx context.Context) (relay.Backlog, error) {
	db, cancel := a.op(ctx, "read backlog")
	defer cancel()
	b, err := readBacklog(db, a.cfg)
	if err != nil {
		return relay.Backlog{}, fmt.Errorf("outbox: read backlog of %s: %w", a.cfg.Tables.MessagesTable(), err)
	}
	return b, nil
}

// readBacklog reads the backlog of the outbox of cfg: one grouped query
// over the messages table (the count and oldest creation time per bucket)
// and one count of the dead-letter table. It reads the whole messages
// table: the relay runs it only every sampling interval, an operator on
// demand.
func readBacklog(db *gorm.DB, cfg outbox.Config) (relay.Backlog, error) {
	var rows []struct {
		Bucket  int
		Pending int64
		Oldest  int64
	}
	if err := db.Raw("SELECT bucket, COUNT(*) AS pending, MIN(created_at_ms) AS oldest FROM " +
		db.Statement.Quote(cfg.Tables.MessagesTable()) + " GROUP BY bucket ORDER BY bucket").Scan(&rows).Error; err != nil {
		return relay.Backlog{}, err
	}
	var dead int64
	if err := db.Raw("SELECT COUNT(*) FROM " + db.Statement.Quote(cfg.Tables.DeadLettersTable())).Scan(&dead).Error; err != nil {
		return relay.Backlog{}, err
	}
	b := relay.Backlog{BucketCount: cfg.BucketCount, DeadLetters: dead, DeadLettersKnown: true, SampledAt: time.Now()}
	for _, r := range rows {
		oldest := time.UnixMilli(r.Oldest)
		b.Buckets = append(b.Buckets, relay.BucketBacklog{Bucket: r.Bucket, Pending: r.Pending, Oldest: oldest})
		b.Pending += r.Pending
		if b.Oldest.IsZero() || oldest.Before(b.Oldest) {
			b.Oldest = oldest
		}
	}
	return b, nil
}

// retrying fills in each bucket's first message whose publish failed
// (attempts above 0), at most one row per bucket: the lowest id of each
// bucket among the failed ones.
func (a *Admin) retrying(db *gorm.DB, buckets []BucketStatus) error {
	var rows []outbox.MessageRow
	messages := a.cfg.Tables.MessagesTable()
	err := db.Table(messages).Select("id, message_id, bucket, topic, msg_key, created_at_ms, attempts, last_error").
		Where("attempts > 0 AND id IN (?)", db.Table(messages).Select("MIN(id)").Where("attempts > 0").Group("bucket")).
		Find(&rows).Error
	if err != nil {
		return a.fail(db, "read the messages being retried", err)
	}
	for _, r := range rows {
		if b := int(r.Bucket); b >= 0 && b < len(buckets) {
			m := &ops.RetryingMessage{ID: r.ID, MessageID: r.MessageID, Topic: r.Topic, Key: r.Key,
				CreatedAt: time.UnixMilli(r.CreatedAtMs), Attempts: int(r.Attempts)}
			if r.LastError != nil {
				m.LastError = *r.LastError
			}
			buckets[b].Retrying = m
		}
	}
	return nil
}

// The operator API's types, under their gormrelay names.
type (
	DeadLetterCounts = ops.DeadLetterCounts
	LeaseInfo        = ops.LeaseInfo
	RelayInfo        = ops.RelayInfo
	BucketStatus     = ops.BucketStatus
	Status           = ops.Status
	DeadLetter       = ops.DeadLetter
	DeadLetterQuery  = ops.DeadLetterQuery
	DeadLetterPage   = ops.DeadLetterPage
	RequeueResult    = ops.RequeueResult
	Snapshot         = ops.Snapshot
)

// Dead-letter page sizes (ops.DeadLetterPageDefault, ops.DeadLetterPageMax).
const (
	DeadLetterPageDefault = ops.DeadLetterPageDefault
	DeadLetterPageMax     = ops.DeadLetterPageMax
)

// WatchIntervalDefault is the Watch interval used for a non-positive one.
const WatchIntervalDefault = ops.WatchIntervalDefault

// Admin implements the operator API.
var _ ops.Operator = (*Admin)(nil)

// BucketCount is the outbox's number of buckets.
func (a *Admin) BucketCount() int { return a.cfg.BucketCount }

// Status reads the whole operational state with a few short queries
// (backlog, dead letters, leases, relays). It locks nothing.
func (a *Admin) Status(ctx context.Context) (Status, error) {
	db, cancel := a.op(ctx, "read status")
	defer cancel()
	backlog, err := a.Backlog(db.Statement.Context)
	if err != nil {
		return Status{}, err
	}
	now := backlog.SampledAt
	st := Status{
		SampledAt:   now,
		BucketCount: a.cfg.BucketCount,
		Pending:     backlog.Pending,
		Oldest:      backlog.Oldest,
		OldestAgeMs: age(now, backlog.Oldest),
		Buckets:     make([]BucketStatus, a.cfg.BucketCount),
	}
	for i := range st.Buckets {
		st.Buckets[i] = BucketStatus{Bucket: i, Lease: LeaseInfo{Bucket: i}}
	}
	inRange := func(b int) bool { return b >= 0 && b < len(st.Buckets) }
	for _, bb := range backlog.Buckets {
		if inRange(bb.Bucket) {
			st.Buckets[bb.Bucket].Pending = bb.Pending
			st.Buckets[bb.Bucket].Oldest = bb.Oldest
			st.Buckets[bb.Bucket].OldestAgeMs = age(now, bb.Oldest)
		}
	}

	if err := a.retrying(db, st.Buckets); err != nil {
		return Status{}, err
	}

	var dead []struct {
		Bucket int
		State  string
		N      int64
	}
	if err := db.Table(a.cfg.Tables.DeadLettersTable()).Select("bucket, state, COUNT(*) AS n").
		Group("bucket, state").Scan(&dead).Error; err != nil {
		return Status{}, a.fail(db, "read dead-letter counts", err)
	}
	for _, d := range dead {
		st.DeadLetters.Add(DeadLetterState(d.State), d.N)
		if inRange(d.Bucket) {
			st.Buckets[d.Bucket].DeadLetters.Add(DeadLetterState(d.State), d.N)
		}
	}

	leases, err := a.leases(db, now)
	if err != nil {
		return Status{}, err
	}
	held := map[string]int{}
	for _, l := range leases {
		if inRange(l.Bucket) {
			st.Buckets[l.Bucket].Lease = l
		} else {
			st.LeasesBeyond = append(st.LeasesBeyond, l)
		}
		st.LeaseBuckets = max(st.LeaseBuckets, l.Bucket+1)
		if l.Held {
			held[l.Owner]++
		}
	}
	st.Relays, err = a.relays(db, now, held)
	if err != nil {
		return Status{}, err
	}
	for _, r := range st.Relays {
		if r.Live {
			st.LiveRelays++
		}
	}
	return st, nil
}

func age(now, t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return max(now.Sub(t), 0).Milliseconds()
}

// Leases reads every bucket's lease row, by bucket. Buckets no relay ever
// touched have no row yet and are missing.
func (a *Admin) Leases(ctx context.Context) ([]LeaseInfo, error) {
	db, cancel := a.op(ctx, "read leases")
	defer cancel()
	return a.leases(db, time.Now())
}

func (a *Admin) leases(db *gorm.DB, now time.Time) ([]LeaseInfo, error) {
	var rows []outbox.LeaseRow
	if err := db.Raw("SELECT bucket, owner, term, expires_at_ms, paused FROM " + a.quote(a.cfg.Tables.LeasesTable()) + " ORDER BY bucket").
		Scan(&rows).Error; err != nil {
		return nil, a.fail(db, "read leases", err)
	}
	out := make([]LeaseInfo, len(rows))
	for i, r := range rows {
		l := LeaseInfo{Bucket: int(r.Bucket), Term: r.Term, Paused: r.Paused}
		if r.Owner != nil {
			l.Owner = *r.Owner
			l.ExpiresAt = time.UnixMilli(r.ExpiresAtMs)
			l.Held = r.ExpiresAtMs > now.UnixMilli()
		}
		out[i] = l
	}
	return out, nil
}

// Relays reads the relays' heartbeats, by id. A relay that stopped
// cleanly deleted its heartbeat; one that died leaves it until a live
// relay cleans it up.
func (a *Admin) Relays(ctx context.Context) ([]RelayInfo, error) {
	db, cancel := a.op(ctx, "read relays")
	defer cancel()
	now := time.Now()
	leases, err := a.leases(db, now)
	if err != nil {
		return nil, err
	}
	held := map[string]int{}
	for _, l := range leases {
		if l.Held {
			held[l.Owner]++
		}
	}
	return a.relays(db, now, held)
}

func (a *Admin) relays(db *gorm.DB, now time.Time, held map[string]int) ([]RelayInfo, error) {
	var rows []outbox.RelayRow
	if err := db.Raw("SELECT relay_id, last_seen_ms, started_at_ms FROM " + a.quote(a.cfg.Tables.RelaysTable()) + " ORDER BY relay_id").
		Scan(&rows).Error; err != nil {
		return nil, a.fail(db, "read relays", err)
	}
	out := make([]RelayInfo, len(rows))
	for i, r := range rows {
		seen := time.UnixMilli(r.LastSeenMs)
		out[i] = RelayInfo{ID: r.RelayID, LastSeen: seen, StartedAt: time.UnixMilli(r.StartedAtMs),
			Live: now.Sub(seen) < a.liveWindow, Buckets: held[r.RelayID]}
	}
	return out, nil
}

const deadListColumns = wire.ColID + ", " + wire.ColMessageID + ", " + wire.ColBucket + ", " + wire.ColTopic + ", " + wire.ColKey + ", LENGTH(" + wire.ColValue + "), " +
	wire.ColPartition + ", " + wire.ColCreatedAtMs + ", " + wire.ColAttempts + ", " + wire.ColLastError + ", " + wire.ColDeadAtMs + ", " + wire.ColState

// DeadLetters lists dead letters matching q, newest first (by the time
// they died, then by id), one page at a time. Values and headers are not
// read; use DeadLetter for one message in full.
func (a *Admin) DeadLetters(ctx context.Context, q DeadLetterQuery) (DeadLetterPage, error) {
	limit, after, err := q.Check()
	if err != nil {
		return DeadLetterPage{}, err
	}
	db, cancel := a.op(ctx, "list dead letters")
	defer cancel()
	var where []string
	var args []any
	cond := func(c string, v ...any) { where = append(where, c); args = append(args, v...) }
	if q.Topic != "" {
		cond("topic = ?", q.Topic)
	}
	if q.Key != nil {
		cond("msg_key = ?", q.Key)
	}
	if q.Keyless {
		cond("msg_key IS NULL")
	}
	if q.State != "" {
		cond("state = ?", string(q.State))
	}
	if q.Bucket != nil {
		cond("bucket = ?", *q.Bucket)
	}
	if !q.Since.IsZero() {
		cond("dead_at_ms >= ?", q.Since.UnixMilli())
	}
	if !q.Until.IsZero() {
		cond("dead_at_ms < ?", q.Until.UnixMilli())
	}
	if after != nil {
		cond("(dead_at_ms < ? OR (dead_at_ms = ? AND id < ?))", after.DeadAtMs, after.DeadAtMs, after.ID)
	}
	sql := "SELECT " + deadListColumns + " FROM " + a.quote(a.cfg.Tables.DeadLettersTable())
	if len(where) > 0 {
		sql += " WHERE " + strings.Join(where, " AND ")
	}
	sql += " ORDER BY dead_at_ms DESC, id DESC LIMIT ?"
	args = append(args, limit+1)
	items, err := a.scanDeadLetters(db, sql, false, args...)
	if err != nil {
		return DeadLetterPage{}, a.fail(db, "list dead letters", err)
	}
	page := DeadLetterPage{Items: items}
	if len(items) > limit {
		page.Items = items[:limit]
		last := page.Items[limit-1]
		page.Next = ops.CursorAfter(last)
	}
	return page, nil
}

// DeadLetter reads one dead letter in full, or fails with ErrNotFound.
func (a *Admin) DeadLetter(ctx context.Context, id int64) (DeadLetter, error) {
	db, cancel := a.op(ctx, "read dead letter")
	defer cancel()
	items, err := a.scanDeadLetters(db, "SELECT "+deadListColumns+", msg_value, headers FROM "+
		a.quote(a.cfg.Tables.DeadLettersTable())+" WHERE id = ?", true, id)
	if err != nil {
		return DeadLetter{}, a.fail(db, "read dead letter", err)
	}
	if len(items) == 0 {
		return DeadLetter{}, fmt.Errorf("%w: dead letter %d", ErrNotFound, id)
	}
	return items[0], nil
}

// CountDeadLetters counts the dead letters by state.
func (a *Admin) CountDeadLetters(ctx context.Context) (DeadLetterCounts, error) {
	db, cancel := a.op(ctx, "count dead letters")
	defer cancel()
	var rows []struct {
		State string
		N     int64
	}
	var c DeadLetterCounts
	if err := db.Table(a.cfg.Tables.DeadLettersTable()).Select("state, COUNT(*) AS n").Group("state").Scan(&rows).Error; err != nil {
		return c, a.fail(db, "count dead letters", err)
	}
	for _, r := range rows {
		c.Add(DeadLetterState(r.State), r.N)
	}
	return c, nil
}

func (a *Admin) scanDeadLetters(db *gorm.DB, query string, full bool, args ...any) ([]DeadLetter, error) {
	rows, err := db.Raw(query, args...).Rows()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		var (
			d                DeadLetter
			size             *int64
			lastError        *string
			created, deadAt  int64
			bucket, attempts int64
			state            string
			headers          []byte
			partition        *int64
		)
		dest := []any{&d.ID, &d.MessageID, &bucket, &d.Topic, &d.Key, &size, &partition, &created, &attempts, &lastError, &deadAt, &state}
		if full {
			dest = append(dest, &d.Value, &headers)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		d.Bucket, d.Attempts, d.State = int(bucket), int(attempts), DeadLetterState(state)
		d.CreatedAt, d.DeadAt = time.UnixMilli(created), time.UnixMilli(deadAt)
		if size != nil {
			d.ValueSize = int(*size)
		}
		if lastError != nil {
			d.LastError = *lastError
		}
		d.SetDelivery()
		if partition != nil {
			p := int32(*partition)
			d.Partition = &p
		}
		if full {
			if d.Headers, err = outbox.DecodeHeaders(headers); err != nil {
				return nil, fmt.Errorf("dead letter %d: %w", d.ID, err)
			}
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

// requeueGroup is one unit of requeue: every dead letter of one key in
// one bucket, or some keyless dead letters of one bucket.
type requeueGroup struct {
	bucket  int
	key     []byte  // nil: keyless
	keyless []int64 // the keyless ids
}

// RequeueIDs puts the named dead letters back into the messages table,
// with new row ids, attempts reset, and their message ids, keys and
// payloads unchanged.
//
// A keyed dead letter never comes back alone: its key stays quarantined in
// its bucket while any dead letter of it remains, so RequeueIDs requeues
// every dead letter of the key in that bucket (the failed message and the
// messages parked behind it), as RequeueKey does. To drop a poison message
// and release the rest of its key, DiscardDeadLetters it first, then
// requeue the key. Ids that are not dead letters are reported in
// NotFound.
func (a *Admin) RequeueIDs(ctx context.Context, ids ...int64) (RequeueResult, error) {
	var res RequeueResult
	db, cancel := a.op(ctx, "find dead letters")
	found := map[int64]bool{}
	var groups []requeueGroup
	keyed := map[string]bool{}
	keyless := map[int][]int64{}
	for chunk := range slices.Chunk(ids, storeChunk) {
		rows, err := scanKeys(db, "SELECT id, bucket, msg_key FROM "+a.quote(a.cfg.Tables.DeadLettersTable())+" WHERE id IN ?", chunk)
		if err != nil {
			cancel()
			return res, a.fail(db, "find dead letters", err)
		}
		for _, r := range rows {
			found[r.id] = true
			if r.key == nil {
				keyless[r.bucket] = append(keyless[r.bucket], r.id)
				continue
			}
			gk := strconv.Itoa(r.bucket) + "/" + string(r.key)
			if !keyed[gk] {
				keyed[gk] = true
				groups = append(groups, requeueGroup{bucket: r.bucket, key: r.key})
			}
		}
	}
	cancel()
	for _, id := range ids {
		if !found[id] && !slices.Contains(res.NotFound, id) {
			res.NotFound = append(res.NotFound, id)
		}
	}
	for _, b := range slices.Sorted(maps.Keys(keyless)) {
		groups = append(groups, requeueGroup{bucket: b, keyless: keyless[b]})
	}
	return res, a.requeue(ctx, groups, &res)
}

// RequeueKey puts every dead letter of key back into the messages table,
// in its original order, followed by the key's pending messages (moved
// behind them in the same transaction, so the key's order holds). It
// covers every bucket the key has dead letters in (a key's messages
// pinned to partitions may sit in other buckets). Keyless dead letters
// are requeued by id or with RequeueAll.
func (a *Admin) RequeueKey(ctx context.Context, key []byte) (RequeueResult, error) {
	var res RequeueResult
	if key == nil {
		return res, fmt.Errorf("%w: a key is required (keyless dead letters are requeued by id or all at once)", ErrInvalidRequest)
	}
	db, cancel := a.op(ctx, "find dead letters")
	var buckets []int
	err := scanInto(db, "SELECT DISTINCT bucket FROM "+a.quote(a.cfg.Tables.DeadLettersTable())+" WHERE msg_key = ? ORDER BY bucket", &buckets, key)
	cancel()
	if err != nil {
		return res, a.fail(db, "find dead letters", err)
	}
	groups := make([]requeueGroup, len(buckets))
	for i, b := range buckets {
		groups[i] = requeueGroup{bucket: b, key: key}
	}
	return res, a.requeue(ctx, groups, &res)
}

// RequeueAll requeues every dead letter, or with a topic those of that
// topic. Keys move as a whole: a key with any dead letter of the topic is
// requeued with all its dead letters in the bucket, whatever their topic,
// since the key would otherwise stay quarantined.
func (a *Admin) RequeueAll(ctx context.Context, topic string) (RequeueResult, error) {
	var res RequeueResult
	db, cancel := a.op(ctx, "find dead letters")
	defer cancel()
	where, args := "", []any{}
	if topic != "" {
		where, args = " WHERE topic = ?", []any{topic}
	}
	dead := a.quote(a.cfg.Tables.DeadLettersTable())
	keys, err := scanKeys(db, "SELECT DISTINCT 0, bucket, msg_key FROM "+dead+where, args...)
	if err != nil {
		return res, a.fail(db, "find dead letters", err)
	}
	var groups []requeueGroup
	keylessBuckets := map[int]bool{}
	for _, k := range keys {
		if k.key == nil {
			keylessBuckets[k.bucket] = true
			continue
		}
		groups = append(groups, requeueGroup{bucket: k.bucket, key: k.key})
	}
	slices.SortFunc(groups, func(x, y requeueGroup) int {
		if x.bucket != y.bucket {
			return x.bucket - y.bucket
		}
		return strings.Compare(string(x.key), string(y.key))
	})
	for _, b := range slices.Sorted(maps.Keys(keylessBuckets)) {
		w := " WHERE bucket = ? AND msg_key IS NULL"
		bargs := []any{b}
		if topic != "" {
			w += " AND topic = ?"
			bargs = append(bargs, topic)
		}
		var ids []int64
		if err := scanInto(db, "SELECT id FROM "+dead+w+" ORDER BY id", &ids, bargs...); err != nil {
			return res, a.fail(db, "find dead letters", err)
		}
		for chunk := range slices.Chunk(ids, storeChunk) {
			groups = append(groups, requeueGroup{bucket: b, keyless: chunk})
		}
	}
	return res, a.requeue(ctx, groups, &res)
}

// requeue runs one transaction per group and wakes the local relays.
func (a *Admin) requeue(ctx context.Context, groups []requeueGroup, res *RequeueResult) error {
	defer func() {
		if a.notify != nil && len(res.Buckets) > 0 {
			a.notify(res.Buckets)
		}
	}()
	for _, g := range groups {
		requeued, moved, err := a.requeueGroup(ctx, g)
		if err != nil {
			return err
		}
		res.AddGroup(g.bucket, requeued, moved)
	}
	return nil
}

// requeueGroup moves one group's dead letters, and for a key its pending
// messages, back to the messages table in one transaction, in original id
// order, under new ids. It advances the bucket's lease term first: that
// locks the lease row (a relay dead-lettering or parking in the bucket
// holds the same lock) and revokes the current owner's term, so a relay
// with a stale set of quarantined keys cannot park the requeued messages
// again; it re-acquires the bucket and reads the set afresh.
func (a *Admin) requeueGroup(ctx context.Context, g requeueGroup) (requeued, moved int64, err error) {
	db, cancel := a.op(ctx, "requeue dead letters")
	defer cancel()
	messages := a.quote(a.cfg.Tables.MessagesTable())
	dead := a.quote(a.cfg.Tables.DeadLettersTable())
	err = db.Transaction(func(tx *gorm.DB) error {
		if err := a.advanceTerm(tx, g.bucket); err != nil {
			return err
		}
		var back, pending []outboxRow
		var err error
		if g.key != nil {
			if back, err = readDead(tx, dead, "bucket = ? AND msg_key = ?", g.bucket, g.key); err != nil {
				return err
			}
			if len(back) == 0 {
				return nil
			}
			if pending, err = readRows(tx, messages, "bucket = ? AND msg_key = ?", g.bucket, g.key); err != nil {
				return err
			}
		} else if back, err = readDead(tx, dead, "bucket = ? AND msg_key IS NULL AND id IN ?", g.bucket, g.keyless); err != nil {
			return err
		}
		if len(back) == 0 {
			return nil
		}
		if err := deleteIDs(tx, dead, g.bucket, rowIDs(back)); err != nil {
			return err
		}
		if err := deleteIDs(tx, messages, g.bucket, rowIDs(pending)); err != nil {
			return err
		}
		all := append(back, pending...)
		slices.SortStableFunc(all, func(x, y outboxRow) int {
			switch {
			case x.id < y.id:
				return -1
			case x.id > y.id:
				return 1
			}
			return 0
		})
		if err := insertRows(tx, messages, all, false); err != nil {
			return err
		}
		requeued, moved = int64(len(back)), int64(len(pending))
		return nil
	})
	if err != nil {
		return 0, 0, a.fail(db, "requeue dead letters", err)
	}
	return requeued, moved, nil
}

// deleteIDs deletes rows of a bucket by id and fails unless every one was
// there: the transaction then changed nothing.
func deleteIDs(tx *gorm.DB, table string, bucket int, ids []int64) error {
	for chunk := range slices.Chunk(ids, storeChunk) {
		r := tx.Exec("DELETE FROM "+table+" WHERE bucket = ? AND id IN ?", bucket, chunk)
		if r.Error != nil {
			return r.Error
		}
		if int(r.RowsAffected) != len(chunk) {
			return fmt.Errorf("rows of bucket %d changed concurrently (deleted %d of %d); nothing was changed, try again", bucket, r.RowsAffected, len(chunk))
		}
	}
	return nil
}

// advanceTerm creates the bucket's lease row if missing and advances its
// term, locking the row until tx ends. The current owner keeps the row but
// loses its term: its next guarded write fails and it re-acquires.
func (a *Admin) advanceTerm(tx *gorm.DB, bucket int) error {
	if err := a.ensureLease(tx, bucket); err != nil {
		return err
	}
	return tx.Exec("UPDATE "+a.quote(a.cfg.Tables.LeasesTable())+" SET term = term + 1 WHERE bucket = ?", bucket).Error
}

// ensureLease creates the bucket's lease row if missing. In an empty lease
// table it creates the rows of every bucket of the configured BucketCount,
// as the first relay does, so that the table defines the count; a bucket
// beyond the rows the table has is refused, since its row would stop the
// running relays (see Store.checkLeaseBuckets).
func (a *Admin) ensureLease(tx *gorm.DB, bucket int) error {
	table := a.cfg.Tables.LeasesTable()
	var top []int32
	if err := tx.Raw("SELECT bucket FROM " + a.quote(table) + " ORDER BY bucket DESC LIMIT 1").Scan(&top).Error; err != nil {
		return err
	}
	switch {
	case len(top) == 0:
		if createLeaseRows(tx, table, a.cfg.BucketCount) == nil {
			return nil
		}
		// A relay created them meanwhile: its rows count.
	case bucket > int(top[0]):
		return fmt.Errorf("%w: bucket %d outside 0..%d, the buckets table %s defines (the relays' BucketCount is %d)", ErrInvalidRequest, bucket, top[0], table, top[0]+1)
	}
	return tx.Table(table).Clauses(clause.OnConflict{DoNothing: true}).
		Create(&outbox.LeaseRow{Bucket: int32(bucket)}).Error
}

// PurgeDeadLetters deletes the dead letters that died before olderThan and
// returns how many. It never touches pending messages. A key whose dead
// letters are all purged is no longer quarantined: its next messages are
// published. Each bucket is purged in its own transaction that advances
// the bucket's lease term, like a requeue.
func (a *Admin) PurgeDeadLetters(ctx context.Context, olderThan time.Time) (int64, error) {
	if olderThan.IsZero() {
		return 0, fmt.Errorf("%w: a time is required", ErrInvalidRequest)
	}
	return a.deleteDead(ctx, "purge dead letters", "dead_at_ms < ?", olderThan.UnixMilli())
}

// DiscardDeadLetters deletes the named dead letters and returns how many
// existed. It never touches pending messages. Discarding a key's failed
// message leaves the key quarantined while messages parked behind it
// remain; requeue the key to deliver them.
func (a *Admin) DiscardDeadLetters(ctx context.Context, ids ...int64) (int64, error) {
	var n int64
	for chunk := range slices.Chunk(ids, storeChunk) {
		d, err := a.deleteDead(ctx, "discard dead letters", "id IN ?", chunk)
		n += d
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// deleteDead deletes dead letters matching where, one transaction per
// bucket.
func (a *Admin) deleteDead(ctx context.Context, name, where string, args ...any) (int64, error) {
	db, cancel := a.op(ctx, name)
	defer cancel()
	dead := a.quote(a.cfg.Tables.DeadLettersTable())
	var buckets []int
	if err := scanInto(db, "SELECT DISTINCT bucket FROM "+dead+" WHERE "+where+" ORDER BY bucket", &buckets, args...); err != nil {
		return 0, a.fail(db, name, err)
	}
	var n int64
	for _, b := range buckets {
		err := db.Transaction(func(tx *gorm.DB) error {
			if err := a.advanceTerm(tx, b); err != nil {
				return err
			}
			r := tx.Exec("DELETE FROM "+dead+" WHERE bucket = ? AND "+where, append([]any{b}, args...)...)
			n += r.RowsAffected
			return r.Error
		})
		if err != nil {
			return n, a.fail(db, name, err)
		}
	}
	return n, nil
}

// PauseBucket stops publishing of bucket: no relay claims it, and the
// relay holding it releases it at its next lease maintenance (within
// about relay.Config.LeaseRenewInterval; a batch in flight completes).
// Its messages stay pending, in order, and new ones queue behind them.
func (a *Admin) PauseBucket(ctx context.Context, bucket int) error {
	return a.setPaused(ctx, bucket, true)
}

// ResumeBucket lets relays claim bucket again; a relay with spare fair
// share takes it at its next lease maintenance.
func (a *Admin) ResumeBucket(ctx context.Context, bucket int) error {
	return a.setPaused(ctx, bucket, false)
}

// BucketPaused reports whether bucket is paused (PauseBucket), from its
// lease row; a bucket without one is not paused.
func (a *Admin) BucketPaused(ctx context.Context, bucket int) (bool, error) {
	if err := a.checkBucket(bucket); err != nil {
		return false, err
	}
	db, cancel := a.op(ctx, "read bucket pause")
	defer cancel()
	var paused []bool
	if err := db.Raw("SELECT paused FROM "+a.quote(a.cfg.Tables.LeasesTable())+" WHERE bucket = ?", bucket).Scan(&paused).Error; err != nil {
		return false, a.fail(db, "read bucket pause", err)
	}
	return len(paused) > 0 && paused[0], nil
}

// checkBucket refuses a bucket outside 0..BucketCount-1.
func (a *Admin) checkBucket(bucket int) error {
	if bucket < 0 || bucket >= a.cfg.BucketCount {
		return fmt.Errorf("%w: bucket %d outside 0..%d", ErrInvalidRequest, bucket, a.cfg.BucketCount-1)
	}
	return nil
}

func (a *Admin) setPaused(ctx context.Context, bucket int, paused bool) error {
	if err := a.checkBucket(bucket); err != nil {
		return err
	}
	name := "pause bucket"
	if !paused {
		name = "resume bucket"
	}
	db, cancel := a.op(ctx, name)
	defer cancel()
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := a.ensureLease(tx, bucket); err != nil {
			return err
		}
		return tx.Exec("UPDATE "+a.quote(a.cfg.Tables.LeasesTable())+" SET paused = ? WHERE bucket = ?", paused, bucket).Error
	})
	if err != nil {
		return a.fail(db, name, err)
	}
	return nil
}

// Watch streams the outbox's Status (ops.Watch): read at once and then
// every interval, until ctx ends. It is read-only.
func (a *Admin) Watch(ctx context.Context, interval time.Duration) <-chan Snapshot {
	return ops.Watch(ctx, a, interval)
}

type idBucketKey struct {
	id     int64
	bucket int
	key    []byte
}

// scanKeys runs a query returning (id, bucket, msg_key) rows. It scans
// with database/sql so that a NULL key stays nil and an empty key stays
// empty and non-nil.
func scanKeys(db *gorm.DB, query string, args ...any) ([]idBucketKey, error) {
	rows, err := db.Raw(query, args...).Rows()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []idBucketKey
	for rows.Next() {
		var r idBucketKey
		var bucket int64
		if err := rows.Scan(&r.id, &bucket, &r.key); err != nil {
			return nil, err
		}
		r.bucket = int(bucket)
		out = append(out, r)
	}
	return out, rows.Err()
}

// scanInto runs a raw query and scans it into dest.
func scanInto(db *gorm.DB, query string, dest any, args ...any) error {
	return db.Raw(query, args...).Scan(dest).Error
}
