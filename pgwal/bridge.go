package pgwal

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/relay"
)

// The bridge (Config.Bridge) relays the rows of the messages table that
// table-mode writers insert, in commit order with the WAL messages: the
// slot's publication includes the messages table (inserts only), the
// reader decodes each insert as a placeholder in its bucket's queue
// holding the row's id, and reads the row when the placeholder reaches
// the head of the queue. A row that is gone by then was published (and
// deleted) by a table-mode relay or by an earlier term of the reader, or
// dead-lettered: it is skipped, and a dead-lettered row quarantines its
// key. A published or dead-lettered row is deleted from the table.

// bridgeRelation is the messages table as the replication stream names
// it.
type bridgeRelation struct {
	oid uint32
	// idCol and bucketCol index the id and bucket columns in the
	// relation's tuples, once a RelationMessage described it.
	idCol, bucketCol int
	known            bool
}

// syncBridge adds the messages table to the slot's publication, inserts
// only, when Config.Bridge is set. It leaves the publication as it is
// otherwise: EndBridge takes the table out.
func (r *Reader) syncBridge(ctx context.Context) error {
	if !r.cfg.Bridge {
		return nil
	}
	in, err := r.bridged(ctx)
	if err != nil || in {
		return err
	}
	db := r.sess(ctx)
	if err := db.Exec("ALTER PUBLICATION " + r.cfg.Slot + " ADD TABLE " + db.Statement.Quote(r.ocfg.Tables.Messages)).Error; err != nil && !isDuplicate(err) {
		return fmt.Errorf("pgwal: add %s to publication %s: %w", r.ocfg.Tables.Messages, r.cfg.Slot, err)
	}
	if err := db.Exec("ALTER PUBLICATION " + r.cfg.Slot + " SET (publish = 'insert')").Error; err != nil {
		return fmt.Errorf("pgwal: publication %s: %w", r.cfg.Slot, err)
	}
	return nil
}

// bridged reports whether the slot's publication includes the messages
// table.
func (r *Reader) bridged(ctx context.Context) (bool, error) {
	var n int64
	db := r.sess(ctx)
	err := db.Raw("SELECT count(*) FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid"+
		" WHERE p.pubname = ? AND pr.prrelid = to_regclass(?)", r.cfg.Slot, db.Statement.Quote(r.ocfg.Tables.Messages)).Scan(&n).Error
	if err != nil {
		return false, fmt.Errorf("pgwal: read publication %s: %w", r.cfg.Slot, err)
	}
	return n > 0, nil
}

// EndBridge takes the messages table out of the slot's publication: rows
// inserted after it returns are not relayed by the reader. Call it once
// no writer is in table mode any more (every writer in outbox.ModeWAL);
// the rows inserted before are still relayed by a bridging reader.
func (r *Reader) EndBridge(ctx context.Context) error {
	in, err := r.bridged(ctx)
	if err != nil || !in {
		return err
	}
	db := r.sess(ctx)
	if err := db.Exec("ALTER PUBLICATION " + r.cfg.Slot + " DROP TABLE " + db.Statement.Quote(r.ocfg.Tables.Messages)).Error; err != nil {
		return fmt.Errorf("pgwal: drop %s from publication %s: %w", r.ocfg.Tables.Messages, r.cfg.Slot, err)
	}
	return nil
}

