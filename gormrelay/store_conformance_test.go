package gormrelay_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/opstest"
	"github.com/gorm-outbox/outbox/relay"
	"github.com/gorm-outbox/outbox/relay/storetest"
)

// The GORM store passes the relay's store conformance suite on every
// database, with each of its capabilities.
func TestStoreConformance(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		var outboxes atomic.Int32
		tables := map[relay.Store]outbox.Tables{}
		var mu sync.Mutex
		storetest.Run(t, storetest.Harness{
			New: func(t *testing.T, buckets int) relay.Store {
				// Each outbox its own tables in the test's database.
				cfg := outbox.Config{Tables: outbox.WithPrefix(fmt.Sprintf("st%d_", outboxes.Add(1))), BucketCount: buckets}.WithDefaults()
				require.NoError(t, cfg.Tables.AutoMigrate(t.Context(), db.DB))
				s, err := gormrelay.NewStore(db.DB, cfg)
				require.NoError(t, err)
				mu.Lock()
				tables[s] = cfg.Tables
				mu.Unlock()
				return s
			},
			Insert: func(t *testing.T, s relay.Store, msgs []relay.Message) {
				mu.Lock()
				tb := tables[s]
				mu.Unlock()
				rows := make([]outbox.MessageRow, len(msgs))
				for i, m := range msgs {
					rows[i] = outbox.MessageRow{
						MessageID: m.MessageID, Bucket: int32(m.Bucket), Topic: m.Topic,
						Key: m.Key, Value: m.Value, Headers: outbox.EncodeHeaders(m.Headers),
						Partition: m.Partition, CreatedAtMs: m.CreatedAt.UnixMilli(),
					}
				}
				require.NoError(t, db.DB.Table(tb.MessagesTable()).Create(&rows).Error)
			},
		})
	})
}

// The Admin keeps the operator API's contract on every database.
func TestOperatorConformance(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		storetest.RunOperator(t, opstest.Harness(func(t *testing.T, buckets int) *opstest.Backend {
			return opstest.GORM(t, db, outbox.Config{BucketCount: buckets})
		}))
	})
}
