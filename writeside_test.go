package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// Order is the business model of the write-side tests.
type Order struct {
	ID     uint64 `gorm:"primaryKey"`
	Status string `gorm:"size:32"`
	Total  int
}

// Evented is implemented by models that announce themselves; rules can
// be registered for the interface.
type Evented interface{ EventTopic() string }

type Invoice struct {
	ID     uint64 `gorm:"primaryKey"`
	Amount int
}

func (*Invoice) EventTopic() string { return "invoices" }

type wbundle struct {
	db     *gorm.DB
	dbt    *dbtest.DB
	plugin *outbox.Plugin
}

// setupWrite opens an isolated database of the dialect with the outbox
// plugin and the test models migrated.
func setupWrite(t *testing.T, dbt *dbtest.DB, cfg outbox.Config) *wbundle {
	t.Helper()
	p, err := outbox.NewPlugin(cfg)
	require.NoError(t, err)
	require.NoError(t, dbt.DB.Use(p))
	require.NoError(t, p.AutoMigrate(context.Background(), dbt.DB))
	require.NoError(t, dbt.DB.AutoMigrate(&Order{}, &Invoice{}))
	return &wbundle{db: dbt.DB, dbt: dbt, plugin: p}
}

func (b *wbundle) rows(t *testing.T) []outbox.MessageRow {
	t.Helper()
	var rows []outbox.MessageRow
	require.NoError(t, b.db.Table(b.plugin.Config().Tables.MessagesTable()).Order("id").Find(&rows).Error)
	return rows
}

func (b *wbundle) orders(t *testing.T) int64 {
	t.Helper()
	var n int64
	require.NoError(t, b.db.Model(&Order{}).Count(&n).Error)
	return n
}

func (b *wbundle) taken() ([]int, bool) { return b.plugin.Notifier().Take(nil) }

// orderRules emits one message per insert, status change and delete of
// an Order, keyed by the order id.
func orderRules() []outbox.Rule {
	return []outbox.Rule{
		outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			if c.Entity.Status == "reject" {
				return nil, errors.New("rejected by rule")
			}
			return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte("placed:" + strconv.FormatUint(c.Entity.ID, 10))}, nil
		}),
		outbox.OnUpdate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			if !c.HasChanged("status") {
				return nil, nil
			}
			old := "?"
			if c.Before != nil {
				old = c.Before.Status
			}
			return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte("status:" + old + "->" + c.Entity.Status)}, nil
		}),
		outbox.OnDelete(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte(fmt.Sprintf("cancelled:%d:keyonly=%v", c.Entity.ID, c.KeyOnly))}, nil
		}),
	}
}

func key(id uint64) []byte { return []byte(strconv.FormatUint(id, 10)) }

func bucketOf(k []byte) int { return outbox.Bucket(k, nil, "", outbox.BucketCountDefault) }

func values(rows []outbox.MessageRow) []string {
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = string(r.Value)
	}
	return out
}

func TestRuleOnCreateCommitsWithTheWrite(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})

		o := Order{Status: "new", Total: 10}
		require.NoError(t, b.db.Create(&o).Error)
		require.NotZero(t, o.ID)

		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, "placed:"+strconv.FormatUint(o.ID, 10), string(rows[0].Value), "the rule sees the generated key")
		require.Equal(t, key(o.ID), rows[0].Key)
		require.Equal(t, int32(bucketOf(key(o.ID))), rows[0].Bucket)
		require.Len(t, rows[0].MessageID, 36)

		got, unknown := b.taken()
		require.Equal(t, []int{bucketOf(key(o.ID))}, got, "exactly the touched bucket")
		require.False(t, unknown)
		got, _ = b.taken()
		require.Empty(t, got, "notified once")
	})
}

func TestRuleErrorRollsBackTheWrite(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})

		err := b.db.Create(&Order{Status: "reject"}).Error
		var re *outbox.RuleError
		require.ErrorAs(t, err, &re)
		require.Equal(t, outbox.Insert, re.Operation)
		require.Zero(t, b.orders(t), "the business row is rolled back with the rule's error")
		require.Empty(t, b.rows(t))
		got, _ := b.taken()
		require.Empty(t, got, "no notification for a rollback")
	})
}

