package pgwal

import (
	"context"
	"fmt"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/gorm-outbox/outbox"
)

// RequeueKey puts the dead letters of key (failed and parked) of the WAL
// mode outbox of plugin back into the stream: in one transaction it emits
// them again, in their original commit order, with their message ids, and
// deletes them from the dead-letter table. A running reader publishes them
// after everything committed before, and stops parking the key once its
// dead letters are gone. It returns how many were requeued.
//
// Messages of the key that committed before the requeue but that the
// reader had not reached yet are published as soon as the reader sees
// the key has no dead letters left, so they may precede the requeued
// ones; requeue a key after its writes have quiesced for per-key order.
func RequeueKey(ctx context.Context, db *gorm.DB, plugin *outbox.Plugin, key []byte) (int, error) {
	cfg := plugin.Config()
	if cfg.Mode != outbox.ModeWAL {
		return 0, &outbox.ConfigError{Package: "pgwal", Field: "outbox.Config.Mode", Value: cfg.Mode, Reason: "the outbox must be in ModeWAL"}
	}
	n := 0
	err := db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		var rows []outbox.DeadLetterRow
		// Ids are negated WAL positions: descending id is commit order.
		if err := tx.Table(cfg.Tables.DeadLettersTable()).Where("msg_key = ? AND id < 0", key).
			Order("id DESC").Clauses(lockingClause()).Find(&rows).Error; err != nil {
			return err
		}
		if len(rows) == 0 {
			return nil
		}
		msgs := make([]*outbox.Message, len(rows))
		ids := make([]int64, len(rows))
		for i, r := range rows {
			hs, err := outbox.DecodeHeaders(r.Headers)
			if err != nil {
				return err
			}
			msgs[i] = &outbox.Message{ID: r.MessageID, Topic: r.Topic, Key: r.Key, Value: r.Value, Headers: hs, Partition: r.Partition}
			ids[i] = r.ID
		}
		if err := plugin.Enqueue(tx, msgs...); err != nil {
			return err
		}
		if err := tx.Exec("DELETE FROM "+tx.Statement.Quote(cfg.Tables.DeadLettersTable())+" WHERE id IN ?", ids).Error; err != nil {
			return err
		}
		n = len(rows)
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("pgwal: requeue key: %w", err)
	}
	return n, nil
}

func lockingClause() clause.Locking { return clause.Locking{Strength: clause.LockingStrengthUpdate} }
