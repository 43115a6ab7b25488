package gormrelay

import (
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/sqlrows"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/wire"
)

// MaxAttemptsDefault is how many failed publish attempts the failure
// policy allows a message before dead-lettering it.
const MaxAttemptsDefault = 10

// FailureMode is what the failure policy does with a message that keeps
// failing.
type FailureMode int

const (
	// ModeDeadLetter moves a message that failed permanently
	// (relay.IsPermanent) or MaxAttempts times to the dead-letter table,
	// so the rest of its bucket flows again. The default.
	ModeDeadLetter FailureMode = iota
	// ModeBlock never gives up on a message: the bucket backs off and retries
	// it until it is published or an operator intervenes, however long
	// that takes, and every later message of the bucket waits behind it.
	// Choose it when losing order for a key is worse than a stalled bucket,
	// and alert on the oldest pending age.
	ModeBlock
)

func (m FailureMode) String() string {
	switch m {
	case ModeDeadLetter:
		return "dead-letter"
	case ModeBlock:
		return "block"
	}
	return fmt.Sprintf("FailureMode(%d)", int(m))
}

// DeadLetterState is the state of a dead letter (ops.DeadLetterState).
type DeadLetterState = ops.DeadLetterState

// Dead-letter states (ops.DeadLetterFailed, ops.DeadLetterParked).
const (
	DeadLetterFailed = ops.DeadLetterFailed
	DeadLetterParked = ops.DeadLetterParked
)

// FailurePolicyConfig configures a FailurePolicy. The zero value is the
// default policy: dead-letter after 10 attempts or at the first permanent
// error, with key quarantine.
type FailurePolicyConfig struct {
	// MaxAttempts is how many failed publish attempts a message gets before
	// ModeDeadLetter gives up on it. A permanent error (relay.IsPermanent: too
	// large, invalid topic, rejected) dead-letters at once whatever the
	// count. Default MaxAttemptsDefault (10). Ignored by ModeBlock.
	MaxAttempts int

	// Mode is ModeDeadLetter (the default) or ModeBlock.
	Mode FailureMode

	// DisableQuarantine turns key quarantine off. By default, once a keyed
	// message is dead-lettered, every later message of the same key in the
	// same bucket is parked behind it (moved to the dead letters with state
	// "parked") instead of published, until an operator requeues or purges
	// the key's dead letters: a consumer never sees a key's later message
	// before the failed one. Keyless messages are never quarantined. With
	// DisableQuarantine, a dead-lettered message is skipped and the rest of
	// its key is delivered without it.
	DisableQuarantine bool

	// Logger receives a line for every dead-lettered or parked message
	// (ids and errors, never payloads). Default: slog.Default().
	Logger *slog.Logger
}

// FailurePolicy is the outbox's failure policy for the relay: a
// relay.FailureHandler that dead-letters poison messages and a
// relay.BatchFilter that parks the later messages of their keys.
//
// Every *Store carries a default policy (zero FailurePolicyConfig), and
// relay.New uses it when relay.Config.FailureHandler is nil, so
//
//	relay.New(store, publisher, relay.Config{})
//
// dead-letters after 10 attempts with key quarantine. For other settings
// build a policy on the same store and pass it explicitly:
//
//	policy, err := gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{MaxAttempts: 5})
//	r, err := relay.New(store, publisher, relay.Config{FailureHandler: policy})
//
// A custom relay.FailureHandler that does not delegate to a FailurePolicy
// (both HandleFailure and FilterBatch) turns dead-lettering and quarantine
// off: dead letters written earlier then no longer hold their keys back.
//
// Dead-lettering runs in one database transaction that locks the bucket's
// lease row, checks that the relay still holds it (owner, term, unexpired:
// the guard of MarkPublished), inserts the dead letter with its attempts,
// last error and times, and deletes the message. Parking works the same
// way for a batch of messages. A relay that lost its lease changes
// nothing.
//
// The quarantined keys of a bucket are read from the dead-letter table
// once per lease term (one query for all the buckets a relay gained, at
// the first batch of one of them) and kept in memory; a batch is checked
// against that set without a query, so an outbox without dead letters
// pays nothing per batch. Admin operations that remove dead letters
// (requeue, purge, discard) advance the bucket's lease term in the same
// transaction, so a relay holding a stale set loses the lease at its next
// guarded write and reloads.
//
// A FailurePolicy is safe for concurrent use by several relays.
type FailurePolicy struct {
	store *Store
	cfg   FailurePolicyConfig
	log   *slog.Logger
	dead  string // quoted dead-letter table

	mu         sync.Mutex
	quarantine map[int]*quarantineSet // bucket -> keys under one term
	loading    *quarantineLoad        // the quarantine read in flight, if any
}