func (r *Reader) sess(ctx context.Context) *gorm.DB {
	return r.db.WithContext(ctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
}

// ErrTableRelaysRunning is the error of a bridging reader's term while a
// table-mode relay holds bucket leases: two publishers of the table's
// rows would not keep commit order, so the reader does not read until the
// table relays stopped, and Run retries.
var ErrTableRelaysRunning = errors.New("pgwal: a table-mode relay holds bucket leases; a bridging reader reads once the table relays stopped")

// bridgeOID returns the messages table's oid, 0 when the reader does not
// bridge. A bridging reader does not read while a table relay runs.
func (r *Reader) bridgeOID(ctx context.Context) (uint32, error) {
	if !r.cfg.Bridge {
		return 0, nil
	}
	if stopped, err := r.TableRelaysStopped(ctx); err != nil || !stopped {
		return 0, errors.Join(ErrTableRelaysRunning, err)
	}
	var oid *int64
	db := r.sess(ctx)
	if err := db.Raw("SELECT to_regclass(?)::oid::bigint", db.Statement.Quote(r.ocfg.Tables.Messages)).Scan(&oid).Error; err != nil {
		return 0, fmt.Errorf("pgwal: find table %s: %w", r.ocfg.Tables.Messages, err)
	}
	if oid == nil {
		return 0, &relay.MisconfigurationError{Setting: "pgwal.Config.Bridge", Reason: fmt.Sprintf("the messages table %s does not exist (plugin.AutoMigrate)", r.ocfg.Tables.Messages)}
	}
	return uint32(*oid), nil
}

// checkTableRelays ends a bridging term when a table-mode relay took
// bucket leases while the reader reads: the reader stops publishing (its
// next term waits for the table relays to stop) and says so loudly, as
// the relay may publish a key's table row before an earlier WAL message.
// A failed check is logged and ignored.
func (s *stream) checkTableRelays(ctx context.Context) error {
	if s.rel.oid == 0 {
		return nil
	}
	stopped, err := s.r.TableRelaysStopped(ctx)
	if err != nil {
		s.r.log.Warn("pgwal: checking for table relays failed", "err", err)
		return nil
	}
	if stopped {
		return nil
	}
	s.r.log.Error("pgwal: a table-mode relay started while the reader bridges the messages table; the reader stops reading until it stopped. " +
		"Per-key order may be broken for the keys that relay publishes: stop the table relays until the switch is over (docs/wal-mode.md)")
	return ErrTableRelaysRunning
}

// decodeRelation notes where the messages table's id and bucket are in
// its tuples.
func (s *stream) decodeRelation(m *pglogrepl.RelationMessage) {
	if s.rel.oid == 0 || m.RelationID != s.rel.oid {
		return
	}
	s.rel.idCol, s.rel.bucketCol = -1, -1
	for i, c := range m.Columns {
		switch c.Name {
		case "id":
			s.rel.idCol = i
		case "bucket":
			s.rel.bucketCol = i
		}
	}
	s.rel.known = s.rel.idCol >= 0 && s.rel.bucketCol >= 0
}

// decodeInsert queues a placeholder for a row inserted into the messages
// table.
func (s *stream) decodeInsert(m *pglogrepl.InsertMessage) error {
	if s.rel.oid == 0 || m.RelationID != s.rel.oid {
		return nil
	}
	if !s.rel.known || m.Tuple == nil || len(m.Tuple.Columns) <= max(s.rel.idCol, s.rel.bucketCol) {
		return &relay.MisconfigurationError{Setting: "pgwal.Config.Bridge", Reason: fmt.Sprintf("an insert into %s at %s lacks its id or bucket", s.r.ocfg.Tables.Messages, s.txnCommit)}
	}
	id, err1 := strconv.ParseInt(string(m.Tuple.Columns[s.rel.idCol].Data), 10, 64)
	bucket, err2 := strconv.Atoi(string(m.Tuple.Columns[s.rel.bucketCol].Data))
	if err1 != nil || err2 != nil {
		return &relay.MisconfigurationError{Setting: "pgwal.Config.Bridge", Reason: fmt.Sprintf("an insert into %s at %s: unreadable id or bucket", s.r.ocfg.Tables.Messages, s.txnCommit)}
	}
	if bucket < 0 || bucket >= len(s.buckets) {
		return &relay.MisconfigurationError{Setting: "BucketCount", Reason: fmt.Sprintf(
			"row %d of %s is in bucket %d, outside 0..%d: a writer uses a larger BucketCount; use one BucketCount everywhere", id, s.r.ocfg.Tables.Messages, bucket, len(s.buckets)-1)}
	}
	s.txn = append(s.txn, entry{commit: s.txnCommit, bridged: true, xid: s.txnXid, msg: relay.Message{ID: id, Bucket: bucket, Position: uint64(s.txnCommit)}})
	s.r.received.Add(1)
	return nil
}

// loadBridged reads the rows of the bridged placeholders in es, the
// leading entries of q. It returns the entries to publish, cut before the
// first row that is gone, and the number of leading entries whose rows
// are gone (to drop from q). A transaction's commit record can be decoded
// a moment before the transaction becomes visible to other sessions:
// when the head row is missing and its transaction is not visible yet,
// it returns no entry and nothing gone, to be called again.
func (s *stream) loadBridged(ctx context.Context, q *bucketQ, es []entry) ([]entry, int, error) {
	var ids []int64
	for _, e := range es {
		if e.bridged {
			ids = append(ids, e.msg.ID)
		}
	}
	if len(ids) == 0 {
		return es, 0, nil
	}
	var rows []outbox.MessageRow
	if err := s.r.sess(ctx).Table(s.r.ocfg.Tables.Messages).Where("id IN ?", ids).Find(&rows).Error; err != nil {
		return nil, 0, fmt.Errorf("pgwal: read bridged rows: %w", err)
	}
	byID := make(map[int64]*outbox.MessageRow, len(rows))
	for i := range rows {
		byID[rows[i].ID] = &rows[i]
	}
	for i := range es {
		if !es[i].bridged {
			continue
		}
		row := byID[es[i].msg.ID]
		if row == nil {
			if i > 0 {
				return es[:i], 0, nil
			}
			if visible, err := s.visible(ctx, es[0].xid); err != nil || !visible {
				return nil, 0, err
			}
			// Visible now: read the rows again, as a read before the
			// transaction became visible missed them.
			var again int64
			if err := s.r.sess(ctx).Table(s.r.ocfg.Tables.Messages).Where("id = ?", es[0].msg.ID).Count(&again).Error; err != nil {
				return nil, 0, fmt.Errorf("pgwal: read bridged rows: %w", err)
			}
			if again > 0 {
				return nil, 0, nil
			}
			gone := 1
			for gone < len(es) && es[gone].bridged && byID[es[gone].msg.ID] == nil {
				gone++
			}
			return nil, gone, s.quarantineDead(ctx, q, es[:gone])
		}
		hs, err := outbox.DecodeHeaders(row.Headers)
		if err != nil {
			return nil, 0, &relay.MisconfigurationError{Setting: "pgwal.Config.Bridge", Reason: fmt.Sprintf("row %d of %s: %v", row.ID, s.r.ocfg.Tables.Messages, err), Err: err}
		}
		es[i].msg = relay.Message{ID: row.ID, MessageID: row.MessageID, Bucket: int(row.Bucket), Topic: row.Topic, Key: row.Key, Value: row.Value,
			Headers: hs, Partition: row.Partition, CreatedAt: time.UnixMilli(row.CreatedAtMs), Attempts: int(row.Attempts),
			Position: uint64(es[i].commit)}
	}
	return es, 0, nil
}

// visible reports whether the transaction xid (32 bits, of a recent
// commit) is visible to a new snapshot: it is no longer in progress.
func (s *stream) visible(ctx context.Context, xid uint32) (bool, error) {
	var ok bool
	err := s.r.sess(ctx).Raw(`WITH c AS (SELECT pg_current_snapshot() AS snap, pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax)
SELECT pg_visible_in_snapshot(((((xmax >> 32) - CASE WHEN ?::bigint > (xmax & 4294967295) THEN 1 ELSE 0 END) << 32) | ?::bigint)::text::xid8, snap) FROM c`,
		int64(xid), int64(xid)).Scan(&ok).Error
	if err != nil {
		return false, fmt.Errorf("pgwal: read the visibility of transaction %d: %w", xid, err)
	}
	return ok, nil
}

// quarantineDead quarantines the keys of the gone rows es that a
// table-mode relay dead-lettered, so that their later messages are
// parked behind them.
func (s *stream) quarantineDead(ctx context.Context, q *bucketQ, es []entry) error {
	ids := make([]int64, len(es))
	for i, e := range es {
		ids[i] = e.msg.ID
	}
	var keys [][]byte
	db := s.r.sess(ctx)
	if err := db.Table(s.r.dead).Where("id IN ? AND msg_key IS NOT NULL", ids).Pluck("msg_key", &keys).Error; err != nil {
		return fmt.Errorf("pgwal: read dead letters: %w", err)
	}
	for _, k := range keys {
		q.quarantined[string(k)] = struct{}{}
	}
	return nil
}

// deleteBridged deletes the bridged rows of ids, published
// or dead-lettered. A failure leaves them for a table-mode relay to
// publish again: a duplicate, not a loss.
func (s *stream) deleteBridged(ctx context.Context, ids []int64) {
	if len(ids) == 0 {
		return
	}
	if err := s.r.sess(ctx).Table(s.r.ocfg.Tables.Messages).Where("id IN ?", ids).Delete(&outbox.MessageRow{}).Error; err != nil {
		s.r.log.Warn("pgwal: deleting bridged rows failed; a table-mode relay may publish them again", "count", len(ids), "err", err)
	}
}
