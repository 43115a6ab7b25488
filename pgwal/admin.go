package pgwal

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/gormlog"
	"github.com/gorm-outbox/outbox/internal/walenv"
	"github.com/gorm-outbox/outbox/ops"
)

// Admin is the operator API (ops.WALOperator) of an outbox in WAL mode.
// Dead letters are listed, shown, counted, discarded and purged as in
// table mode (the embedded gormrelay.Admin: WAL mode dead-letters into the
// same table); requeues emit the dead letters into the WAL again, as
// RequeueKey does; Status adds the slot (ops.Status.WAL). There is no
// per-bucket pause in WAL mode: PauseBucket and ResumeBucket fail with
// ops.ErrInvalidRequest.
type Admin struct {
	*gormrelay.Admin
	db     *gorm.DB
	plugin *outbox.Plugin
	cfg    Config
	reader *Reader // the reader of this process, if any: the lag in time
}

// Admin errors.
var (
	// ErrSlotMissing is returned by DropSlot and Unconfirmed when the slot
	// does not exist.
	ErrSlotMissing = errors.New("pgwal: the replication slot does not exist")
	// ErrSlotActive is returned by DropSlot and Unconfirmed while a reader
	// is connected to the slot.
	ErrSlotActive = errors.New("pgwal: a reader is connected to the replication slot")
)

// NewAdmin returns the operator API of the outbox of plugin, which must
// be in outbox.ModeWAL and registered on db (db.Use). cfg names the slot
// and the lease table as the readers' Config does (Slot, LeaseTable and
// LeaseDuration are read; ReplicationDSN is not needed).
func NewAdmin(db *gorm.DB, plugin *outbox.Plugin, cfg Config) (*Admin, error) {
	if db == nil || plugin == nil {
		return nil, &outbox.ConfigError{Package: "pgwal", Field: "NewAdmin", Reason: "db and plugin are required"}
	}
	ocfg := plugin.Config()
	if ocfg.Mode != outbox.ModeWAL {
		return nil, &outbox.ConfigError{Package: "pgwal", Field: "outbox.Config.Mode", Value: ocfg.Mode, Reason: "the outbox must be in ModeWAL"}
	}
	cfg = cfg.withDefaults(ocfg)
	v := cfg
	if v.ReplicationDSN == "" {
		v.ReplicationDSN = "unused"
	}
	if err := v.validate(); err != nil {
		return nil, err
	}
	return &Admin{Admin: gormrelay.PluginAdmin(db, plugin), db: db.Session(&gorm.Session{NewDB: true, SkipHooks: true, Logger: gormlog.OnlyFailures(db.Logger)}), plugin: plugin, cfg: cfg}, nil
}

// Admin returns the operator API of the reader's outbox. Its WALStatus
// reports the lag in time from this reader's queues (LagSource
// "reader") while it reads the slot.
func (r *Reader) Admin(plugin *outbox.Plugin) (*Admin, error) {
	a, err := NewAdmin(r.db, plugin, r.cfg)
	if err != nil {
		return nil, err
	}
	a.reader = r
	return a, nil
}

// WALConfig returns the reader configuration the Admin works with,
// defaults filled in.
func (a *Admin) WALConfig() Config { return a.cfg }

func (a *Admin) leases() *leases {
	return &leases{db: a.db, table: a.cfg.LeaseTable, slot: a.cfg.Slot, me: a.cfg.RelayID, dur: a.cfg.LeaseDuration}
}