func TestTransactionCommitAndRollback(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})

		// Rolled back: neither the order nor any message survives.
		boom := errors.New("boom")
		err := b.db.Transaction(func(tx *gorm.DB) error {
			require.NoError(t, tx.Create(&Order{Status: "new"}).Error)
			require.NoError(t, outbox.Enqueue(tx, &outbox.Message{Topic: "audit", Key: []byte("k")}))
			return boom
		})
		require.ErrorIs(t, err, boom)
		require.Zero(t, b.orders(t))
		require.Empty(t, b.rows(t))
		got, _ := b.taken()
		require.Empty(t, got)

		// Committed: both messages, and the notification only after COMMIT.
		var o Order
		err = b.db.Transaction(func(tx *gorm.DB) error {
			require.NoError(t, tx.Create(&o).Error)
			require.NoError(t, outbox.Enqueue(tx, &outbox.Message{Topic: "audit", Key: []byte("k")}))
			early, _ := b.taken()
			require.Empty(t, early, "never notified before commit")
			return nil
		})
		require.NoError(t, err)
		require.Len(t, b.rows(t), 2)
		got, _ = b.taken()
		require.ElementsMatch(t, dedup(bucketOf(key(o.ID)), bucketOf([]byte("k"))), got)
	})
}

func dedup(bs ...int) []int {
	seen := map[int]bool{}
	var out []int
	for _, b := range bs {
		if !seen[b] {
			seen[b] = true
			out = append(out, b)
		}
	}
	return out
}

func TestManualBeginCommitRollback(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})

		tx := b.db.Begin()
		require.NoError(t, tx.Error)
		require.NoError(t, tx.Create(&Order{Status: "new"}).Error)
		require.NoError(t, tx.Rollback().Error)
		require.Empty(t, b.rows(t))
		got, _ := b.taken()
		require.Empty(t, got)

		tx = b.db.Begin()
		o := Order{Status: "new"}
		require.NoError(t, tx.Create(&o).Error)
		early, _ := b.taken()
		require.Empty(t, early)
		require.NoError(t, tx.Commit().Error)
		require.Len(t, b.rows(t), 1)
		got, _ = b.taken()
		require.Equal(t, []int{bucketOf(key(o.ID))}, got)
	})
}

// keysInDistinctBuckets returns two keys that hash to different buckets.
func keysInDistinctBuckets() ([]byte, []byte) {
	a := []byte("key-a")
	for i := 0; ; i++ {
		k := []byte("key-" + strconv.Itoa(i))
		if bucketOf(k) != bucketOf(a) {
			return a, k
		}
	}
}

func TestSavepointRollbackDropsItsBuckets(t *testing.T) {
	t.Parallel()
	for _, prepared := range []bool{false, true} {
		t.Run(fmt.Sprintf("prepared=%v", prepared), func(t *testing.T) {
			t.Parallel()
			dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
				b := setupWrite(t, dbt, outbox.Config{})
				db := b.db.Session(&gorm.Session{PrepareStmt: prepared})
				ka, kb := keysInDistinctBuckets()
				nested := errors.New("nested fails")
				err := db.Transaction(func(tx *gorm.DB) error {
					require.NoError(t, outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: ka, Value: []byte("kept")}))
					err := tx.Transaction(func(tx2 *gorm.DB) error {
						require.NoError(t, outbox.Enqueue(tx2, &outbox.Message{Topic: "t", Key: kb, Value: []byte("dropped")}))
						return nested
					})
					require.ErrorIs(t, err, nested)
					// A nested transaction that succeeds keeps its bucket.
					return tx.Transaction(func(tx3 *gorm.DB) error {
						return outbox.Enqueue(tx3, &outbox.Message{Topic: "t", Key: ka, Value: []byte("kept2")})
					})
				})
				require.NoError(t, err)
				require.Equal(t, []string{"kept", "kept2"}, values(b.rows(t)))
				got, _ := b.taken()
				require.Equal(t, []int{bucketOf(ka)}, got, "the rolled-back savepoint's bucket is not notified")
			})
		})
	}
}