// quarantineSet is the set of quarantined keys of one bucket as read
// under one lease term.
type quarantineSet struct {
	term int64
	keys map[string]struct{}
}

var (
	_ relay.FailureHandler = (*FailurePolicy)(nil)
	_ relay.BatchFilter    = (*FailurePolicy)(nil)
	_ relay.FailureHandler = (*Store)(nil)
	_ relay.BatchFilter    = (*Store)(nil)
)

// NewFailurePolicy returns a failure policy writing to store's tables.
// cfg's zero fields take their defaults; a negative MaxAttempts or an
// unknown Mode is refused with a *relay.ConfigError.
func NewFailurePolicy(store *Store, cfg FailurePolicyConfig) (*FailurePolicy, error) {
	if store == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "store", Value: nil, Reason: "a *Store is required"}
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = MaxAttemptsDefault
	}
	if cfg.MaxAttempts < 0 {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "MaxAttempts", Value: cfg.MaxAttempts, Reason: "must be positive (use Mode: ModeBlock to never give up)"}
	}
	if cfg.Mode != ModeDeadLetter && cfg.Mode != ModeBlock {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "Mode", Value: cfg.Mode, Reason: "must be ModeDeadLetter or ModeBlock"}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &FailurePolicy{
		store:      store,
		cfg:        cfg,
		log:        cfg.Logger,
		dead:       store.db.Statement.Quote(store.tables.DeadLettersTable()),
		quarantine: map[int]*quarantineSet{},
	}, nil
}

// Config returns the policy's configuration with defaults applied.
func (p *FailurePolicy) Config() FailurePolicyConfig { return p.cfg }

// FailurePolicy returns the store's default failure policy, the one
// relay.New uses when relay.Config.FailureHandler is nil.
func (s *Store) FailurePolicy() *FailurePolicy {
	s.policyOnce.Do(func() {
		s.policy, _ = NewFailurePolicy(s, FailurePolicyConfig{Logger: s.logger})
	})
	return s.policy
}

// HandleFailure implements relay.FailureHandler with the store's default
// failure policy (see FailurePolicy). It is how relay.New finds the
// policy when relay.Config.FailureHandler is nil.
func (s *Store) HandleFailure(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
	return s.FailurePolicy().HandleFailure(ctx, f)
}

// FilterBatch implements relay.BatchFilter with the store's default
// failure policy.
func (s *Store) FilterBatch(ctx context.Context, relayID string, lease relay.Lease, msgs []relay.Message) ([]relay.Message, error) {
	return s.FailurePolicy().FilterBatch(ctx, relayID, lease, msgs)
}

// HandleFailure implements relay.FailureHandler. Under ModeBlock, or for a
// transient error before MaxAttempts, it returns relay.FailureBackoff and
// the bucket retries the message after its backoff. Otherwise it moves the
// message to the dead-letter table (state "failed", with the error text
// and attempts) and returns relay.FailureRetry; with quarantine, its key
// is quarantined in its bucket from then on. It returns an error wrapping
// relay.ErrLeaseLost when the relay no longer holds the bucket.
func (p *FailurePolicy) HandleFailure(ctx context.Context, f relay.Failure) (relay.FailureAction, error) {
	if p.cfg.Mode == ModeBlock {
		return relay.FailureBackoff, nil
	}
	permanent := relay.IsPermanent(f.Err)
	if !permanent && f.Message.Attempts < p.cfg.MaxAttempts {
		return relay.FailureBackoff, nil
	}
	text := "unknown error"
	if f.Err != nil {
		text = f.Err.Error()
	}
	if maybe, _ := outcomeOf(f.Err); maybe {
		text = errorText(text, noteOutcomeUnknown)
	} else {
		text = errorText(text, "")
	}
	msg := f.Message
	moved, err := p.move(ctx, "dead-letter message", f.RelayID, f.Lease, []int64{msg.ID}, DeadLetterFailed, &text)
	if err != nil {
		return relay.FailureBackoff, err
	}
	if moved == 0 {
		// The row is gone already (an operator moved it): nothing blocks
		// the bucket any more.
		return relay.FailureRetry, nil
	}
	if msg.Key != nil && !p.cfg.DisableQuarantine {
		p.addQuarantined(f.Lease, msg.Key)
	}
	p.log.Warn("outbox: message dead-lettered", deadLetteredAttrs(f.Lease.Bucket, msg, permanent, text)...)
	return relay.FailureRetry, nil
}

