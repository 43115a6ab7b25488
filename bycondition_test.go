package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// OrderLite is a second struct mapped to the table of Order.
type OrderLite struct {
	ID     uint64 `gorm:"primaryKey"`
	Status string `gorm:"size:32"`
}

func (OrderLite) TableName() string { return "orders" }

// Ticket has a soft delete.
type Ticket struct {
	ID        uint64 `gorm:"primaryKey"`
	Status    string `gorm:"size:32"`
	DeletedAt gorm.DeletedAt
}

// rowRules publishes every insert, update and delete of an Order as
// "op:id:status:total", with "<-before status" for updates.
func rowRules(opts ...outbox.RuleOption) []outbox.Rule {
	return []outbox.Rule{
		outbox.On(outbox.Insert|outbox.Update|outbox.Delete, func(c outbox.Change[*Order]) (*outbox.Message, error) {
			if c.Entity.Status == "fail" {
				return nil, errors.New("rule refuses fail")
			}
			v := fmt.Sprintf("%s:%d:%s:%d", c.Op, c.Entity.ID, c.Entity.Status, c.Entity.Total)
			if c.Op == outbox.Update && c.Before != nil {
				v += "<-" + c.Before.Status
			}
			return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte(v)}, nil
		}, opts...),
		outbox.On(outbox.Insert|outbox.Update|outbox.Delete, func(c outbox.Change[*Ticket]) (*outbox.Message, error) {
			return &outbox.Message{Topic: "tickets", Key: key(c.Entity.ID), Value: fmt.Appendf(nil, "%s:%d:%s:soft=%v:%v", c.Op, c.Entity.ID, c.Entity.Status, c.SoftDelete, c.Changed)}, nil
		}),
	}
}

func setupRows(t *testing.T, dbt *dbtest.DB, cfg outbox.Config) *wbundle {
	t.Helper()
	b := setupWrite(t, dbt, cfg)
	require.NoError(t, b.db.AutoMigrate(&Ticket{}))
	return b
}

// seed creates orders with the given statuses, clears the messages and
// returns the orders.
func (b *wbundle) seed(t *testing.T, statuses ...string) []Order {
	t.Helper()
	os := make([]Order, len(statuses))
	for i, s := range statuses {
		os[i] = Order{Status: s, Total: i}
	}
	require.NoError(t, b.db.Create(&os).Error)
	b.clear(t)
	b.taken()
	return os
}

func msg(op string, o Order, status string, total int, before string) string {
	v := fmt.Sprintf("%s:%d:%s:%d", op, o.ID, status, total)
	if before != "" {
		v += "<-" + before
	}
	return v
}

func TestUpdatesByConditionPublishPerRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		os := b.seed(t, "a", "a", "b")
		cases := []struct {
			name  string
			write func() (int64, error)
			want  []string
		}{
			{"Update", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("status = ?", "a").Update("status", "u1")
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[0], "u1", 0, "a"), msg("update", os[1], "u1", 1, "a")}},
			{"Updates map", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("status = ?", "u1").Updates(map[string]any{"status": "u2"})
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[0], "u2", 0, "u1"), msg("update", os[1], "u2", 1, "u1")}},
			{"Updates struct", func() (int64, error) {
				r := b.db.Where("status = ?", "u2").Updates(&Order{Status: "u3"})
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[0], "u3", 0, "u2"), msg("update", os[1], "u3", 1, "u2")}},
			{"UpdateColumn Expr", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("status = ?", "b").UpdateColumn("total", gorm.Expr("total + ?", 10))
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[2], "b", 12, "b")}},
			{"UpdateColumns", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("id IN ?", []uint64{os[0].ID, os[2].ID}).UpdateColumns(map[string]any{"status": "c"})
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[0], "c", 0, "u3"), msg("update", os[2], "c", 12, "b")}},
			{"update from a subquery", func() (int64, error) {
				sub := b.db.Model(&Order{}).Select("MAX(total)")
				r := b.db.Model(&Order{}).Where("status = ?", "c").Update("total", b.db.Table("(?) AS m", sub).Select("*"))
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[0], "c", 12, "c"), msg("update", os[2], "c", 12, "c")}},
			{"generics Update", func() (int64, error) {
				n, err := gorm.G[Order](b.db).Where("status = ?", "u3").Update(ctx, "status", "g1")
				return int64(n), err
			}, []string{msg("update", os[1], "g1", 1, "u3")}},
			{"generics Updates", func() (int64, error) {
				n, err := gorm.G[Order](b.db).Where("status = ?", "g1").Updates(ctx, Order{Total: 7})
				return int64(n), err
			}, []string{msg("update", os[1], "g1", 7, "g1")}},
			{"generics Set Update", func() (int64, error) {
				n, err := gorm.G[Order](b.db).Where("status = ?", "g1").Set(clause.Assignment{Column: clause.Column{Name: "status"}, Value: "g2"}).Update(ctx)
				return int64(n), err
			}, []string{msg("update", os[1], "g2", 7, "g1")}},
			{"Table without a model", func() (int64, error) {
				r := b.db.Table("orders").Where("status = ?", "g2").Update("status", "t1")
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[1], "t1", 7, "g2")}},
			{"another struct on the table", func() (int64, error) {
				r := b.db.Model(&OrderLite{}).Where("status = ?", "t1").Update("status", "l1")
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[1], "l1", 7, "t1")}},
			{"another struct by entity", func() (int64, error) {
				r := b.db.Model(&OrderLite{ID: os[1].ID}).Update("status", "l2")
				return r.RowsAffected, r.Error
			}, []string{msg("update", os[1], "l2", 7, "l1")}},
			{"matches nothing", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("status = ?", "none").Update("status", "x")
				return r.RowsAffected, r.Error
			}, nil},
			{"nothing to set", func() (int64, error) {
				r := b.db.Model(&Order{}).Where("id = ?", os[0].ID).Updates(map[string]any{})
				return r.RowsAffected, r.Error
			}, nil},
			{"an entity with nothing to set", func() (int64, error) {
				r := b.db.Model(&os[0]).Updates(Order{})
				return r.RowsAffected, r.Error
			}, nil},
		}
		for _, tc := range cases {
			n, err := tc.write()
			require.NoError(t, err, tc.name)
			require.Equal(t, tc.want, nilIfEmpty(values(b.rows(t))), tc.name)
			if dbt.Dialect != dbtest.MySQL || tc.name != "update from a subquery" {
				require.Equal(t, int64(len(tc.want)), n, tc.name)
			}
			b.clear(t)
		}
	})
}

func TestDeletesByConditionPublishPerRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		os := b.seed(t, "a", "a", "b", "c", "d", "e", "f")
		steps := []struct {
			name  string
			write func() (int64, error)
			want  []string
		}{
			{"by condition", func() (int64, error) {
				r := b.db.Where("status = ?", "a").Delete(&Order{})
				return r.RowsAffected, r.Error
			}, []string{msg("delete", os[0], "a", 0, ""), msg("delete", os[1], "a", 1, "")}},
			{"generics", func() (int64, error) {
				n, err := gorm.G[Order](b.db).Where("status = ?", "b").Delete(ctx)
				return int64(n), err
			}, []string{msg("delete", os[2], "b", 2, "")}},
			{"Table without a model", func() (int64, error) {
				r := b.db.Table("orders").Where("status = ?", "c").Delete(nil)
				return r.RowsAffected, r.Error
			}, []string{msg("delete", os[3], "c", 3, "")}},
			{"another struct by condition", func() (int64, error) {
				r := b.db.Where("status = ?", "d").Delete(&OrderLite{})
				return r.RowsAffected, r.Error
			}, []string{msg("delete", os[4], "d", 4, "")}},
			{"another struct by entity", func() (int64, error) {
				r := b.db.Delete(&OrderLite{ID: os[5].ID})
				return r.RowsAffected, r.Error
			}, []string{msg("delete", os[5], "e", 5, "")}},
			{"matches nothing", func() (int64, error) {
				r := b.db.Where("status = ?", "none").Delete(&Order{})
				return r.RowsAffected, r.Error
			}, nil},
		}
		for _, s := range steps {
			n, err := s.write()
			require.NoError(t, err, s.name)
			require.Equal(t, s.want, nilIfEmpty(values(b.rows(t))), s.name)
			require.Equal(t, int64(len(s.want)), n, s.name)
			b.clear(t)
		}
		require.Equal(t, int64(1), b.orders(t))

		// Soft delete by condition, then the purge of the soft-deleted
		// rows with Unscoped.
		ts := []Ticket{{Status: "x"}, {Status: "x"}, {Status: "y"}}
		require.NoError(t, b.db.Create(&ts).Error)
		b.clear(t)
		require.NoError(t, b.db.Where("status = ?", "x").Delete(&Ticket{}).Error)
		require.Equal(t, []string{
			fmt.Sprintf("delete:%d:x:soft=true:[deleted_at]", ts[0].ID),
			fmt.Sprintf("delete:%d:x:soft=true:[deleted_at]", ts[1].ID),
		}, values(b.rows(t)))
		b.clear(t)
		require.NoError(t, b.db.Where("status = ?", "x").Delete(&Ticket{}).Error, "soft-deleted rows are not matched again")
		require.Empty(t, b.rows(t))
		require.NoError(t, b.db.Unscoped().Where("status = ?", "x").Delete(&Ticket{}).Error)
		require.Equal(t, []string{
			fmt.Sprintf("delete:%d:x:soft=false:[]", ts[0].ID),
			fmt.Sprintf("delete:%d:x:soft=false:[]", ts[1].ID),
		}, values(b.rows(t)))
	})
}