// WALStatus reads the slot, its lease and the age of the oldest message
// the reader has not published: from the queues of a reader in this
// process that reads the slot (LagSource "reader"), otherwise from the
// lease row's last renewal while the lease is held (LagSource "lease").
func (a *Admin) WALStatus(ctx context.Context) (ops.WALStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, gormrelay.AdminTimeoutDefault)
	defer cancel()
	db := a.db.WithContext(ctx)
	now := time.Now()
	ws := ops.WALStatus{Slot: a.cfg.Slot, LeaseDurationMs: a.cfg.LeaseDuration.Milliseconds()}
	var cur string
	if err := db.Raw("SELECT pg_current_wal_lsn()::text").Scan(&cur).Error; err != nil {
		return ws, fmt.Errorf("pgwal: admin read WAL position: %w", err)
	}
	ws.CurrentLSN = cur
	st, err := ReadSlotStatus(ctx, a.db, a.cfg.Slot)
	if err != nil {
		return ws, fmt.Errorf("pgwal: admin read slot %s: %w", a.cfg.Slot, err)
	}
	if err := st.foreign(a.cfg.Slot); err != nil {
		ws.Exists, ws.Foreign = true, err.Error()
		return ws, nil
	}
	ws.Exists, ws.Active, ws.WALState, ws.RetainedBytes = st.Exists, st.Active, st.WALStatus, st.RetainedBytes
	if st.Exists {
		ws.ConfirmedLSN = st.Confirmed.String()
	}
	// The lease row after the slot, as slotAndRow reads them: a reader
	// that confirms in between has recorded its position first.
	lease, ok, err := a.lease(db)
	if err != nil {
		return ws, err
	}
	var recorded pglogrepl.LSN
	if ok {
		recorded = pglogrepl.LSN(lease.ConfirmedLSN)
		ws.Reader = ops.WALReader{Term: lease.Term}
		if lease.Owner != nil {
			ws.Reader.Owner = *lease.Owner
		}
		if lease.ExpiresAtMs > 0 {
			ws.Reader.ExpiresAt = time.UnixMilli(lease.ExpiresAtMs)
			ws.Reader.Held = ws.Reader.Owner != "" && ws.Reader.ExpiresAt.After(now)
		}
		if recorded != 0 {
			ws.Reader.ConfirmedLSN = recorded.String()
		}
	}
	if _, err := checkSlot(st, a.cfg.Slot, recorded); err != nil {
		var lost *SlotLostError
		if errors.As(err, &lost) {
			ws.Lost, ws.LostReason = true, lost.Reason
		}
	}
	if a.reader != nil {
		if oldest, ok := a.reader.OldestUnpublished(); ok {
			ws.Oldest, ws.LagAgeMs, ws.LagSource = oldest, max(now.Sub(oldest), 0).Milliseconds(), "reader"
		} else if a.reader.cur.Load() != nil {
			ws.LagSource = "reader"
		}
	}
	if ws.LagSource == "" && ws.Reader.Held && lease.LagAtMs > 0 {
		// Another process reads the slot: its last renewal's sample.
		ws.LagSource = "lease"
		if lease.LagOldestMs > 0 {
			ws.Oldest = time.UnixMilli(lease.LagOldestMs)
			ws.LagAgeMs = max(now.Sub(ws.Oldest), 0).Milliseconds()
		}
	}
	return ws, nil
}

// lease reads the slot's lease row; ok is false when there is none (or
// no lease table yet).
func (a *Admin) lease(db *gorm.DB) (SlotLease, bool, error) {
	if !db.Migrator().HasTable(a.cfg.LeaseTable) {
		return SlotLease{}, false, nil
	}
	var rows []SlotLease
	q := db.Table(a.cfg.LeaseTable).Where("slot = ?", a.cfg.Slot)
	if !db.Migrator().HasColumn(a.cfg.LeaseTable, "lag_oldest_ms") {
		// A lease table that no reader of this release has migrated yet
		// (a rolling upgrade): its row without the lag, which reads as
		// unknown.
		q = q.Select("slot", "owner", "term", "expires_at_ms", "confirmed_lsn")
	}
	if err := q.Find(&rows).Error; err != nil {
		return SlotLease{}, false, fmt.Errorf("pgwal: admin read lease of slot %s: %w", a.cfg.Slot, err)
	}
	if len(rows) == 0 {
		return SlotLease{}, false, nil
	}
	return rows[0], true, nil
}

// Status reads the operational state (gormrelay.Admin.Status) with the
// slot's in Status.WAL.
func (a *Admin) Status(ctx context.Context) (ops.Status, error) {
	st, err := a.Admin.Status(ctx)
	if err != nil {
		return st, err
	}
	ws, err := a.WALStatus(ctx)
	if err != nil {
		return st, err
	}
	st.WAL = &ws
	return st, nil
}

// Watch streams Status (ops.Watch), the slot included.
func (a *Admin) Watch(ctx context.Context, interval time.Duration) <-chan ops.Snapshot {
	return ops.Watch(ctx, a, interval)
}