// FilterBatch implements relay.BatchFilter: it parks the messages of the
// batch whose key is quarantined in their bucket (moves them to the
// dead-letter table with state "parked", under the lease guard) and
// returns the others, in order. Without quarantined keys in the bucket it
// returns msgs as they are, without a query (after the first call of a
// lease term).
func (p *FailurePolicy) FilterBatch(ctx context.Context, relayID string, lease relay.Lease, msgs []relay.Message) ([]relay.Message, error) {
	if p.cfg.DisableQuarantine || len(msgs) == 0 {
		return msgs, nil
	}
	keys, err := p.quarantined(ctx, lease)
	if err != nil || len(keys) == 0 {
		return msgs, err
	}
	var park []int64
	var parked []relay.Message
	keep := msgs[:0:0]
	for _, m := range msgs {
		if _, q := keys[string(m.Key)]; q && m.Key != nil {
			park = append(park, m.ID)
			parked = append(parked, m)
			continue
		}
		keep = append(keep, m)
	}
	if len(park) == 0 {
		return msgs, nil
	}
	if _, err := p.move(ctx, "park messages", relayID, lease, park, DeadLetterParked, nil); err != nil {
		return nil, err
	}
	p.log.Info("outbox: messages parked behind a dead letter of their key", parkedAttrs(lease.Bucket, parked)...)
	return keep, nil
}

// deadLetteredAttrs are the attributes of the log line of a dead-lettered
// message: its bucket, message id, topic, key (when it has one; a key
// that is not printable text as base64:..., as in the park line),
// attempts, whether its error was permanent, and the error.
func deadLetteredAttrs(bucket int, msg relay.Message, permanent bool, text string) []any {
	attrs := []any{"bucket", bucket, "message_id", msg.MessageID, "topic", msg.Topic}
	if msg.Key != nil {
		attrs = append(attrs, "key", keyText(msg.Key))
	}
	return append(attrs, "attempts", msg.Attempts, "permanent", permanent, "err", text)
}

// parkLogLimit bounds the ids and keys the line of a park names; the
// line counts the ones left out.
const parkLogLimit = 20

// parkedAttrs are the attributes of the log line of a park: the bucket,
// how many were parked, the first parkLogLimit of their dead-letter ids
// (outboxctl dead-letters show ID) and message ids, their distinct keys
// (up to parkLogLimit; a key that is not printable text as base64:...),
// and how many ids and keys were left out.
func parkedAttrs(bucket int, parked []relay.Message) []any {
	n := min(len(parked), parkLogLimit)
	ids := make([]int64, n)
	messageIDs := make([]string, n)
	for i, m := range parked[:n] {
		ids[i], messageIDs[i] = m.ID, m.MessageID
	}
	var keys []string
	seen := map[string]bool{}
	keysOmitted := 0
	for _, m := range parked {
		if seen[string(m.Key)] {
			continue
		}
		seen[string(m.Key)] = true
		if len(keys) == parkLogLimit {
			keysOmitted++
			continue
		}
		keys = append(keys, keyText(m.Key))
	}
	attrs := []any{"bucket", bucket, "parked", len(parked), "ids", ids, "message_ids", messageIDs, "keys", keys}
	if omitted := len(parked) - n; omitted > 0 {
		attrs = append(attrs, "ids_omitted", omitted)
	}
	if keysOmitted > 0 {
		attrs = append(attrs, "keys_omitted", keysOmitted)
	}
	return attrs
}

// keyText is a message key for a log line: the key itself when it is
// printable UTF-8, else base64:... of its bytes.
func keyText(key []byte) string {
	s := string(key)
	if utf8.ValidString(s) && !strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) {
		return s
	}
	return "base64:" + base64.StdEncoding.EncodeToString(key)
}