func TestCreatesFromMapsAndOtherStructsPublish(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		idOf := func(v any) uint64 {
			n, err := strconv.ParseUint(fmt.Sprint(v), 10, 64)
			require.NoError(t, err)
			return n
		}

		m := map[string]any{"Status": "m1", "Total": 3}
		require.NoError(t, b.db.Model(&Order{}).Create(m).Error)
		id := idOf(m["id"])
		require.Equal(t, []string{fmt.Sprintf("insert:%d:m1:3", id)}, values(b.rows(t)))
		b.clear(t)

		// A slice of maps: the keys land in the caller's maps (GORM alone
		// would append the RETURNING rows to the slice on PostgreSQL,
		// SQLite and MariaDB).
		ms := []map[string]any{{"Status": "s1"}, {"Status": "s2"}}
		require.NoError(t, b.db.Model(&Order{}).Create(&ms).Error)
		require.Len(t, ms, 2)
		require.Equal(t, []string{fmt.Sprintf("insert:%d:s1:0", idOf(ms[0]["id"])), fmt.Sprintf("insert:%d:s2:0", idOf(ms[1]["id"]))}, values(b.rows(t)))
		b.clear(t)

		require.NoError(t, gorm.G[Order](b.db).Set(
			clause.Assignment{Column: clause.Column{Name: "status"}, Value: "g"},
			clause.Assignment{Column: clause.Column{Name: "total"}, Value: 4},
		).Create(ctx))
		rows := values(b.rows(t))
		require.Len(t, rows, 1)
		require.True(t, strings.HasPrefix(rows[0], "insert:") && strings.HasSuffix(rows[0], ":g:4"), rows[0])
		b.clear(t)

		lite := OrderLite{Status: "lite"}
		require.NoError(t, b.db.Create(&lite).Error)
		require.Equal(t, []string{fmt.Sprintf("insert:%d:lite:0", lite.ID)}, values(b.rows(t)), "read back into Order")
		b.clear(t)

		// An upsert through the other struct: Update for the existing
		// row, Insert for the new one.
		batch := []OrderLite{{ID: lite.ID, Status: "lite2"}, {Status: "lite3"}}
		require.NoError(t, b.db.Save(&batch).Error)
		require.Equal(t, []string{fmt.Sprintf("update:%d:lite2:0", lite.ID), fmt.Sprintf("insert:%d:lite3:0", batch[1].ID)}, values(b.rows(t)))
		b.clear(t)

		// A struct that does not read its generated key back.
		type blind struct {
			ID     uint64 `gorm:"primaryKey;->:false"`
			Status string
		}
		if dbt.Dialect == dbtest.Postgres {
			// Another sequence used in the same statement (here by a
			// trigger) must not be taken for the row's key.
			require.NoError(t, b.db.Exec(`CREATE SEQUENCE other_seq START 1000000`).Error)
			require.NoError(t, b.db.Exec(`CREATE FUNCTION bump_other() RETURNS trigger AS $$ BEGIN PERFORM nextval('other_seq'); RETURN NEW; END $$ LANGUAGE plpgsql`).Error)
			require.NoError(t, b.db.Exec(`CREATE TRIGGER bump_other BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION bump_other()`).Error)
		}
		require.NoError(t, b.db.Table("orders").Create(&blind{Status: "blind"}).Error)
		var blindID uint64
		require.NoError(t, b.db.Table("orders").Where("status = ?", "blind").Pluck("id", &blindID).Error)
		require.Equal(t, []string{fmt.Sprintf("insert:%d:blind:0", blindID)}, values(b.rows(t)), "the message names the row inserted")
		if dbt.Dialect == dbtest.Postgres {
			require.NoError(t, b.db.Exec(`DROP TRIGGER bump_other ON orders`).Error)
		}
		b.clear(t)

		require.NoError(t, b.db.Table("orders").Create(map[string]any{"id": 9001, "status": "tbl"}).Error)
		require.Equal(t, []string{"insert:9001:tbl:0"}, values(b.rows(t)))
		b.clear(t)

		// Without a model the database generates the key: GORM stores
		// LastInsertId under "@id" (MySQL, SQLite); on PostgreSQL the
		// plugin asks for it with RETURNING and stores it there too.
		one := map[string]any{"status": "nokey"}
		require.NoError(t, b.db.Table("orders").Create(one).Error)
		many := []map[string]any{{"status": "k1"}, {"status": "k2"}}
		require.NoError(t, b.db.Table("orders").Create(&many).Error)
		require.Len(t, many, 2, "the caller's slice is left as it was, with the keys")
		var got []string
		for _, m := range append([]map[string]any{one}, many...) {
			_, hasID := m["id"]
			require.False(t, hasID, "the key is under @id, as GORM gives it without a model")
			got = append(got, fmt.Sprintf("insert:%d:%s:0", idOf(m["@id"]), m["status"]))
		}
		require.Equal(t, got, values(b.rows(t)))
		b.clear(t)

		// An upsert from a map cannot tell an insert from an update.
		err := b.db.Model(&Order{}).Clauses(clause.OnConflict{UpdateAll: true}).Create(map[string]any{"ID": id, "Status": "up"}).Error
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.Empty(t, b.rows(t))
	})
}

func TestAssociationsPublishPerRow(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		ev := &events{}
		b := setupFidelity(t, dbt, outbox.Config{Rules: fidelityRules(ev)})
		o := Owner{Name: "o", Pets: []Pet{{Name: "p1"}, {Name: "p2"}, {Name: "p3"}}}
		require.NoError(t, b.db.Create(&o).Error)
		b.clear(t)
		p := o.Pets

		require.NoError(t, b.db.Model(&o).Association("Pets").Delete(&p[0]))
		require.Equal(t, []string{fmt.Sprintf("update pet %d", p[0].ID)}, petValues(b.rows(t)), "unlink: SET owner_id = NULL WHERE …")
		b.clear(t)

		require.NoError(t, b.db.Model(&o).Association("Pets").Replace([]Pet{p[1]}))
		require.Equal(t, []string{fmt.Sprintf("update pet %d", p[1].ID), fmt.Sprintf("update pet %d", p[2].ID)}, petValues(b.rows(t)))
		b.clear(t)

		require.NoError(t, b.db.Model(&o).Association("Pets").Clear())
		require.Equal(t, []string{fmt.Sprintf("update pet %d", p[1].ID)}, petValues(b.rows(t)))
		b.clear(t)

		require.NoError(t, b.db.Model(&o).Association("Pets").Append(&p[0]))
		require.NoError(t, b.db.Model(&o).Association("Pets").Unscoped().Clear())
		require.Equal(t, []string{fmt.Sprintf("update pet %d", p[0].ID), fmt.Sprintf("delete pet %d", p[0].ID)}, petValues(b.rows(t)))
		var n int64
		require.NoError(t, b.db.Model(&Pet{}).Count(&n).Error)
		require.Equal(t, int64(2), n)
	})
}

func TestByConditionLimit(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules(), MaxRowsPerWrite: 3})
		b.seed(t, "a", "a", "a", "a", "b", "b")

		res := b.db.Model(&Order{}).Where("status = ?", "a").Update("status", "x")
		var tm *outbox.TooManyRowsError
		require.ErrorAs(t, res.Error, &tm)
		require.ErrorIs(t, res.Error, outbox.ErrUnsupportedWrite)
		require.Equal(t, 3, tm.Limit)
		require.Equal(t, outbox.Update, tm.Operation)
		require.Zero(t, res.RowsAffected)

		// In a transaction whose owner ignores the error and commits,
		// nothing changed either: the rows were counted first.
		require.NoError(t, b.db.Transaction(func(tx *gorm.DB) error {
			err := tx.Where("status = ?", "a").Delete(&Order{}).Error
			require.ErrorAs(t, err, &tm)
			return nil
		}))
		var n int64
		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "a").Count(&n).Error)
		require.Equal(t, int64(4), n)
		require.Empty(t, b.rows(t))

		// Three rows are within the limit.
		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "a").Limit(3).Order("id").Where("total < ?", 3).Update("status", "y").Error)
		require.Len(t, b.rows(t), 3)
	})
}