// OldestPending returns the age of the oldest message the reader decoded
// and has not published, and its bucket: from the queues of a reader in
// this process that reads the slot, otherwise from the lease row's last
// renewal while the lease is held (as WALStatus's LagSource "lease");
// failing both, the messages table's (gormrelay.Admin.OldestPending),
// which holds only bridged rows in WAL mode.
func (a *Admin) OldestPending(ctx context.Context) (time.Duration, int, bool, error) {
	if a.reader != nil && a.reader.cur.Load() != nil {
		if oldest, bucket, ok := a.reader.oldest(); ok {
			return max(time.Since(oldest), 0), bucket, true, nil
		}
	} else {
		lctx, cancel := context.WithTimeout(ctx, gormrelay.AdminTimeoutDefault)
		lease, ok, err := a.lease(a.db.WithContext(lctx))
		cancel()
		if err != nil {
			return 0, 0, false, err
		}
		now := time.Now()
		if ok && lease.LagOldestMs > 0 && lease.Owner != nil && lease.ExpiresAtMs > now.UnixMilli() {
			return max(now.Sub(time.UnixMilli(lease.LagOldestMs)), 0), lease.LagBucket, true, nil
		}
	}
	return a.Admin.OldestPending(ctx)
}

// RequeueKey emits every dead letter of key again, in their original
// order, and deletes them, in one transaction (RequeueKey, the package
// function).
func (a *Admin) RequeueKey(ctx context.Context, key []byte) (ops.RequeueResult, error) {
	var res ops.RequeueResult
	if key == nil {
		return res, fmt.Errorf("%w: a key is required (keyless dead letters are requeued by id or all at once)", ops.ErrInvalidRequest)
	}
	return res, a.requeue(ctx, &res, key, nil)
}

// RequeueIDs requeues the named dead letters: a keyed one with every dead
// letter of its key (RequeueKey), keyless ones on their own. Ids that are
// not dead letters are reported in NotFound.
func (a *Admin) RequeueIDs(ctx context.Context, ids ...int64) (ops.RequeueResult, error) {
	var res ops.RequeueResult
	rows, err := a.deadRows(ctx, "id IN ?", ids)
	if err != nil {
		return res, err
	}
	found := map[int64]bool{}
	keys := map[string]bool{}
	var keyless []int64
	for _, r := range rows {
		found[r.ID] = true
		if r.Key == nil {
			keyless = append(keyless, r.ID)
		} else {
			keys[string(r.Key)] = true
		}
	}
	for _, id := range ids {
		if !found[id] && !slices.Contains(res.NotFound, id) {
			res.NotFound = append(res.NotFound, id)
		}
	}
	return res, a.requeueGroups(ctx, &res, keys, keyless)
}

// RequeueAll requeues every dead letter, or with a topic those of that
// topic; keys move as a whole.
func (a *Admin) RequeueAll(ctx context.Context, topic string) (ops.RequeueResult, error) {
	var res ops.RequeueResult
	where, args := "1 = 1", []any(nil)
	if topic != "" {
		where, args = "topic = ?", []any{topic}
	}
	rows, err := a.deadRows(ctx, where, args...)
	if err != nil {
		return res, err
	}
	keys := map[string]bool{}
	var keyless []int64
	for _, r := range rows {
		if r.Key == nil {
			keyless = append(keyless, r.ID)
		} else {
			keys[string(r.Key)] = true
		}
	}
	return res, a.requeueGroups(ctx, &res, keys, keyless)
}

func (a *Admin) deadRows(ctx context.Context, where string, args ...any) ([]outbox.DeadLetterRow, error) {
	ctx, cancel := context.WithTimeout(ctx, gormrelay.AdminTimeoutDefault)
	defer cancel()
	var rows []outbox.DeadLetterRow
	if err := a.db.WithContext(ctx).Table(a.plugin.Config().Tables.DeadLettersTable()).Select("id, msg_key").
		Where(where, args...).Find(&rows).Error; err != nil {
		return nil, fmt.Errorf("pgwal: admin find dead letters: %w", err)
	}
	return rows, nil
}

func (a *Admin) requeueGroups(ctx context.Context, res *ops.RequeueResult, keys map[string]bool, keyless []int64) error {
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		if err := a.requeue(ctx, res, []byte(k), nil); err != nil {
			return err
		}
	}
	if len(keyless) > 0 {
		return a.requeue(ctx, res, nil, keyless)
	}
	return nil
}