// quarantined returns the quarantined keys of lease's bucket, reading
// them once per lease term. The returned map must not be modified.
//
// A relay that gains many buckets at once (a start, a takeover) would
// read them one statement per bucket, so the read on a miss also covers
// every bucket whose last claim through this store has no set yet: the
// claim was recorded after its UPDATE returned, so a read starting now
// sees every dead letter written under an earlier term. One statement per
// quarantineChunk buckets instead of one per bucket.
func (p *FailurePolicy) quarantined(ctx context.Context, lease relay.Lease) (map[string]struct{}, error) {
	for {
		p.mu.Lock()
		if q := p.quarantine[lease.Bucket]; q != nil && q.term == lease.Term {
			p.mu.Unlock()
			return q.keys, nil
		}
		if l := p.loading; l != nil && l.covers(lease) {
			p.mu.Unlock()
			select {
			case <-l.done:
				continue // the set is there now, or the read failed: read again
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}
		l := &quarantineLoad{done: make(chan struct{}), leases: []relay.Lease{lease}}
		l.leases = p.store.claimedLeases(l.leases, func(c relay.Lease) bool {
			q := p.quarantine[c.Bucket]
			return c.Bucket != lease.Bucket && (q == nil || q.term != c.Term)
		})
		if p.loading == nil {
			p.loading = l
		}
		p.mu.Unlock()

		sets, err := p.readQuarantined(ctx, l.leases)
		p.mu.Lock()
		if err == nil {
			for _, c := range l.leases {
				// A set already there under the same term was read after
				// the same claim too, and may hold a key this relay
				// dead-lettered since: keep it; and never go back to an
				// older term.
				if q := p.quarantine[c.Bucket]; q == nil || q.term < c.Term {
					p.quarantine[c.Bucket] = &quarantineSet{term: c.Term, keys: sets[c.Bucket]}
				}
			}
		}
		if p.loading == l {
			p.loading = nil
		}
		keys := sets[lease.Bucket]
		if q := p.quarantine[lease.Bucket]; q != nil && q.term == lease.Term {
			keys = q.keys
		}
		p.mu.Unlock()
		close(l.done)
		if err != nil {
			return nil, err
		}
		return keys, nil
	}
}

// quarantineChunk is how many buckets one quarantine read covers.
const quarantineChunk = 256

// readQuarantined reads the quarantined keys of the leases' buckets, a
// chunk of buckets per statement. Every bucket of leases has a set in the
// result, empty if it has no keyed dead letter.
func (p *FailurePolicy) readQuarantined(ctx context.Context, leases []relay.Lease) (map[int]map[string]struct{}, error) {
	db, ctx, cancel := p.store.op(ctx, "read quarantined keys")
	defer cancel()
	sets := make(map[int]map[string]struct{}, len(leases))
	for _, l := range leases {
		sets[l.Bucket] = map[string]struct{}{}
	}
	for chunk := range slices.Chunk(leases, quarantineChunk) {
		var rows []struct {
			Bucket int
			MsgKey []byte
		}
		err := db.Raw("SELECT DISTINCT bucket, msg_key FROM "+p.dead+" WHERE bucket IN ? AND msg_key IS NOT NULL", buckets(chunk)).Scan(&rows).Error
		if err != nil {
			return nil, p.fail(ctx, "read quarantined keys", err)
		}
		for _, r := range rows {
			sets[r.Bucket][string(r.MsgKey)] = struct{}{}
		}
	}
	return sets, nil
}

// quarantineLoad is a quarantine read in flight; a miss on a lease it
// covers waits for it instead of reading the same rows.
type quarantineLoad struct {
	done   chan struct{}
	leases []relay.Lease
}

func (l *quarantineLoad) covers(lease relay.Lease) bool {
	return slices.Contains(l.leases, lease)
}

// addQuarantined adds key to the bucket's set after this relay
// dead-lettered a message of it under lease. The set is copied, so maps
// handed out earlier stay unchanged.
func (p *FailurePolicy) addQuarantined(lease relay.Lease, key []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	q := p.quarantine[lease.Bucket]
	if q == nil || q.term != lease.Term {
		return // read afresh at the next batch
	}
	keys := make(map[string]struct{}, len(q.keys)+1)
	for k := range q.keys {
		keys[k] = struct{}{}
	}
	keys[string(key)] = struct{}{}
	p.quarantine[lease.Bucket] = &quarantineSet{term: q.term, keys: keys}
}

// forget drops the bucket's set, so it is read again.
func (p *FailurePolicy) forget(bucket int) {
	p.mu.Lock()
	delete(p.quarantine, bucket)
	p.mu.Unlock()
}

// move moves the messages ids of lease's bucket to the dead-letter table
// with state, in one transaction guarded by the lease. lastError, if set,
// replaces the stored error text. It returns how many rows moved.
func (p *FailurePolicy) move(ctx context.Context, name, relayID string, lease relay.Lease, ids []int64, state DeadLetterState, lastError *string) (int, error) {
	s := p.store
	db, ctx, cancel := s.op(ctx, name)
	defer cancel()
	moved := 0
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := s.lockLease(tx, relayID, lease); err != nil {
			return err
		}
		now := nowMs()
		for chunk := range slices.Chunk(ids, storeChunk) {
			rows, err := readRows(tx, s.messages, "bucket = ? AND id IN ?", lease.Bucket, chunk)
			if err != nil {
				return err
			}
			if len(rows) == 0 {
				continue
			}
			for i := range rows {
				rows[i].deadAtMs = now
				rows[i].state = state
				if lastError != nil {
					// Keep what the row knows about an earlier copy.
					t := withNote(*lastError, rows[i].lastError)
					rows[i].lastError = &t
				}
			}
			if err := insertRows(tx, p.dead, rows, true); err != nil {
				return err
			}
			r := tx.Exec("DELETE FROM "+s.messages+" WHERE bucket = ? AND id IN ?", lease.Bucket, rowIDs(rows))
			if r.Error != nil {
				return r.Error
			}
			if int(r.RowsAffected) != len(rows) {
				return fmt.Errorf("outbox: %s: deleted %d of %d rows read in the same transaction", name, r.RowsAffected, len(rows))
			}
			moved += len(rows)
		}
		return nil
	})
	if err != nil {
		if !errors.Is(err, relay.ErrLeaseLost) {
			// The commit may or may not have happened: read the
			// quarantined keys again rather than trust the set.
			p.forget(lease.Bucket)
		}
		return 0, p.fail(ctx, name, err)
	}
	return moved, nil
}