func TestMaxRowsAndAllowBulk(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		var mu sync.Mutex
		var bulk []outbox.Change[*Order]
		bulkRule := outbox.OnUpdate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			mu.Lock()
			bulk = append(bulk, c)
			mu.Unlock()
			return &outbox.Message{Topic: "bulk", Value: fmt.Appendf(nil, "bulk=%v:%d", c.Bulk, c.RowsAffected)}, nil
		}, outbox.AllowBulk())
		b := setupRows(t, dbt, outbox.Config{Rules: append(rowRules(outbox.MaxRows(2)), bulkRule)})
		os := b.seed(t, "a", "a", "a")

		err := b.db.Model(&Order{}).Where("status = ?", "a").Update("status", "x").Error
		var tm *outbox.TooManyRowsError
		require.ErrorAs(t, err, &tm)
		require.Equal(t, 2, tm.Limit, "the rule's MaxRows")

		require.NoError(t, b.db.Model(&Order{}).Where("id <> ?", os[2].ID).Update("status", "x").Error)
		require.Equal(t, []string{msg("update", os[0], "x", 0, "a"), msg("update", os[1], "x", 1, "a"), "bulk=true:2"}, values(b.rows(t)),
			"per-row rules once per row, the AllowBulk rule once")

		// With only AllowBulk rules nothing is read and nothing bounded.
		b2 := setupWrite(t, dbtest.Open(t, dbt.Dialect), outbox.Config{Rules: []outbox.Rule{bulkRule}, MaxRowsPerWrite: 1})
		require.NoError(t, b2.db.Create(&[]Order{{Status: "a"}, {Status: "a"}}).Error)
		require.NoError(t, b2.db.Model(&Order{}).Where("status = ?", "a").Update("status", "b").Error)
		require.Equal(t, []string{"bulk=true:2"}, values(b2.rows(t)))

		_, err = outbox.NewPlugin(outbox.Config{MaxRowsPerWrite: outbox.MaxRowsPerWriteMax + 1})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
		_, err = outbox.NewPlugin(outbox.Config{Rules: rowRules(outbox.MaxRows(-1))})
		require.ErrorIs(t, err, outbox.ErrInvalidConfig)
	})
}

func TestByConditionRollbackPublishesNothing(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		b.seed(t, "a", "a", "b")
		boom := errors.New("boom")
		err := b.db.Transaction(func(tx *gorm.DB) error {
			require.NoError(t, tx.Model(&Order{}).Where("status = ?", "a").Update("status", "x").Error)
			require.NoError(t, tx.Where("status = ?", "b").Delete(&Order{}).Error)
			require.Len(t, valuesIn(t, b, tx), 3, "written in the transaction")
			return boom
		})
		require.ErrorIs(t, err, boom)
		require.Empty(t, b.rows(t))
		require.Equal(t, int64(3), b.orders(t))
		got, _ := b.taken()
		require.Empty(t, got)

		// A rule's error rolls the update back and reports no rows.
		res := b.db.Model(&Order{}).Where("status = ?", "a").Update("status", "fail")
		var re *outbox.RuleError
		require.ErrorAs(t, res.Error, &re)
		require.Zero(t, res.RowsAffected)
		var n int64
		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "a").Count(&n).Error)
		require.Equal(t, int64(2), n)
	})
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// petValues returns the messages about pets: saving an association may
// also save its owner (an upsert of the owner on MySQL).
func petValues(rows []outbox.MessageRow) []string {
	var out []string
	for _, v := range values(rows) {
		if strings.Contains(v, " pet ") {
			out = append(out, v)
		}
	}
	return out
}

func valuesIn(t *testing.T, b *wbundle, tx *gorm.DB) []string {
	t.Helper()
	var rows []outbox.MessageRow
	require.NoError(t, tx.Table(b.plugin.Config().Tables.MessagesTable()).Order("id").Find(&rows).Error)
	return values(rows)
}