// requeue emits the dead letters of key, or the keyless ones named by
// ids, again in their original order (WAL positions, then table ids) and
// deletes them, in one transaction.
func (a *Admin) requeue(ctx context.Context, res *ops.RequeueResult, key []byte, ids []int64) error {
	ctx, cancel := context.WithTimeout(ctx, gormrelay.AdminTimeoutDefault)
	defer cancel()
	var groups map[int]int64
	err := a.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		var err error
		groups, err = emitDead(tx, a.plugin, key, ids)
		return err
	})
	if err != nil {
		return fmt.Errorf("pgwal: admin requeue: %w", err)
	}
	for _, b := range slices.Sorted(maps.Keys(groups)) {
		res.AddGroup(b, groups[b], 0)
	}
	return nil
}

// emitDead emits, in tx, the dead letters of key (every one of it) or
// the keyless ones named by ids, in their original order, and deletes
// them. It returns how many per bucket.
func emitDead(tx *gorm.DB, plugin *outbox.Plugin, key []byte, ids []int64) (map[int]int64, error) {
	table := plugin.Config().Tables.DeadLettersTable()
	q := tx.Table(table).Clauses(lockingClause())
	if key != nil {
		if err := lockKey(tx, table, key); err != nil {
			return nil, err
		}
		q = q.Where("msg_key = ?", key)
	} else {
		q = q.Where("msg_key IS NULL AND id IN ?", ids)
	}
	var rows []outbox.DeadLetterRow
	if err := q.Find(&rows).Error; err != nil {
		return nil, err
	}
	// WAL mode ids are negated WAL positions (descending is commit order);
	// table mode ids, of dead letters from before a switch to WAL mode,
	// are ascending and older than any WAL position.
	slices.SortStableFunc(rows, func(x, y outbox.DeadLetterRow) int { return compareDeadOrder(x.ID, y.ID) })
	msgs := make([]*outbox.Message, len(rows))
	del := make([]int64, len(rows))
	groups := map[int]int64{}
	for i, r := range rows {
		hs, err := outbox.DecodeHeaders(r.Headers)
		if err != nil {
			return nil, fmt.Errorf("dead letter %d: %w", r.ID, err)
		}
		msgs[i] = &outbox.Message{ID: r.MessageID, Topic: r.Topic, Key: r.Key, Value: r.Value, Headers: hs, Partition: r.Partition}
		del[i] = r.ID
		groups[int(r.Bucket)]++
	}
	if len(rows) == 0 {
		return groups, nil
	}
	if err := plugin.Enqueue(tx, msgs...); err != nil {
		return nil, err
	}
	if err := tx.Exec("DELETE FROM "+tx.Statement.Quote(table)+" WHERE id IN ?", del).Error; err != nil {
		return nil, err
	}
	return groups, nil
}

// compareDeadOrder orders dead-letter ids by when their messages were
// written: table ids (positive) ascending first, then WAL ids (negated
// positions) descending.
func compareDeadOrder(x, y int64) int {
	switch {
	case x >= 0 && y >= 0:
		return cmpInt(x, y)
	case x < 0 && y < 0:
		return cmpInt(y, x)
	case x >= 0:
		return -1
	}
	return 1
}

func cmpInt(x, y int64) int {
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}

// PauseBucket fails: WAL mode reads one stream and has no per-bucket
// pause.
func (a *Admin) PauseBucket(context.Context, int) error { return errNoPause }

// ResumeBucket fails as PauseBucket does.
func (a *Admin) ResumeBucket(context.Context, int) error { return errNoPause }

var errNoPause = fmt.Errorf("%w: WAL mode has no per-bucket pause: stop the readers to stop publishing", ops.ErrInvalidRequest)

// EnsureSlot creates the lease table, the publication and the slot when
// they are missing, as Reader.EnsureSlot does, through an ordinary
// connection (pg_create_logical_replication_slot; its role needs the
// REPLICATION attribute). It reports whether it created the slot. A slot
// of the same name that belongs to another database of the server (or
// is not a pgoutput logical slot) is a *SlotForeignError, left
// untouched. While the creation waits for transactions open on the
// server it logs them (Config.Logger); ending ctx cancels it on the
// server.
func (a *Admin) EnsureSlot(ctx context.Context) (created bool, err error) {
	l := a.leases()
	if err := l.migrate(ctx); err != nil {
		return false, fmt.Errorf("pgwal: create lease table %s: %w", a.cfg.LeaseTable, err)
	}
	if err := ensurePublication(ctx, a.db, a.cfg.Slot); err != nil {
		return false, err
	}
	st, row, err := l.slotAndRow(ctx)
	if err != nil {
		return false, err
	}
	exists, err := checkSlot(st, a.cfg.Slot, pglogrepl.LSN(row.ConfirmedLSN))
	if err != nil || exists {
		return false, err
	}
	lsn, err := a.createSlot(ctx)
	if err != nil {
		return false, err
	}
	pos, err := pglogrepl.ParseLSN(lsn)
	if err != nil {
		return false, err
	}
	return true, l.record(ctx, int64(pos))
}