func TestSkipDefaultTransactionStaysAtomic(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		db := b.db.Session(&gorm.Session{SkipDefaultTransaction: true})

		require.Error(t, db.Create(&Order{Status: "reject"}).Error)
		require.Zero(t, b.orders(t), "the plugin opened a transaction, so the rule's error rolled the row back")

		o := Order{Status: "new"}
		require.NoError(t, db.Create(&o).Error)
		require.Equal(t, int64(1), b.orders(t))
		require.Len(t, b.rows(t), 1)
		got, _ := b.taken()
		require.Equal(t, []int{bucketOf(key(o.ID))}, got)

		// A model without rules is left alone: no transaction is forced.
		require.NoError(t, db.Create(&Invoice{Amount: 1}).Error)
	})
}

func TestSkipHooksStillPublishes(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		require.NoError(t, b.db.Session(&gorm.Session{SkipHooks: true}).Create(&Order{Status: "new"}).Error)
		require.Len(t, b.rows(t), 1)
	})
}

func TestBatchCreateOneMessagePerEntity(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		batch := []Order{{Status: "a"}, {Status: "b"}, {Status: "c"}}
		require.NoError(t, b.db.Create(&batch).Error)
		more := make([]*Order, 5)
		for i := range more {
			more[i] = &Order{Status: "m"}
		}
		require.NoError(t, b.db.CreateInBatches(more, 2).Error)

		var want []string
		for _, o := range batch {
			want = append(want, "placed:"+strconv.FormatUint(o.ID, 10))
		}
		for _, o := range more {
			want = append(want, "placed:"+strconv.FormatUint(o.ID, 10))
		}
		require.Equal(t, want, values(b.rows(t)), "every entity with its own generated key, in write order")
	})
}

func TestUpdateRulesSeeChangedColumnsAndBefore(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		o := Order{Status: "new", Total: 1}
		require.NoError(t, b.db.Create(&o).Error)
		id := strconv.FormatUint(o.ID, 10)

		require.NoError(t, b.db.Model(&o).Update("status", "paid").Error)                    // one column
		require.NoError(t, b.db.Model(&o).Update("total", 5).Error)                          // status untouched: no event
		require.NoError(t, b.db.Model(&o).Updates(map[string]any{"status": "packed"}).Error) // map
		require.NoError(t, b.db.Model(&o).Updates(Order{Status: "shipped"}).Error)           // struct
		o.Status = "done"
		require.NoError(t, b.db.Save(&o).Error) // Save: previous values unknown
		require.NoError(t, b.db.Model(&Order{ID: 987654}).Update("status", "x").Error)

		require.Equal(t, []string{
			"placed:" + id,
			"status:new->paid",
			"status:paid->packed",
			"status:packed->shipped",
			"status:?->done",
		}, values(b.rows(t)), "an update that hits no row publishes nothing")
	})
}

func TestDeleteRules(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		os := []Order{{Status: "a"}, {Status: "b"}, {Status: "c"}, {Status: "d"}}
		require.NoError(t, b.db.Create(&os).Error)
		require.NoError(t, b.db.Table(b.plugin.Config().Tables.MessagesTable()).Where("1 = 1").Delete(&outbox.MessageRow{}).Error)

		require.NoError(t, b.db.Delete(&os[0]).Error)                       // the loaded entity
		require.NoError(t, b.db.Delete(&Order{}, os[1].ID).Error)           // by primary key: the row is read
		require.NoError(t, b.db.Delete(&Order{}, []uint64{os[2].ID}).Error) // by key list
		require.NoError(t, b.db.Delete(&Order{ID: 424242}).Error)           // hits nothing
		res := b.db.Where("status = ?", "d").Delete(&Order{})               // by condition, per row
		require.NoError(t, res.Error)
		require.Equal(t, int64(1), res.RowsAffected)
		require.Zero(t, b.orders(t))

		require.Equal(t, []string{
			fmt.Sprintf("cancelled:%d:keyonly=false", os[0].ID),
			fmt.Sprintf("cancelled:%d:keyonly=false", os[1].ID),
			fmt.Sprintf("cancelled:%d:keyonly=false", os[2].ID),
			fmt.Sprintf("cancelled:%d:keyonly=false", os[3].ID),
		}, values(b.rows(t)))

		// An entity that knows only its key is deleted by it, unread.
		o := Order{Status: "e"}
		require.NoError(t, b.db.Create(&o).Error)
		require.NoError(t, b.db.Delete(&Order{ID: o.ID}).Error)
		require.Equal(t, fmt.Sprintf("cancelled:%d:keyonly=true", o.ID), values(b.rows(t))[5])
	})
}