// Concurrent writers update, insert and delete rows that a by-condition
// update matches while it runs. Every by-condition update adds 1 to the
// total of each row it changes and publishes "id:total", and nothing else
// changes totals, so for every row the published totals must be exactly
// 1..its final total: a row changed without its message, or a message
// without its change, breaks the sequence.
func TestByConditionConcurrentWriters(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		rule := outbox.OnUpdate(func(c outbox.Change[*Order]) (*outbox.Message, error) {
			return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: fmt.Appendf(nil, "%d:%d", c.Entity.ID, c.Entity.Total)}, nil
		})
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})
		raw := b.db.Session(&gorm.Session{NewDB: true})
		const seed = 40
		for range seed {
			require.NoError(t, raw.Exec("INSERT INTO orders (status, total) VALUES (?, 0)", "x").Error)
		}
		var (
			stop    atomic.Bool
			wg, uwg sync.WaitGroup
			mu      sync.Mutex
			deleted = map[uint64]int{} // id -> total when deleted
			updates atomic.Int64
		)
		// Disturbers: flip statuses, insert matching rows, and delete rows
		// after reading their total under a lock. Raw SQL: outside the rules.
		for w := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(w), 7))
				for !stop.Load() {
					var ids []uint64
					if err := raw.Raw("SELECT id FROM orders").Scan(&ids).Error; err != nil || len(ids) == 0 {
						continue
					}
					id := ids[r.IntN(len(ids))]
					switch r.IntN(3) {
					case 0:
						_ = raw.Exec("UPDATE orders SET status = ? WHERE id = ?", []string{"x", "y"}[r.IntN(2)], id).Error
					case 1:
						_ = raw.Exec("INSERT INTO orders (status, total) VALUES (?, 0)", "x").Error
					case 2:
						_ = raw.Transaction(func(tx *gorm.DB) error {
							var totals []int
							q := tx.Table("orders").Select("total").Where("id = ?", id)
							if dbt.Dialect != dbtest.SQLite {
								q = q.Clauses(clause.Locking{Strength: clause.LockingStrengthUpdate})
							}
							if err := q.Scan(&totals).Error; err != nil || len(totals) == 0 {
								return errors.New("gone")
							}
							if err := tx.Exec("DELETE FROM orders WHERE id = ?", id).Error; err != nil {
								return err
							}
							mu.Lock()
							deleted[id] = totals[0]
							mu.Unlock()
							return nil
						})
					}
				}
			}()
		}
		// By-condition updates; a deadlock or serialization failure rolls
		// one back, which must publish nothing.
		for w := range 2 {
			uwg.Add(1)
			go func() {
				defer uwg.Done()
				for range 15 {
					err := b.db.Model(&Order{}).Where("status = ?", "x").Update("total", gorm.Expr("total + 1")).Error
					if err == nil {
						updates.Add(1)
					} else {
						assert.NotErrorIs(t, err, outbox.ErrUnsupportedWrite, "writer %d", w)
					}
				}
			}()
		}
		// The updaters finish while the disturbers run, then the
		// disturbers stop.
		uwg.Wait()
		stop.Store(true)
		wg.Wait()
		require.Positive(t, updates.Load())

		final := map[uint64]int{}
		var rows []Order
		require.NoError(t, b.db.Find(&rows).Error)
		for _, o := range rows {
			final[o.ID] = o.Total
		}
		for id, total := range deleted {
			final[id] = total
		}
		published := map[uint64][]int{}
		for _, v := range values(b.rows(t)) {
			parts := strings.Split(v, ":")
			id, _ := strconv.ParseUint(parts[0], 10, 64)
			total, _ := strconv.Atoi(parts[1])
			published[id] = append(published[id], total)
		}
		changed := 0
		for id, total := range final {
			got := published[id]
			sort.Ints(got)
			want := make([]int, total)
			for i := range want {
				want[i] = i + 1
			}
			if total == 0 {
				want = nil
			}
			require.Equal(t, want, got, "row %d", id)
			changed += total
		}
		for id := range published {
			_, ok := final[id]
			require.True(t, ok, "message for row %d that never existed", id)
		}
		require.Positive(t, changed)
	})
}

// UPDATE … FROM (PostgreSQL, SQLite): the rows of orders the join finds,
// each once, with the value the SET reads from the joined table.
func TestUpdateFromPublishesPerRow(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		if dbt.Dialect == dbtest.MySQL {
			t.Skip("MySQL has no UPDATE … FROM; GORM drops the clause")
		}
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		os := b.seed(t, "a", "a", "a")
		require.NoError(t, b.db.Create(&[]Invoice{{ID: os[0].ID, Amount: 50}, {ID: os[1].ID, Amount: 60}, {ID: os[1].ID + 1000, Amount: 70}}).Error)
		res := b.db.Model(&Order{}).Clauses(clause.From{Tables: []clause.Table{{Name: "invoices"}}}).
			Where("invoices.id = orders.id AND invoices.amount >= ?", 50).Update("total", gorm.Expr("invoices.amount"))
		require.NoError(t, res.Error)
		require.Equal(t, int64(2), res.RowsAffected)
		require.Equal(t, []string{msg("update", os[0], "a", 50, "a"), msg("update", os[1], "a", 60, "a")}, values(b.rows(t)))
	})
}

func TestGuardRawSQL(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules(), GuardRawSQL: true})
		os := b.seed(t, "a", "b")
		for _, q := range []string{
			"UPDATE orders SET status = 'x'",
			"delete from ORDERS where id > 0",
			"INSERT INTO orders (status, total) VALUES ('r', 1)",
			"WITH s AS (SELECT 1) UPDATE tickets SET status = 'x'",
		} {
			var rw *outbox.RawWriteError
			require.ErrorAs(t, b.db.Exec(q).Error, &rw, q)
			require.ErrorIs(t, b.db.Exec(q).Error, outbox.ErrUnsupportedWrite)
		}
		var ids []uint64
		err := b.db.Raw("DELETE FROM orders WHERE id = ? RETURNING id", os[0].ID).Scan(&ids).Error
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite, "Raw too")
		var n int64
		require.NoError(t, b.db.Raw("SELECT COUNT(*) FROM orders").Scan(&n).Error, "reads pass")
		require.Equal(t, int64(2), n, "nothing ran")
		require.NoError(t, b.db.Exec("UPDATE invoices SET amount = 1").Error, "a table without rules")
		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "a").Update("status", "c").Error, "GORM's own statements pass")
		require.Len(t, b.rows(t), 1)

		// Without the guard raw SQL is outside the rules.
		b2 := setupWrite(t, dbtest.Open(t, dbt.Dialect), outbox.Config{Rules: rowRules()})
		require.NoError(t, b2.db.Exec("UPDATE orders SET status = 'x'").Error)
	})
}

// With only AllowBulk rules, a write through another struct is one bulk
// change: the rules never see a value of the other struct.
func TestOtherStructWithBulkRules(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		rule := outbox.On(outbox.Update|outbox.Delete, func(c outbox.Change[*Order]) (*outbox.Message, error) {
			return &outbox.Message{Topic: "bulk", Value: fmt.Appendf(nil, "%s bulk=%v %d", c.Op, c.Bulk, c.RowsAffected)}, nil
		}, outbox.AllowBulk())
		b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})
		lite := OrderLite{Status: "a"}
		require.NoError(t, b.db.Create(&lite).Error)
		require.NoError(t, b.db.Model(&lite).Update("status", "b").Error)
		require.NoError(t, b.db.Delete(&lite).Error)
		require.Equal(t, []string{"update bulk=true 1", "delete bulk=true 1"}, values(b.rows(t)))
	})
}