// createSlot creates the slot through one connection of the pool,
// logging the sessions its creation waits for (watchCreation).
func (a *Admin) createSlot(ctx context.Context) (lsn string, err error) {
	err = a.db.WithContext(ctx).Connection(func(conn *gorm.DB) error {
		var pid uint32
		if err := conn.Raw("SELECT pg_backend_pid()").Scan(&pid).Error; err != nil {
			return err
		}
		w := watchCreation(ctx, a.db, a.cfg.Logger.With("outbox", a.plugin.Config().Name, "slot", a.cfg.Slot), pid)
		defer w.stop()
		return conn.Raw("SELECT lsn::text FROM pg_create_logical_replication_slot(?, 'pgoutput')", a.cfg.Slot).Scan(&lsn).Error
	})
	if err != nil {
		return "", fmt.Errorf("pgwal: create slot %s: %w", a.cfg.Slot, err)
	}
	return lsn, nil
}

// Unconfirmed summarizes the outbox messages a slot holds past its
// confirmed position: committed, not yet confirmed by a reader.
type Unconfirmed struct {
	// Messages counts them; Oldest and Newest are the creation times of
	// the first and the last (zero when Messages is 0).
	Messages int64     `json:"messages"`
	Oldest   time.Time `json:"oldest,omitzero"`
	Newest   time.Time `json:"newest,omitzero"`
	// Keys counts their distinct keys (keyless messages not counted).
	Keys int64 `json:"keys"`
}

// Unconfirmed reads, without consuming them
// (pg_logical_slot_peek_binary_changes), the outbox messages the slot
// holds past its confirmed position. It decodes all the WAL the slot
// retains, so its cost grows with RetainedBytes. The slot must exist
// (ErrSlotMissing) and no reader may be connected (ErrSlotActive).
func (a *Admin) Unconfirmed(ctx context.Context) (Unconfirmed, error) {
	var u Unconfirmed
	st, err := ReadSlotStatus(ctx, a.db, a.cfg.Slot)
	switch {
	case err != nil:
		return u, fmt.Errorf("pgwal: read slot status: %w", err)
	case st.foreign(a.cfg.Slot) != nil:
		return u, st.foreign(a.cfg.Slot)
	case !st.Exists:
		return u, fmt.Errorf("%w: %s", ErrSlotMissing, a.cfg.Slot)
	case st.Active:
		return u, fmt.Errorf("%w: %s", ErrSlotActive, a.cfg.Slot)
	}
	rows, err := a.db.WithContext(ctx).Raw("SELECT data FROM pg_logical_slot_peek_binary_changes(?, NULL, NULL, 'proto_version', '1', 'publication_names', ?, 'messages', 'true')",
		a.cfg.Slot, a.cfg.Slot).Rows()
	if err != nil {
		return u, fmt.Errorf("pgwal: peek slot %s: %w", a.cfg.Slot, err)
	}
	defer rows.Close()
	prefix := a.plugin.Config().WALPrefix()
	keys := map[string]bool{}
	for rows.Next() {
		var data []byte
		if err := rows.Scan(&data); err != nil {
			return u, err
		}
		m, err := pglogrepl.Parse(data)
		if err != nil {
			return u, fmt.Errorf("pgwal: peek slot %s: %w", a.cfg.Slot, err)
		}
		ldm, ok := m.(*pglogrepl.LogicalDecodingMessage)
		if !ok || !ldm.Transactional || ldm.Prefix != prefix {
			continue
		}
		env, err := walenv.Decode(ldm.Content)
		if err != nil {
			return u, fmt.Errorf("pgwal: peek slot %s: message at %s: %w", a.cfg.Slot, ldm.LSN, err)
		}
		t := time.UnixMilli(env.CreatedAtMs)
		if u.Messages == 0 || t.Before(u.Oldest) {
			u.Oldest = t
		}
		if t.After(u.Newest) {
			u.Newest = t
		}
		u.Messages++
		if env.Key != nil {
			keys[string(env.Key)] = true
		}
	}
	u.Keys = int64(len(keys))
	return u, rows.Err()
}

