package pgwal

import (
	"context"
	"fmt"
	"hash/fnv"

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
	var groups map[int]int64
	err := db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		var err error
		groups, err = emitDead(tx, plugin, key, nil)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("pgwal: requeue key: %w", err)
	}
	n := 0
	for _, c := range groups {
		n += int(c)
	}
	return n, nil
}

func lockingClause() clause.Locking { return clause.Locking{Strength: clause.LockingStrengthUpdate} }

// lockKey takes, in tx, the transaction-scoped advisory lock of key in
// the dead-letter table: a requeue of the key and the reader's parking of
// its messages take it first, so the reader never parks a message behind
// dead letters a requeue has just emitted again (it would park the
// requeued copies too, and the key would stay quarantined with nothing
// failing).
func lockKey(tx *gorm.DB, table string, key []byte) error {
	h := fnv.New64a()
	h.Write([]byte(table))
	h.Write([]byte{0})
	h.Write(key)
	return tx.Exec("SELECT pg_advisory_xact_lock(?)", int64(h.Sum64())).Error
}