// An update without conditions is GORM's to refuse; allowed, it is per
// row like any other update by condition.
func TestGlobalUpdatePublishesPerRow(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: rowRules()})
		os := b.seed(t, "a", "b")
		err := b.db.Model(&Order{}).Update("status", "z").Error
		require.ErrorIs(t, err, gorm.ErrMissingWhereClause)
		require.Empty(t, b.rows(t))
		require.NoError(t, b.db.Session(&gorm.Session{AllowGlobalUpdate: true}).Model(&Order{}).Update("status", "z").Error)
		require.Equal(t, []string{msg("update", os[0], "z", 0, "a"), msg("update", os[1], "z", 1, "b")}, values(b.rows(t)))
	})
}

// readRowRule publishes inserts, updates and deletes of an Order as
// "who op:id:status:total<-before keyonly=…", built with opts.
func readRowRule(who string, opts ...outbox.RuleOption) outbox.Rule {
	return outbox.On(outbox.Insert|outbox.Update|outbox.Delete, func(c outbox.Change[*Order]) (*outbox.Message, error) {
		if c.Bulk {
			return &outbox.Message{Topic: "orders", Value: fmt.Appendf(nil, "%s %s bulk", who, c.Op)}, nil
		}
		v := fmt.Sprintf("%s %s:%d:%s:%d", who, c.Op, c.Entity.ID, c.Entity.Status, c.Entity.Total)
		if c.Before != nil {
			v += "<-" + c.Before.Status
		}
		v += fmt.Sprintf(" keyonly=%v", c.KeyOnly)
		return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte(v)}, nil
	}, opts...)
}

// readRowRules: an Order rule with ReadRow and one without (AllowBulk),
// a Ticket rule with ReadRow, an Invoice rule without.
func readRowRules(opts ...outbox.RuleOption) []outbox.Rule {
	return []outbox.Rule{
		readRowRule("read", append([]outbox.RuleOption{outbox.ReadRow()}, opts...)...),
		readRowRule("other", outbox.AllowBulk()),
		outbox.On(outbox.Update|outbox.Delete, func(c outbox.Change[*Ticket]) (*outbox.Message, error) {
			return &outbox.Message{Topic: "tickets", Key: key(c.Entity.ID), Value: fmt.Appendf(nil, "ticket %s:%d:%s:soft=%v:%v keyonly=%v", c.Op, c.Entity.ID, c.Entity.Status, c.SoftDelete, c.Changed, c.KeyOnly)}, nil
		}, outbox.ReadRow()),
		outbox.On(outbox.Update|outbox.Delete, func(c outbox.Change[*Invoice]) (*outbox.Message, error) {
			v := fmt.Sprintf("invoice %s:%d:%d", c.Op, c.Entity.ID, c.Entity.Amount)
			if c.Before != nil {
				v += fmt.Sprintf("<-%d", c.Before.Amount)
			}
			return &outbox.Message{Topic: "invoices", Key: key(c.Entity.ID), Value: fmt.Appendf(nil, "%s keyonly=%v", v, c.KeyOnly)}, nil
		}),
	}
}

// both is the messages of readRowRules' two Order rules for one change.
func both(v string) []string { return []string{"read " + v, "other " + v} }

// tableReads returns the SELECTs the recorder saw on the table.
func tableReads(rec *sqlRecorder, table string) []string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var out []string
	for _, s := range rec.sql {
		if strings.HasPrefix(strings.ToUpper(strings.TrimSpace(s)), "SELECT") && strings.Contains(s, table) {
			out = append(out, s)
		}
	}
	return out
}

// readRowCase is one write of the ReadRow tests and the messages it
// publishes; the write reports one row affected per pair of messages.
type readRowCase struct {
	name  string
	write func() *gorm.DB
	want  []string
}

// runReadRowCases runs the cases in order, each on the rows the cases
// before it left.
func runReadRowCases(t *testing.T, b *wbundle, cases []readRowCase) {
	t.Helper()
	for _, tc := range cases {
		res := tc.write()
		require.NoError(t, res.Error, tc.name)
		require.Equal(t, tc.want, nilIfEmpty(values(b.rows(t))), tc.name)
		require.Equal(t, int64(len(tc.want)/2), res.RowsAffected, tc.name)
		b.clear(t)
	}
}