// ErrSlotHasMessages is wrapped by every *SlotHasMessagesError.
var ErrSlotHasMessages = errors.New("pgwal: the replication slot holds unpublished messages")

// SlotHasMessagesError is DropSlot's refusal to drop a slot that holds
// messages no reader has confirmed: dropping it loses them.
type SlotHasMessagesError struct {
	Slot          string
	Unconfirmed   Unconfirmed
	RetainedBytes int64
}

func (e *SlotHasMessagesError) Error() string {
	u := e.Unconfirmed
	return fmt.Sprintf("pgwal: refusing to drop slot %s: it holds %d unpublished message(s) of %d key(s), written %s to %s (%d bytes of WAL retained); "+
		"dropping it loses them for good. Run a reader until they are published, or drop with force to lose them",
		e.Slot, u.Messages, u.Keys, u.Oldest.UTC().Format(time.RFC3339Nano), u.Newest.UTC().Format(time.RFC3339Nano), e.RetainedBytes)
}

// Unwrap returns ErrSlotHasMessages.
func (e *SlotHasMessagesError) Unwrap() error { return ErrSlotHasMessages }

// DropSlot drops the slot, its publication and its lease row, so that the
// next reader (or EnsureSlot) creates it afresh from the current position.
// It refuses, with a *SlotHasMessagesError saying what would be lost, when
// the slot holds messages not yet confirmed, unless force; it fails with
// ErrSlotActive while a reader is connected. A slot that is missing
// (ErrSlotMissing) or invalidated (wal_status lost: its messages cannot
// be read any more) is refused unless force; with force its publication
// and lease row are deleted (and an invalidated slot dropped), which
// acknowledges the loss a *SlotLostError reported. A slot of this name
// that belongs to another database (or is not a pgoutput logical slot)
// is never dropped, even with force: it fails with a *SlotForeignError.
// It returns what the slot held, when it could be read.
func (a *Admin) DropSlot(ctx context.Context, force bool) (Unconfirmed, error) {
	var u Unconfirmed
	st, err := ReadSlotStatus(ctx, a.db, a.cfg.Slot)
	if err != nil {
		return u, fmt.Errorf("pgwal: read slot status: %w", err)
	}
	switch {
	case st.foreign(a.cfg.Slot) != nil:
		// Even with force: the slot is not this outbox's.
		return u, st.foreign(a.cfg.Slot)
	case !st.Exists && !force:
		return u, fmt.Errorf("%w: %s; with force, its publication and lease row are deleted so that the slot is created afresh", ErrSlotMissing, a.cfg.Slot)
	case st.Active:
		return u, fmt.Errorf("%w: %s: stop the readers first", ErrSlotActive, a.cfg.Slot)
	case st.Exists && st.WALStatus == "lost" && !force:
		return u, fmt.Errorf("pgwal: slot %s was invalidated (wal_status lost): the messages it held cannot be read any more; drop it with force", a.cfg.Slot)
	case st.Exists && st.WALStatus != "lost":
		if u, err = a.Unconfirmed(ctx); err != nil {
			return u, err
		}
		if u.Messages > 0 && !force {
			return u, &SlotHasMessagesError{Slot: a.cfg.Slot, Unconfirmed: u, RetainedBytes: st.RetainedBytes}
		}
	}
	db := a.db.WithContext(ctx)
	if st.Exists {
		if err := db.Exec("SELECT pg_drop_replication_slot(?)", a.cfg.Slot).Error; err != nil {
			if strings.Contains(err.Error(), "is active") {
				return u, fmt.Errorf("%w: %s: %w", ErrSlotActive, a.cfg.Slot, err)
			}
			return u, fmt.Errorf("pgwal: drop slot %s: %w", a.cfg.Slot, err)
		}
	}
	if err := db.Exec("DROP PUBLICATION IF EXISTS " + a.cfg.Slot).Error; err != nil {
		return u, fmt.Errorf("pgwal: drop publication %s: %w", a.cfg.Slot, err)
	}
	if db.Migrator().HasTable(a.cfg.LeaseTable) {
		if err := db.Exec("DELETE FROM "+db.Statement.Quote(a.cfg.LeaseTable)+" WHERE slot = ?", a.cfg.Slot).Error; err != nil {
			return u, fmt.Errorf("pgwal: delete the lease of slot %s: %w", a.cfg.Slot, err)
		}
	}
	return u, nil
}

var _ ops.WALOperator = (*Admin)(nil)