func TestBulkRulesOptIn(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		var mu sync.Mutex
		var seen []outbox.Change[*Order]
		rule := outbox.On(outbox.Update|outbox.Delete, func(c outbox.Change[*Order]) (*outbox.Message, error) {
			mu.Lock()
			seen = append(seen, c)
			mu.Unlock()
			if !c.Bulk {
				return nil, nil
			}
			return &outbox.Message{Topic: "orders-bulk", Value: []byte(fmt.Sprintf("%s:%d", c.Op, c.RowsAffected))}, nil
		}, outbox.AllowBulk())
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})
		require.NoError(t, b.db.Create(&[]Order{{Status: "x"}, {Status: "x"}, {Status: "y"}}).Error)

		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "x").Update("status", "z").Error)
		require.NoError(t, b.db.Where("status = ?", "z").Delete(&Order{}).Error)
		require.Equal(t, []string{"update:2", "delete:2"}, values(b.rows(t)))
		require.Len(t, seen, 2)
		require.Nil(t, seen[0].Entity)
		require.Equal(t, []string{"status"}, seen[0].Changed)
	})
}

// An upsert whose keys the database generates inserts: every entity gets
// an Insert with its generated key (see also fidelity_test.go).
func TestUpsertsWithGeneratedKeysAreInserts(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		batch := []Order{{Status: "a"}, {Status: "b"}}
		require.NoError(t, b.db.Clauses(clause.OnConflict{UpdateAll: true}).Create(&batch).Error)
		one := Order{Status: "c"}
		require.NoError(t, b.db.Clauses(clause.OnConflict{UpdateAll: true}).Create(&one).Error)
		require.NoError(t, b.db.Clauses(clause.OnConflict{UpdateAll: true}).Create(&Order{ID: 77, Status: "a"}).Error)
		want := []string{}
		for _, o := range append(batch, one) {
			require.NotZero(t, o.ID)
			want = append(want, "placed:"+strconv.FormatUint(o.ID, 10))
		}
		require.Equal(t, append(want, "placed:77"), values(b.rows(t)))
		require.Equal(t, int64(4), b.orders(t))
	})
}

func TestInterfaceRules(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		rule := outbox.OnCreate(func(c outbox.Change[Evented]) (*outbox.Message, error) {
			return &outbox.Message{Topic: c.Entity.EventTopic(), Value: []byte("created")}, nil
		})
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})
		require.NoError(t, b.db.Create(&Invoice{Amount: 3}).Error)
		require.NoError(t, b.db.Create(&Order{Status: "no rule"}).Error)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, "invoices", rows[0].Topic)
		require.Nil(t, rows[0].Key, "keyless")
	})
}

func TestRuleSeesItsTransaction(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		rule := outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			var n int64
			if err := c.Tx.Model(&Order{}).Where("id = ?", c.Entity.ID).Count(&n).Error; err != nil {
				return nil, err
			}
			return &outbox.Message{Topic: "orders", Value: []byte(strconv.FormatInt(n, 10))}, nil
		})
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})
		require.NoError(t, b.db.Create(&Order{Status: "n"}).Error)
		require.Equal(t, []string{"1"}, values(b.rows(t)), "the rule runs inside the write's transaction")
	})
}

func TestEnqueueOutsideTransaction(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{})
		err := outbox.Enqueue(b.db, &outbox.Message{Topic: "t", Value: []byte("x")})
		require.ErrorIs(t, err, outbox.ErrNoTransaction)
		require.Empty(t, b.rows(t))
	})
}