// fail wraps an error like Store.fail and reports a missing dead-letter
// table as a misconfiguration.
func (p *FailurePolicy) fail(ctx context.Context, name string, err error) error {
	err = p.store.fail(ctx, name, err)
	if relay.IsMisconfiguration(err) || errors.Is(err, relay.ErrLeaseLost) || ctx.Err() != nil || !maybeSchemaError(err) {
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.store.timeout)
	defer cancel()
	db := p.store.db.WithContext(cctx)
	var one int
	if db.Raw("SELECT 1").Row().Scan(&one) == nil && db.Exec("SELECT 1 FROM "+p.dead+" WHERE 1 = 0").Error != nil {
		return &relay.MisconfigurationError{
			Setting: "Tables",
			Reason: fmt.Sprintf("table %s does not exist: run the plugin's AutoMigrate (p.AutoMigrate(ctx, db)), Tables.AutoMigrate or your migrations before starting the relay",
				p.store.tables.DeadLettersTable()),
			Err: err,
		}
	}
	return err
}

// lockLease locks lease's row for the rest of tx and fails with
// ErrLeaseLost unless relayID holds it under its term, unexpired. The lock
// orders the relay's dead-letter writes with the admin's requeues, which
// advance the term under the same lock. SQLite locks the whole database
// for a writing transaction and needs no row lock.
func (s *Store) lockLease(tx *gorm.DB, relayID string, lease relay.Lease) error {
	q := "SELECT term FROM " + s.leases + " WHERE bucket = ? AND owner = ? AND term = ? AND expires_at_ms > ?"
	if tx.Dialector.Name() != "sqlite" {
		q += " FOR UPDATE"
	}
	var terms []int64
	if err := tx.Raw(q, lease.Bucket, relayID, lease.Term, nowMs()).Scan(&terms).Error; err != nil {
		return err
	}
	if len(terms) == 0 {
		return s.lostLease(tx, relayID, lease)
	}
	return nil
}

// outboxRow is a row of the messages or the dead-letter table, as moved
// between them byte for byte.
type outboxRow struct {
	id          int64
	messageID   string
	bucket      int32
	topic       string
	key         []byte
	value       []byte
	headers     []byte
	partition   *int32
	createdAtMs int64
	attempts    int32
	lastError   *string
	// dead-letter columns
	deadAtMs int64
	state    DeadLetterState
}