// With ReadRow, an update or delete of entities that hold nothing but
// their key reads their rows, as a write by condition on those keys:
// every rule of the model for the operation gets the row after the
// update (a column the update did not set holds its stored value) and the
// row before it, or the row as it was before the delete; KeyOnly is
// false; a key without a row publishes nothing.
func TestReadRowReadsKeyOnlyWrites(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: readRowRules()})
		os := b.seed(t, "a", "b", "c", "d")
		id := func(i int) uint64 { return os[i].ID }
		runReadRowCases(t, b, []readRowCase{
			{"Update", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).Update("status", "paid")
			}, both(fmt.Sprintf("update:%d:paid:1<-b keyonly=false", id(1)))},
			{"Updates map", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).Updates(map[string]any{"status": "m"})
			}, both(fmt.Sprintf("update:%d:m:1<-paid keyonly=false", id(1)))},
			{"Updates struct", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).Updates(Order{Status: "s"})
			}, both(fmt.Sprintf("update:%d:s:1<-m keyonly=false", id(1)))},
			{"UpdateColumn Expr", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).UpdateColumn("total", gorm.Expr("total + ?", 10))
			}, both(fmt.Sprintf("update:%d:s:11<-s keyonly=false", id(1)))},
			{"UpdateColumns", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).UpdateColumns(map[string]any{"status": "uc"})
			}, both(fmt.Sprintf("update:%d:uc:11<-s keyonly=false", id(1)))},
			{"Update of a slice", func() *gorm.DB {
				return b.db.Model(&[]Order{{ID: id(0)}, {ID: id(2)}}).Update("status", "x")
			}, append(both(fmt.Sprintf("update:%d:x:0<-a keyonly=false", id(0))), both(fmt.Sprintf("update:%d:x:2<-c keyonly=false", id(2)))...)},
			{"Update of a key without a row", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(3) + 1000}).Update("status", "x")
			}, nil},
			{"Updates with nothing to set", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1)}).Updates(Order{})
			}, nil},
			{"Delete", func() *gorm.DB {
				return b.db.Delete(&Order{ID: id(3)})
			}, both(fmt.Sprintf("delete:%d:d:3 keyonly=false", id(3)))},
			{"Delete of a key without a row", func() *gorm.DB {
				return b.db.Delete(&Order{ID: id(3)})
			}, nil},
			{"Delete of a slice", func() *gorm.DB {
				return b.db.Delete(&[]Order{{ID: id(2)}, {ID: id(0)}, {ID: id(3)}})
			}, append(both(fmt.Sprintf("delete:%d:x:0 keyonly=false", id(0))), both(fmt.Sprintf("delete:%d:x:2 keyonly=false", id(2)))...)},
		})
		require.Equal(t, int64(1), b.orders(t))

		// A soft delete, then the purge of the soft-deleted row.
		tk := Ticket{Status: "open"}
		require.NoError(t, b.db.Create(&tk).Error)
		b.clear(t)
		require.NoError(t, b.db.Delete(&Ticket{ID: tk.ID}).Error)
		require.Equal(t, []string{fmt.Sprintf("ticket delete:%d:open:soft=true:[deleted_at] keyonly=false", tk.ID)}, values(b.rows(t)))
		b.clear(t)
		require.NoError(t, b.db.Delete(&Ticket{ID: tk.ID}).Error, "a soft-deleted row is not matched again")
		require.Empty(t, b.rows(t))
		require.NoError(t, b.db.Unscoped().Delete(&Ticket{ID: tk.ID}).Error)
		require.Equal(t, []string{fmt.Sprintf("ticket delete:%d:open:soft=false:[] keyonly=false", tk.ID)}, values(b.rows(t)))
	})
}

// With ReadRow, an update or delete of entities with other fields set
// (partly filled, loaded, the model as the source of the values, Save)
// reads their rows too: the rules get the row from the table, never the
// caller's value, and Before is the row as it was in the table, also when
// the caller's copy is stale. Conditions the caller adds to the entity's
// key are kept. Save of a new row is an Insert, as without ReadRow.
func TestReadRowReadsEntitiesWithFieldsSet(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: readRowRules()})
		os := b.seed(t, "a", "b", "c", "d")
		id := func(i int) uint64 { return os[i].ID }
		// The rows change behind the caller's copies, which still say
		// "a" to "d".
		require.NoError(t, b.db.Model(&Order{}).Where("id > ?", 0).Update("status", "s").Error)
		b.clear(t)
		o3 := os[3]
		fresh := Order{ID: id(3) + 1000, Status: "new", Total: 5}
		runReadRowCases(t, b, []readRowCase{
			{"Update of a loaded entity", func() *gorm.DB {
				return b.db.Model(&os[0]).Update("total", 42)
			}, both(fmt.Sprintf("update:%d:s:42<-s keyonly=false", id(0)))},
			{"Updates map of a loaded entity", func() *gorm.DB {
				return b.db.Model(&os[0]).Updates(map[string]any{"status": "m"})
			}, both(fmt.Sprintf("update:%d:m:42<-s keyonly=false", id(0)))},
			{"Updates struct of a partly filled model", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1), Total: 99}).Updates(Order{Status: "p"})
			}, both(fmt.Sprintf("update:%d:p:1<-s keyonly=false", id(1)))},
			{"UpdateColumn of a partly filled model", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(1), Status: "x"}).UpdateColumn("total", gorm.Expr("total + ?", 10))
			}, both(fmt.Sprintf("update:%d:p:11<-p keyonly=false", id(1)))},
			{"Updates of a partly filled entity", func() *gorm.DB {
				return b.db.Updates(&Order{ID: id(2), Status: "w"})
			}, both(fmt.Sprintf("update:%d:w:2<-s keyonly=false", id(2)))},
			{"Updates of a loaded model with itself", func() *gorm.DB {
				o3.Status = "u"
				return b.db.Model(&o3).Updates(&o3)
			}, both(fmt.Sprintf("update:%d:u:3<-s keyonly=false", id(3)))},
			{"Update with a condition the row does not meet", func() *gorm.DB {
				return b.db.Model(&Order{ID: id(2), Status: "w"}).Where("status = ?", "nope").Update("total", 7)
			}, nil},
			{"Update with a condition the row meets", func() *gorm.DB {
				return b.db.Model(&os[2]).Where("status = ?", "w").Update("total", 7)
			}, both(fmt.Sprintf("update:%d:w:7<-w keyonly=false", id(2)))},
			{"Save of an existing row", func() *gorm.DB {
				os[1].Status = "saved" // the copy's total, 1, is saved too
				return b.db.Save(&os[1])
			}, both(fmt.Sprintf("update:%d:saved:1<-p keyonly=false", id(1)))},
			{"Save of an unchanged row", func() *gorm.DB {
				// MySQL reports 0 rows affected: Save must not upsert it
				// again.
				return b.db.Save(&os[1])
			}, both(fmt.Sprintf("update:%d:saved:1<-saved keyonly=false", id(1)))},
			{"Save of a new row", func() *gorm.DB {
				return b.db.Save(&fresh)
			}, both(fmt.Sprintf("insert:%d:new:5 keyonly=false", fresh.ID))},
			{"Delete of a partly filled entity", func() *gorm.DB {
				return b.db.Delete(&Order{ID: id(2), Status: "wrong"})
			}, both(fmt.Sprintf("delete:%d:w:7 keyonly=false", id(2)))},
			{"Delete of loaded entities", func() *gorm.DB {
				return b.db.Delete(&[]Order{os[3], os[0]})
			}, append(both(fmt.Sprintf("delete:%d:m:42 keyonly=false", id(0))), both(fmt.Sprintf("delete:%d:u:3 keyonly=false", id(3)))...)},
		})
		require.Equal(t, int64(2), b.orders(t), "the saved row and the new one")

		// Updates that set nothing run no statement: nothing is read or
		// published.
		rec := &sqlRecorder{Interface: logger.Discard}
		db := b.db.Session(&gorm.Session{Logger: rec})
		require.NoError(t, db.Updates(&Order{ID: id(1)}).Error)
		require.NoError(t, db.Model(&os[1]).Updates(Order{}).Error)
		require.Empty(t, tableReads(rec, "orders"), "nothing read")
		require.Empty(t, b.rows(t))

		// A soft delete of a partly filled entity publishes the stored row.
		tk := Ticket{Status: "open"}
		require.NoError(t, b.db.Create(&tk).Error)
		require.NoError(t, b.db.Delete(&Ticket{ID: tk.ID, Status: "given"}).Error)
		require.Equal(t, []string{fmt.Sprintf("ticket delete:%d:open:soft=true:[deleted_at] keyonly=false", tk.ID)}, values(b.rows(t)))
		b.clear(t)

		// An update that changes the key is refused, as by condition: the
		// row under the new key cannot be known.
		saved := id(1)
		err := b.db.Model(&os[1]).Update("id", fresh.ID+1).Error
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.NoError(t, b.db.First(&Order{}, saved).Error, "rolled back")
		require.Empty(t, b.rows(t))
	})
}