func TestEnqueueStoresBytesFaithfully(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{})
		p := int32(3)
		big := []byte(strings.Repeat("v", 200_000)) // over MySQL's 64 KiB BLOB
		msgs := []*outbox.Message{
			{Topic: "t", Key: nil, Value: []byte("keyless")},
			{Topic: "t", Key: []byte{}, Value: []byte("empty key")},
			{Topic: "t", Key: []byte("k"), Value: nil},
			{Topic: "t", Key: []byte("k"), Value: big, Partition: &p,
				Headers: []outbox.Header{{Key: "a", Value: []byte("1")}, {Key: "a", Value: nil}, {Key: "b", Value: []byte{}}}},
		}
		require.NoError(t, b.db.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, msgs...) }))
		rows := b.rows(t)
		require.Len(t, rows, 4)
		require.Nil(t, rows[0].Key)
		require.NotNil(t, rows[1].Key)
		require.Empty(t, rows[1].Key)
		require.Nil(t, rows[2].Value, "tombstone")
		require.Equal(t, big, rows[3].Value)
		require.Equal(t, int32(3), *rows[3].Partition)
		require.Equal(t, int32(outbox.Bucket(nil, &p, "", 8)), rows[3].Bucket, "pinned messages are bucketed by partition")
		hs, err := outbox.DecodeHeaders(rows[3].Headers)
		require.NoError(t, err)
		require.Equal(t, msgs[3].Headers, hs)
		require.Equal(t, msgs[0].ID, rows[0].MessageID, "Enqueue fills in the id it stored")
		require.Equal(t, int32(outbox.Bucket(nil, nil, msgs[0].ID, 8)), rows[0].Bucket)
	})
}

func TestInvalidMessagesRollBackTheWrite(t *testing.T) {
	t.Parallel()
	neg := int32(-1)
	cases := []struct {
		name string
		msg  outbox.Message
		want error
	}{
		{"invalid topic", outbox.Message{Topic: "bad topic!"}, outbox.ErrInvalidMessage},
		{"dot topic", outbox.Message{Topic: ".."}, outbox.ErrInvalidMessage},
		{"long topic", outbox.Message{Topic: strings.Repeat("t", 250)}, outbox.ErrInvalidMessage},
		{"too large", outbox.Message{Topic: "t", Value: make([]byte, 1025)}, outbox.ErrInvalidMessage},
		{"negative partition", outbox.Message{Topic: "t", Partition: &neg}, outbox.ErrInvalidMessage},
		{"empty header name", outbox.Message{Topic: "t", Headers: []outbox.Header{{Key: ""}}}, outbox.ErrInvalidMessage},
	}
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{MaxMessageBytes: 1024})
		for _, tc := range cases {
			m := tc.msg
			err := b.db.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Status: tc.name}).Error; err != nil {
					return err
				}
				return outbox.Enqueue(tx, &m)
			})
			require.ErrorIs(t, err, tc.want, tc.name)
			if tc.name == "too large" {
				var tl *outbox.TooLargeError
				require.ErrorAs(t, err, &tl)
				require.Equal(t, m.Size(), tl.Size)
				require.Greater(t, tl.Size, 1025, "framing and the message-id header count, as the producer counts them")
			}
		}
		require.Zero(t, b.orders(t))
		require.Empty(t, b.rows(t))
	})
}

func TestCustomTablesAndTwoOutboxes(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		billing := setupWrite(t, dbt, outbox.Config{Name: "billing", Tables: outbox.WithPrefix("billing_")})
		p2, err := outbox.NewPlugin(outbox.Config{Name: "shipping", Tables: outbox.WithPrefix("shipping_"), BucketCount: 4})
		require.NoError(t, err)
		require.NoError(t, dbt.DB.Use(p2))
		require.NoError(t, p2.AutoMigrate(context.Background(), dbt.DB))

		err = dbt.DB.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, &outbox.Message{Topic: "t"}) })
		require.ErrorIs(t, err, outbox.ErrAmbiguousPlugin)

		require.NoError(t, dbt.DB.Transaction(func(tx *gorm.DB) error {
			if err := billing.plugin.Enqueue(tx, &outbox.Message{Topic: "b", Key: []byte("x")}); err != nil {
				return err
			}
			return p2.Enqueue(tx, &outbox.Message{Topic: "s", Key: []byte("x")}, &outbox.Message{Topic: "s", Key: []byte("y")})
		}))
		require.Len(t, billing.rows(t), 1)
		var n int64
		require.NoError(t, dbt.DB.Table("shipping_outbox_messages").Count(&n).Error)
		require.Equal(t, int64(2), n)
		got, _ := billing.taken()
		require.Equal(t, []int{bucketOf([]byte("x"))}, got)
		got2, _ := p2.Notifier().Take(nil)
		require.ElementsMatch(t, dedup(outbox.Bucket([]byte("x"), nil, "", 4), outbox.Bucket([]byte("y"), nil, "", 4)), got2)
		found, err := outbox.Lookup(dbt.DB, "shipping")
		require.NoError(t, err)
		require.Same(t, p2, found)
	})
}