const (
	rowColumns  = wire.MessageColumns + ", " + wire.ColLastError
	deadColumns = rowColumns + ", " + wire.ColDeadAtMs + ", " + wire.ColState
)

// readRows reads the messages-table columns of the rows of table
// matching where, in id order.
func readRows(tx *gorm.DB, table, where string, args ...any) ([]outboxRow, error) {
	return scanRows(tx, "SELECT "+rowColumns+" FROM "+table+" WHERE "+where+" ORDER BY id", false, args...)
}

// readDead reads dead letters matching where, in id order.
func readDead(tx *gorm.DB, table, where string, args ...any) ([]outboxRow, error) {
	return scanRows(tx, "SELECT "+deadColumns+" FROM "+table+" WHERE "+where+" ORDER BY id", true, args...)
}

func scanRows(tx *gorm.DB, query string, dead bool, args ...any) ([]outboxRow, error) {
	rows, err := tx.Raw(query, args...).Rows()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []outboxRow
	for rows.Next() {
		var (
			r         outboxRow
			partition sql.NullInt32
			lastError sql.NullString
			state     string
		)
		dest := []any{&r.id, &r.messageID, &r.bucket, &r.topic, &r.key, &r.value, &r.headers, &partition, &r.createdAtMs, &r.attempts, &lastError}
		if dead {
			dest = append(dest, &r.deadAtMs, &state)
		}
		if err := rows.Scan(dest...); err != nil {
			return nil, err
		}
		if partition.Valid {
			v := partition.Int32
			r.partition = &v
		}
		if lastError.Valid {
			v := lastError.String
			r.lastError = &v
		}
		r.state = DeadLetterState(state)
		out = append(out, r)
	}
	return out, rows.Err()
}

// insertRows inserts rows in their order, as raw SQL (no GORM callback
// runs). Into the dead-letter table (dead) the rows keep their ids; into
// the messages table they get new ids in the order given, with the
// failure columns reset.
func insertRows(tx *gorm.DB, table string, rows []outboxRow, dead bool) error {
	cols, width := "("+deadColumns+")", 13
	if !dead {
		cols, width = sqlrows.InsertColumns, sqlrows.InsertArgs
	}
	place := "(" + strings.TrimSuffix(strings.Repeat("?,", width), ",") + ")"
	for chunk := range slices.Chunk(rows, sqlrows.InsertChunk) {
		var sb strings.Builder
		sb.WriteString("INSERT INTO " + table + " " + cols + " VALUES ")
		args := make([]any, 0, len(chunk)*width)
		for i, r := range chunk {
			if i > 0 {
				sb.WriteString(",")
			}
			sb.WriteString(place)
			if dead {
				args = append(args, r.id, r.messageID, r.bucket, r.topic, sqlrows.NullBytes(r.key), sqlrows.NullBytes(r.value), sqlrows.NullBytes(r.headers),
					r.partition, r.createdAtMs, r.attempts, r.lastError, r.deadAtMs, string(r.state))
			} else {
				args = append(args, r.messageID, r.bucket, r.topic, sqlrows.NullBytes(r.key), sqlrows.NullBytes(r.value), sqlrows.NullBytes(r.headers),
					r.partition, r.createdAtMs)
			}
		}
		if err := tx.Exec(sb.String(), args...).Error; err != nil {
			return err
		}
	}
	return nil
}

func rowIDs(rows []outboxRow) []int64 {
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.id
	}
	return ids
}

// DrainOnce is the one-shot runner: it drains the outbox configured by cfg
// on db once through pub, with a relay configured by rcfg (its BucketCount
// defaults to cfg's), and returns how many messages were published. It is
// (*relay.Relay).DrainOnce with the GORM store and the default failure policy
// wired in: messages that exhaust the policy are dead-lettered and the
// drain carries on. Meant for jobs, scripts and tests; with relays running
// it drains only the buckets it could lease. See relay.Relay.DrainOnce for
// the error semantics.
func DrainOnce(ctx context.Context, db *gorm.DB, cfg outbox.Config, pub relay.Publisher, rcfg relay.Config) (int, error) {
	store, err := NewStore(db, cfg)
	if err != nil {
		return 0, err
	}
	r, err := relay.New(store, pub, rcfg) // BucketCount from the store
	if err != nil {
		return 0, err
	}
	return r.DrainOnce(ctx)
}