// A model none of whose rules has ReadRow reads nothing for a write of
// its entities: the rules get the caller's values, KeyOnly for an entity
// holding nothing but its key, and no Before for Save.
func TestReadRowLeavesOtherModelsAlone(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: readRowRules()})
		inv := Invoice{Amount: 1}
		keyOnly := Invoice{Amount: 2}
		require.NoError(t, b.db.Create(&inv).Error)
		require.NoError(t, b.db.Create(&keyOnly).Error)
		b.clear(t)
		rec := &sqlRecorder{Interface: logger.Discard}
		db := b.db.Session(&gorm.Session{Logger: rec})

		require.NoError(t, db.Model(&Invoice{ID: inv.ID}).Update("amount", 5).Error)
		// inv still says 1, the row 5.
		require.NoError(t, db.Model(&inv).Update("amount", 7).Error)
		require.NoError(t, db.Updates(&Invoice{ID: keyOnly.ID, Amount: 3}).Error)
		inv.Amount = 8
		require.NoError(t, db.Save(&inv).Error)
		inv.Amount = 9 // not stored: a read row would say 8
		require.NoError(t, db.Delete(&inv).Error)
		require.NoError(t, db.Delete(&Invoice{ID: keyOnly.ID}).Error)
		require.Equal(t, []string{
			fmt.Sprintf("invoice update:%d:5<-0 keyonly=true", inv.ID),
			fmt.Sprintf("invoice update:%d:7<-1 keyonly=false", inv.ID),
			fmt.Sprintf("invoice update:%d:3 keyonly=false", keyOnly.ID),
			fmt.Sprintf("invoice update:%d:8 keyonly=false", inv.ID),
			fmt.Sprintf("invoice delete:%d:9 keyonly=false", inv.ID),
			fmt.Sprintf("invoice delete:%d:0 keyonly=true", keyOnly.ID),
		}, values(b.rows(t)), "the caller's values")
		require.Empty(t, tableReads(rec, "invoices"), "nothing read")
	})
}

// A write of entities read for a ReadRow rule is bounded as a write by
// condition: more rows than the limit are refused before anything
// changes, whether the entities hold only their key or are loaded.
func TestReadRowLimit(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupRows(t, dbt, outbox.Config{Rules: readRowRules(outbox.MaxRows(2))})
		os := b.seed(t, "a", "b", "c")
		keys := []Order{{ID: os[0].ID}, {ID: os[1].ID}, {ID: os[2].ID}}

		for _, w := range []struct {
			name  string
			op    outbox.Operation
			write func() *gorm.DB
		}{
			{"key-only delete", outbox.Delete, func() *gorm.DB { return b.db.Delete(&keys) }},
			{"loaded delete", outbox.Delete, func() *gorm.DB { return b.db.Delete(&os) }},
			{"loaded update", outbox.Update, func() *gorm.DB { return b.db.Model(&os).Update("status", "z") }},
		} {
			res := w.write()
			var tm *outbox.TooManyRowsError
			require.ErrorAs(t, res.Error, &tm, w.name)
			require.Equal(t, 2, tm.Limit, "the rule's MaxRows")
			require.Equal(t, w.op, tm.Operation)
			require.Zero(t, res.RowsAffected)
			require.Equal(t, int64(3), b.orders(t), "nothing deleted")
			require.Empty(t, b.rows(t))
		}
		var changed int64
		require.NoError(t, b.db.Model(&Order{}).Where("status = ?", "z").Count(&changed).Error)
		require.Zero(t, changed, "nothing updated")

		require.NoError(t, b.db.Delete(keys[:2]).Error, "within the limit")
		require.Len(t, b.rows(t), 4)
	})
}