func TestHostileConfigIsRefused(t *testing.T) {
	t.Parallel()
	for _, cfg := range []outbox.Config{
		{Tables: outbox.Tables{Messages: "outbox; DROP TABLE users"}},
		{Tables: outbox.Tables{Messages: `x"y`}},
		{Tables: outbox.Tables{Schema: "a.b"}},
		{Tables: outbox.Tables{Messages: strings.Repeat("t", 64)}},
		{Tables: outbox.Tables{Messages: "same", Leases: "same"}},
		{BucketCount: -1},
		{BucketCount: 5000},
		{Rules: []outbox.Rule{outbox.OnCreate[Order](func(outbox.Change[Order]) (*outbox.Message, error) { return nil, nil })}},
	} {
		_, err := outbox.NewPlugin(cfg)
		var ce *outbox.ConfigError
		require.ErrorAs(t, err, &ce, "%+v", cfg)
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		require.NotEmpty(t, ce.Field)
	}
}

// sqlRecorder records the statements GORM runs.
type sqlRecorder struct {
	logger.Interface
	mu  sync.Mutex
	sql []string
}

func (r *sqlRecorder) Trace(ctx context.Context, begin time.Time, fc func() (string, int64), err error) {
	s, _ := fc()
	r.mu.Lock()
	r.sql = append(r.sql, s)
	r.mu.Unlock()
}

func TestAutoMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		p, err := outbox.NewPlugin(outbox.Config{Tables: outbox.WithPrefix("mig_")})
		require.NoError(t, err)
		require.NoError(t, dbt.DB.Use(p))
		ctx := context.Background()
		require.NoError(t, p.AutoMigrate(ctx, dbt.DB))

		rec := &sqlRecorder{Interface: logger.Discard}
		require.NoError(t, p.AutoMigrate(ctx, dbt.DB.Session(&gorm.Session{Logger: rec})))
		for _, s := range rec.sql {
			u := strings.ToUpper(s)
			require.False(t, strings.HasPrefix(u, "ALTER") || strings.HasPrefix(u, "CREATE") || strings.HasPrefix(u, "DROP"), "second AutoMigrate ran %q", s)
		}
		for _, table := range []string{"mig_outbox_messages", "mig_outbox_leases", "mig_outbox_relays", "mig_outbox_dead_letters"} {
			require.True(t, dbt.DB.Migrator().HasTable(table), table)
		}
		require.True(t, dbt.DB.Migrator().HasIndex(&outbox.MessageRow{}, "idx_mig_outbox_messages_bucket_id") ||
			dbt.DB.Table("mig_outbox_messages").Migrator().HasIndex(&outbox.MessageRow{}, "idx_mig_outbox_messages_bucket_id"))
	})
}

func TestPrepareStmtAtOpen(t *testing.T) {
	t.Parallel()
	for _, dialect := range dbtest.Dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			dbt := dbtest.Open(t, dialect, dbtest.Options{Config: &gorm.Config{PrepareStmt: true, Logger: logger.Discard}})
			b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
			ka, kb := keysInDistinctBuckets()
			err := b.db.Transaction(func(tx *gorm.DB) error {
				o := Order{Status: "new"}
				if err := tx.Create(&o).Error; err != nil {
					return err
				}
				_ = tx.Transaction(func(tx2 *gorm.DB) error {
					_ = outbox.Enqueue(tx2, &outbox.Message{Topic: "t", Key: kb})
					return errors.New("drop")
				})
				return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: ka})
			})
			require.NoError(t, err)
			rows := b.rows(t)
			require.Len(t, rows, 2)
			got, _ := b.taken()
			require.ElementsMatch(t, dedup(int(rows[0].Bucket), bucketOf(ka)), got)
			sqlDB, err := b.db.DB()
			require.NoError(t, err, "db.DB() still works through the wrapped pool")
			require.NoError(t, sqlDB.Ping())
		})
	}
}

func TestConcurrentCommitsAllNotified(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{BucketCount: 64})
		const writers, each = 4, 10
		var wg sync.WaitGroup
		errs := make(chan error, writers*each)
		for w := 0; w < writers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < each; i++ {
					k := []byte(fmt.Sprintf("w%d-%d", w, i))
					errs <- b.db.Transaction(func(tx *gorm.DB) error {
						return outbox.Enqueue(tx, &outbox.Message{Topic: "t", Key: k})
					})
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		want := map[int]bool{}
		for _, r := range b.rows(t) {
			want[int(r.Bucket)] = true
		}
		select {
		case <-b.plugin.Notifier().Ready():
		default:
			t.Fatal("no wake-up after the commits")
		}
		got, unknown := b.taken()
		require.False(t, unknown)
		require.Len(t, got, len(want))
		for _, g := range got {
			require.True(t, want[g], "bucket %d notified without a row", g)
		}
	})
}

// A batch of large messages is split into statements of a sane size, so
// it stays under MySQL's max_allowed_packet (16 MiB by default) even when
// the whole batch is larger.
func TestLargeBatchIsSplit(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{})
		value := []byte(strings.Repeat("x", 100_000))
		msgs := make([]*outbox.Message, 250) // 25 MB in one transaction
		for i := range msgs {
			msgs[i] = &outbox.Message{Topic: "big", Key: []byte(strconv.Itoa(i)), Value: value}
		}
		require.NoError(t, b.db.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, msgs...) }))
		var n int64
		require.NoError(t, b.db.Table(b.plugin.Config().Tables.MessagesTable()).Count(&n).Error)
		require.Equal(t, int64(len(msgs)), n)
	})
}

func TestAutoMigrateRefusesHostileNames(t *testing.T) {
	t.Parallel()
	dbt := dbtest.Open(t, dbtest.SQLite)
	require.NoError(t, dbt.DB.Exec("CREATE TABLE victims (id INTEGER)").Error)
	tables := outbox.Tables{Messages: "t (id INTEGER); DROP TABLE victims; CREATE TABLE z", Leases: "l", Relays: "r", DeadLetters: "d"}
	err := tables.AutoMigrate(context.Background(), dbt.DB)
	require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	require.True(t, dbt.DB.Migrator().HasTable("victims"), "nothing ran")
}

// queueLimits are the rules of a sink that is not Kafka: topics are
// "queue/" paths (which Kafka refuses: '/' and ':' are not in its
// alphabet) and only the value counts against MaxMessageBytes.
type queueLimits struct{}

func (queueLimits) CheckTopic(topic string) error {
	if !strings.HasPrefix(topic, "queue/") {
		return errors.New(`must start with "queue/"`)
	}
	return nil
}

func (queueLimits) Size(m *outbox.Message) int { return len(m.Value) }

// The sink's Limits decide which topics and sizes Enqueue accepts: a
// custom Limits admits what Kafka's rules refuse and refuses what they
// admit, and counts sizes its own way.
func TestLimitsDecideWhatEnqueueAccepts(t *testing.T) {
	t.Parallel()
	enqueue := func(b *wbundle, m outbox.Message) error {
		return b.db.Transaction(func(tx *gorm.DB) error {
			if err := tx.Create(&Order{Status: m.Topic}).Error; err != nil {
				return err
			}
			return b.plugin.Enqueue(tx, &m)
		})
	}
	// 1000 bytes of value and 200 of header: over 1024 as Kafka counts
	// it, 1000 as the queue sink does.
	headed := func(topic string) outbox.Message {
		return outbox.Message{Topic: topic, Value: make([]byte, 1000), Headers: []outbox.Header{{Key: "h", Value: make([]byte, 200)}}}
	}
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		kafka := setupWrite(t, dbt, outbox.Config{MaxMessageBytes: 1024})
		require.ErrorIs(t, enqueue(kafka, outbox.Message{Topic: "queue/orders:v1"}), outbox.ErrInvalidMessage)
		var tl *outbox.TooLargeError
		require.ErrorAs(t, enqueue(kafka, headed("orders")), &tl)
		require.Empty(t, kafka.rows(t))

		queue := setupWrite(t, dbt, outbox.Config{Name: "queue", Tables: outbox.WithPrefix("queue_"), MaxMessageBytes: 1024, Limits: queueLimits{}})
		require.NoError(t, enqueue(queue, outbox.Message{Topic: "queue/orders:v1"}))
		require.NoError(t, enqueue(queue, headed("queue/orders:v1")), "only the value counts")

		err := enqueue(queue, outbox.Message{Topic: "orders"})
		var me *outbox.MessageError
		require.ErrorAs(t, err, &me)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		require.Equal(t, "Topic", me.Field)
		require.Equal(t, `must start with "queue/"`, me.Reason)

		require.ErrorAs(t, enqueue(queue, outbox.Message{Topic: "queue/big", Value: make([]byte, 1025)}), &tl)
		require.Equal(t, 1025, tl.Size)

		rows := queue.rows(t)
		require.Len(t, rows, 2)
		require.Equal(t, "queue/orders:v1", rows[0].Topic)
		require.Equal(t, "queue/orders:v1", rows[1].Topic)
	})
}

// A rule's message that fits MaxMessageBytes only without the trace
// headers the write's span context adds is refused with a *RuleError
// naming the rule, which wraps the *TooLargeError: the message is
// checked once, trace headers included, where the rule built it.
func TestRuleMessageTooLargeWithItsTraceNamesTheRule(t *testing.T) {
	t.Parallel()
	msg := func() *outbox.Message { return &outbox.Message{Topic: "orders", Value: make([]byte, 40)} }
	tid, err := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	require.NoError(t, err)
	sid, err := trace.SpanIDFromHex("00f067aa0ba902b7")
	require.NoError(t, err)
	ctx := trace.ContextWithSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{MaxMessageBytes: msg().Size() + 20, Rules: []outbox.Rule{
			outbox.OnCreate(func(outbox.Change[*Order]) (*outbox.Message, error) { return msg(), nil }),
		}})
		require.NoError(t, b.db.Create(&Order{Status: "untraced"}).Error, "fits without a trace")
		require.Len(t, b.rows(t), 1)

		err := b.db.WithContext(ctx).Create(&Order{Status: "traced"}).Error
		var re *outbox.RuleError
		require.ErrorAs(t, err, &re)
		require.Equal(t, outbox.Insert, re.Operation)
		require.Contains(t, re.Rule, "*outbox_test.Order")
		var tl *outbox.TooLargeError
		require.ErrorAs(t, err, &tl)
		require.Greater(t, tl.Size, msg().Size()+20, "the trace headers count")
		require.EqualValues(t, 1, b.orders(t), "the traced write is rolled back")
		require.Len(t, b.rows(t), 1)
	})
}

// A rule that returns a message the outbox refuses (an invalid topic)
// fails the write with a *RuleError naming the model and the rule, which
// wraps the *MessageError; the write is rolled back.
func TestRuleInvalidMessageNamesTheRule(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{
			outbox.OnCreate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
				return &outbox.Message{Topic: "orders placed", Key: key(c.Entity.ID)}, nil
			}),
		}})

		err := b.db.Create(&Order{Status: "new"}).Error
		var re *outbox.RuleError
		require.ErrorAs(t, err, &re)
		require.Equal(t, "outbox_test.Order", re.Model)
		require.Equal(t, outbox.Insert, re.Operation)
		require.Contains(t, re.Rule, "*outbox_test.Order")
		var me *outbox.MessageError
		require.ErrorAs(t, err, &me)
		require.Equal(t, "Topic", me.Field)
		require.Equal(t, "orders placed", me.Topic)
		require.ErrorIs(t, err, outbox.ErrInvalidMessage)
		require.ErrorContains(t, err, re.Rule)
		require.ErrorContains(t, err, `outbox: publish rule(*outbox_test.Order on insert) for model outbox_test.Order on insert: outbox: invalid message for topic "orders placed": Topic:`)
		require.Zero(t, b.orders(t), "the write is rolled back")
		require.Empty(t, b.rows(t))
	})
}
