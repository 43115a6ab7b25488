package outbox_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
)

// Product has a generated key and a unique SKU that upserts conflict on.
type Product struct {
	ID   uint64 `gorm:"primaryKey"`
	SKU  string `gorm:"size:64;uniqueIndex"`
	Name string `gorm:"size:64"`
}

// Variant is unique on a composite key besides its generated one.
type Variant struct {
	ID      uint64 `gorm:"primaryKey"`
	Product string `gorm:"size:64;uniqueIndex:variant_key"`
	Size    string `gorm:"size:16;uniqueIndex:variant_key"`
	Note    string `gorm:"size:64"`
}

type productEvent struct {
	Op   string `json:"op"`
	ID   uint64 `json:"id"`
	Key  string `json:"key"`
	Name string `json:"name"`
}

// productRules publishes every insert and update of a Product or a
// Variant as a productEvent carrying the row's generated id.
func productRules() []outbox.Rule {
	msg := func(op string, id uint64, k, name string) (*outbox.Message, error) {
		v, err := json.Marshal(productEvent{Op: op, ID: id, Key: k, Name: name})
		return &outbox.Message{Topic: "products", Key: []byte(k), Value: v}, err
	}
	return []outbox.Rule{
		outbox.OnCreate(func(c outbox.Change[*Product]) (*outbox.Message, error) {
			return msg("created", c.Entity.ID, c.Entity.SKU, c.Entity.Name)
		}),
		outbox.OnUpdate(func(c outbox.Change[*Product]) (*outbox.Message, error) {
			return msg("updated", c.Entity.ID, c.Entity.SKU, c.Entity.Name)
		}),
		outbox.OnCreate(func(c outbox.Change[*Variant]) (*outbox.Message, error) {
			return msg("created", c.Entity.ID, c.Entity.Product+"/"+c.Entity.Size, c.Entity.Note)
		}),
		outbox.OnUpdate(func(c outbox.Change[*Variant]) (*outbox.Message, error) {
			return msg("updated", c.Entity.ID, c.Entity.Product+"/"+c.Entity.Size, c.Entity.Note)
		}),
	}
}

func setupProducts(t *testing.T, dbt *dbtest.DB) *wbundle {
	t.Helper()
	b := setupWrite(t, dbt, outbox.Config{Rules: productRules()})
	require.NoError(t, b.db.AutoMigrate(&Product{}, &Variant{}))
	return b
}

// seededProducts is setupProducts with the products existing-a and
// existing-b written, and no message.
func seededProducts(t *testing.T, dbt *dbtest.DB) (*wbundle, []Product) {
	t.Helper()
	b := setupProducts(t, dbt)
	seed := []Product{{SKU: "existing-a", Name: "a"}, {SKU: "existing-b", Name: "b"}}
	require.NoError(t, b.db.Create(&seed).Error)
	b.clear(t)
	return b, seed
}

func (b *wbundle) events(t *testing.T) []productEvent {
	t.Helper()
	var out []productEvent
	for _, r := range b.rows(t) {
		var e productEvent
		require.NoError(t, json.Unmarshal(r.Value, &e))
		require.Equal(t, e.Key, string(r.Key))
		out = append(out, e)
	}
	return out
}

// productIDs reads the ids of the products with the given SKUs.
func (b *wbundle) productIDs(t *testing.T) map[string]uint64 {
	t.Helper()
	var ps []Product
	require.NoError(t, b.db.Find(&ps).Error)
	out := map[string]uint64{}
	for _, p := range ps {
		out[p.SKU] = p.ID
	}
	return out
}

// existingID is the key an entity whose row existed holds after an ON
// CONFLICT DO NOTHING: the key it was given (zero) on PostgreSQL and
// SQLite, which return nothing for it; the row's own on MariaDB, where
// GORM writes DO NOTHING as ON DUPLICATE KEY UPDATE id = id, which
// returns every row.
func existingID(dbt *dbtest.DB, rowID uint64) uint64 {
	if dbt.Dialect == dbtest.MySQL {
		return rowID
	}
	return 0
}

// An ON CONFLICT DO NOTHING over new rows and rows that exist publishes
// an Insert for each new row, carrying the id the database gave that row,
// and leaves the caller's entities holding those ids (see existingID for
// an entity whose row existed). PostgreSQL and SQLite return the
// generated ids only for the rows inserted, and GORM hands them to the
// entities in order whatever existed; the plugin gives each entity its
// own row's values.
func TestUpsertDoNothingPublishesTheInsertedRowsIDs(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b, seed := seededProducts(t, dbt)
		doNothing := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}

		batch := []Product{{SKU: "new-x", Name: "x"}, {SKU: "existing-a", Name: "a2"}, {SKU: "new-y", Name: "y"}}
		require.NoError(t, b.db.Clauses(doNothing).Create(&batch).Error)
		ids := b.productIDs(t)
		require.Len(t, ids, 4)
		require.Equal(t, seed[0].ID, ids["existing-a"], "the existing row is untouched")
		require.Equal(t, []productEvent{
			{Op: "created", ID: ids["new-x"], Key: "new-x", Name: "x"},
			{Op: "created", ID: ids["new-y"], Key: "new-y", Name: "y"},
		}, b.events(t))
		require.Equal(t, []uint64{ids["new-x"], existingID(dbt, ids["existing-a"]), ids["new-y"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID},
			"the entities hold the ids of their own rows; the one that existed keeps its zero key")
		res := b.db.Clauses(doNothing).Create(&[]Product{{SKU: "existing-b"}, {SKU: "new-w"}})
		require.NoError(t, res.Error)
		if dbt.Dialect == dbtest.MySQL {
			require.Equal(t, int64(2), res.RowsAffected, "MariaDB: the rows returned, the existing one included")
		} else {
			require.Equal(t, int64(1), res.RowsAffected, "the rows inserted")
		}
		b.clear(t)
		b.clear(t)

		// Pointers, and the existing rows first and last.
		ptrs := []*Product{{SKU: "existing-b"}, {SKU: "new-z", Name: "z"}, {SKU: "existing-a"}}
		require.NoError(t, b.db.Clauses(doNothing).Create(&ptrs).Error)
		ids = b.productIDs(t)
		require.Equal(t, []productEvent{{Op: "created", ID: ids["new-z"], Key: "new-z", Name: "z"}}, b.events(t))
		require.Equal(t, []uint64{existingID(dbt, ids["existing-b"]), ids["new-z"], existingID(dbt, ids["existing-a"])}, []uint64{ptrs[0].ID, ptrs[1].ID, ptrs[2].ID})
		b.clear(t)

		// One row that exists: nothing written, nothing published.
		one := Product{SKU: "existing-a", Name: "again"}
		require.NoError(t, b.db.Clauses(doNothing).Create(&one).Error)
		require.Empty(t, b.rows(t))
		require.Equal(t, existingID(dbt, ids["existing-a"]), one.ID)

		// Every row new.
		fresh := []Product{{SKU: "new-1", Name: "1"}, {SKU: "new-2", Name: "2"}, {SKU: "new-3", Name: "3"}}
		require.NoError(t, b.db.Clauses(doNothing).Create(&fresh).Error)
		ids = b.productIDs(t)
		var want []productEvent
		for _, p := range fresh {
			require.Equal(t, ids[p.SKU], p.ID)
			want = append(want, productEvent{Op: "created", ID: ids[p.SKU], Key: p.SKU, Name: p.Name})
		}
		require.Equal(t, want, b.events(t))
		b.clear(t)

		// Every row existing.
		old := []Product{{SKU: "new-1"}, {SKU: "existing-b"}}
		require.NoError(t, b.db.Clauses(doNothing).Create(&old).Error)
		require.Empty(t, b.rows(t))
		require.Equal(t, []uint64{existingID(dbt, ids["new-1"]), existingID(dbt, ids["existing-b"])}, []uint64{old[0].ID, old[1].ID})
		require.Len(t, b.productIDs(t), 9)
	})
}

// The same over a composite conflict key.
func TestUpsertDoNothingCompositeKeyPublishesTheInsertedRowsIDs(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupProducts(t, dbt)
		require.NoError(t, b.db.Create(&[]Variant{{Product: "p", Size: "m", Note: "seed"}}).Error)
		b.clear(t)
		oc := clause.OnConflict{Columns: []clause.Column{{Name: "product"}, {Name: "size"}}, DoNothing: true}
		batch := []Variant{{Product: "p", Size: "s", Note: "1"}, {Product: "p", Size: "m", Note: "2"}, {Product: "q", Size: "m", Note: "3"}}
		require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
		var vs []Variant
		require.NoError(t, b.db.Find(&vs).Error)
		ids := map[string]uint64{}
		for _, v := range vs {
			ids[v.Product+"/"+v.Size] = v.ID
		}
		require.Len(t, ids, 3)
		require.Equal(t, []productEvent{
			{Op: "created", ID: ids["p/s"], Key: "p/s", Name: "1"},
			{Op: "created", ID: ids["q/m"], Key: "q/m", Name: "3"},
		}, b.events(t))
		require.Equal(t, []uint64{ids["p/s"], existingID(dbt, ids["p/m"]), ids["q/m"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID})
	})
}

// ON CONFLICT DO UPDATE over new and existing rows: every row is
// returned (inserted or updated), so each entity gets its own row's id;
// Inserts and Updates carry them.
func TestUpsertDoUpdatesPublishesEachRowsID(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b, seed := seededProducts(t, dbt)
		oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoUpdates: clause.AssignmentColumns([]string{"name"})}
		batch := []Product{{SKU: "new-x", Name: "x"}, {SKU: "existing-a", Name: "a2"}, {SKU: "new-y", Name: "y"}, {SKU: "existing-b", Name: "b2"}}
		require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
		ids := b.productIDs(t)
		require.Equal(t, seed[0].ID, ids["existing-a"])
		require.Equal(t, []productEvent{
			{Op: "created", ID: ids["new-x"], Key: "new-x", Name: "x"},
			{Op: "updated", ID: ids["existing-a"], Key: "existing-a", Name: "a2"},
			{Op: "created", ID: ids["new-y"], Key: "new-y", Name: "y"},
			{Op: "updated", ID: ids["existing-b"], Key: "existing-b", Name: "b2"},
		}, b.events(t))
		for _, p := range batch {
			require.Equal(t, ids[p.SKU], p.ID, p.SKU)
		}
	})
}

// Two entities with the same new key in one upsert: the database
// inserts one of them and skips (DO NOTHING) or updates it with the
// other (DO UPDATE). Which entity the row holds cannot be told, so the
// write is refused and rolled back.
func TestUpsertSameNewKeyTwiceRefused(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupProducts(t, dbt)
		require.NoError(t, b.db.Create(&Product{SKU: "existing-a"}).Error)
		b.clear(t)
		oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}
		batch := []Product{{SKU: "new-x", Name: "1"}, {SKU: "existing-a"}, {SKU: "new-x", Name: "2"}}
		err := b.db.Clauses(oc).Create(&batch).Error
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.Contains(t, err.Error(), "(sku=new-x)")
		require.Empty(t, b.rows(t))
		require.Len(t, b.productIDs(t), 1, "rolled back")

		// DO UPDATE: the second would update the row the first inserted
		// (SQLite, MySQL) or fail (PostgreSQL): refused before it runs.
		upd := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoUpdates: clause.AssignmentColumns([]string{"name"})}
		err = b.db.Clauses(upd).Create(&[]Product{{SKU: "new-z", Name: "1"}, {SKU: "new-z", Name: "2"}}).Error
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.Contains(t, err.Error(), "(sku=new-z)")
		require.Empty(t, b.rows(t))
		require.Len(t, b.productIDs(t), 1)

		// In the caller's transaction too: nothing of it is kept.
		err = b.db.Transaction(func(tx *gorm.DB) error {
			return tx.Clauses(oc).Create(&[]Product{{SKU: "new-y"}, {SKU: "new-y"}}).Error
		})
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.Len(t, b.productIDs(t), 1)
	})
}

// ProductLite is a second struct mapped to the table of Product.
type ProductLite struct {
	ID  uint64 `gorm:"primaryKey"`
	SKU string `gorm:"size:64;uniqueIndex"`
}

func (ProductLite) TableName() string { return "products" }

// Through another struct on the table the created rows are read back by
// the keys the entities hold: those keys are their own rows'.
func TestUpsertDoNothingThroughAnotherStruct(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b, seed := seededProducts(t, dbt)
		oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}
		batch := []ProductLite{{SKU: "new-x"}, {SKU: "existing-a"}, {SKU: "new-y"}}
		require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
		ids := b.productIDs(t)
		require.Equal(t, []productEvent{
			{Op: "created", ID: ids["new-x"], Key: "new-x"},
			{Op: "created", ID: ids["new-y"], Key: "new-y"},
		}, b.events(t))
		require.Equal(t, []uint64{ids["new-x"], existingID(dbt, seed[0].ID), ids["new-y"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID})
	})
}

// DO NOTHING on the generated key itself: entities without a key are
// inserted and get theirs in the order GORM maps every multi-row INSERT;
// an entity that gives an existing key is skipped. Entities without a key
// mixed with entities that give a new key of their own cannot be mapped
// (GORM hands the row of a keyed entity to the next one without a key)
// and are refused, rolled back.
func TestUpsertDoNothingGeneratedKeys(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b, seed := seededProducts(t, dbt)
		oc := clause.OnConflict{DoNothing: true}
		batch := []Product{{SKU: "new-x", Name: "x"}, {ID: seed[0].ID, SKU: "existing-a"}, {SKU: "new-y", Name: "y"}}
		require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
		ids := b.productIDs(t)
		require.Equal(t, []productEvent{
			{Op: "created", ID: ids["new-x"], Key: "new-x", Name: "x"},
			{Op: "created", ID: ids["new-y"], Key: "new-y", Name: "y"},
		}, b.events(t))
		require.Equal(t, []uint64{ids["new-x"], seed[0].ID, ids["new-y"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID})
		b.clear(t)

		mixed := []Product{{SKU: "new-1"}, {ID: ids["new-y"] + 100, SKU: "new-2"}, {SKU: "new-3"}}
		err := b.db.Clauses(oc).Create(&mixed).Error
		if dbt.Dialect == dbtest.MySQL {
			// MariaDB returns every row, in order: nothing to map.
			require.NoError(t, err)
			ids = b.productIDs(t)
			require.Equal(t, []uint64{ids["new-1"], ids["new-2"], ids["new-3"]}, []uint64{mixed[0].ID, mixed[1].ID, mixed[2].ID})
			require.Len(t, b.events(t), 3)
			return
		}
		require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
		require.Contains(t, err.Error(), "separate statement")
		require.Empty(t, b.rows(t))
		require.Len(t, b.productIDs(t), 4, "rolled back")
	})
}

// On PostgreSQL a DO NOTHING whose new key a concurrent transaction
// inserts first waits for it and skips the row when it commits: the row
// with the key exists, but it is not this write's, and the write is
// refused. Inside a savepoint (a nested transaction) the rows the write
// inserted are recognised as its own.
func TestUpsertDoNothingConcurrentSameKeyRefused(t *testing.T) {
	t.Parallel()
	dbt := dbtest.Open(t, dbtest.Postgres)
	b, _ := seededProducts(t, dbt)
	oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}

	err := b.db.Transaction(func(tx *gorm.DB) error {
		return tx.Transaction(func(tx *gorm.DB) error {
			return tx.Clauses(oc).Create(&[]Product{{SKU: "existing-a"}, {SKU: "nested", Name: "n"}}).Error
		})
	})
	require.NoError(t, err)
	ids := b.productIDs(t)
	require.Equal(t, []productEvent{{Op: "created", ID: ids["nested"], Key: "nested", Name: "n"}}, b.events(t))
	b.clear(t)

	other := b.db.Begin()
	require.NoError(t, other.Error)
	defer other.Rollback()
	require.NoError(t, other.Create(&Product{SKU: "raced", Name: "theirs"}).Error)
	var otherPID int
	require.NoError(t, other.Raw("SELECT pg_backend_pid()").Scan(&otherPID).Error)

	done := make(chan error, 1)
	go func() {
		done <- b.db.Clauses(oc).Create(&[]Product{{SKU: "new-x", Name: "x"}, {SKU: "raced", Name: "ours"}}).Error
	}()
	// The upsert waits for the other transaction's row lock.
	require.Eventually(t, func() bool {
		var n int
		err := b.db.Raw("SELECT count(*) FROM pg_stat_activity WHERE ? = ANY(pg_blocking_pids(pid))", otherPID).Scan(&n).Error
		return err == nil && n > 0
	}, 30*time.Second, 10*time.Millisecond)
	require.NoError(t, other.Commit().Error)
	err = <-done
	ids = b.productIDs(t)
	require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
	require.Contains(t, err.Error(), "concurrent transaction")
	require.Equal(t, []productEvent{{Op: "created", ID: ids["raced"], Key: "raced", Name: "theirs"}}, b.events(t), "only the other transaction's")
	require.NotContains(t, ids, "new-x", "rolled back")
	var raced Product
	require.NoError(t, b.db.Where("sku = ?", "raced").First(&raced).Error)
	require.Equal(t, "theirs", raced.Name)
}

// MySQL without RETURNING (MySQL, MariaDB before 10.5; here MariaDB with
// GORM's DisableWithReturning): GORM gives the entities whose key is zero
// LAST_INSERT_ID() onwards, the first inserted row's, whether or not their
// rows existed. Each entity gets its own row's key, and the messages carry
// them.
func TestUpsertDoNothingWithoutReturningMySQL(t *testing.T) {
	t.Parallel()
	dbt := dbtest.Open(t, dbtest.MySQL)
	db, err := gorm.Open(mysql.New(mysql.Config{DSN: dbt.DSN, DisableWithReturning: true}), &gorm.Config{Logger: logger.Discard})
	require.NoError(t, err)
	sqlDB, err := db.DB()
	require.NoError(t, err)
	t.Cleanup(func() { sqlDB.Close() })
	dbt.DB = db
	b, seed := seededProducts(t, dbt)
	oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}

	batch := []Product{{SKU: "existing-a"}, {SKU: "new-x", Name: "x"}, {SKU: "existing-b"}, {SKU: "new-y", Name: "y"}}
	require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
	ids := b.productIDs(t)
	require.Len(t, ids, 4)
	require.Equal(t, []productEvent{
		{Op: "created", ID: ids["new-x"], Key: "new-x", Name: "x"},
		{Op: "created", ID: ids["new-y"], Key: "new-y", Name: "y"},
	}, b.events(t))
	require.Equal(t, []uint64{0, ids["new-x"], 0, ids["new-y"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID, batch[3].ID})
	b.clear(t)

	// Generated keys alone keep GORM's; mixed with a new key of its own,
	// refused.
	gen := []Product{{SKU: "g1"}, {ID: seed[0].ID, SKU: "existing-a"}, {SKU: "g2"}}
	require.NoError(t, b.db.Clauses(clause.OnConflict{DoNothing: true}).Create(&gen).Error)
	ids = b.productIDs(t)
	require.Equal(t, []uint64{ids["g1"], seed[0].ID, ids["g2"]}, []uint64{gen[0].ID, gen[1].ID, gen[2].ID})
	require.Len(t, b.events(t), 2)
	b.clear(t)
	mixed := []Product{{SKU: "m1"}, {ID: ids["g2"] + 100, SKU: "m2"}}
	err = b.db.Clauses(clause.OnConflict{DoNothing: true}).Create(&mixed).Error
	require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
	require.Empty(t, b.rows(t))
	require.Len(t, b.productIDs(t), 6, "rolled back")
}

// WAL mode describes the DO NOTHING the same way: the messages emitted
// carry the inserted rows' own ids.
func TestUpsertDoNothingWALMode(t *testing.T) {
	slot := dbtest.NewWALSlot(t)
	dbt := dbtest.OpenWAL(t)
	b := setupWrite(t, dbt, outbox.Config{Name: dbtest.Name("o_"), Mode: outbox.ModeWAL, Rules: productRules()})
	require.NoError(t, b.db.AutoMigrate(&Product{}, &Variant{}))
	require.NoError(t, b.db.Create(&[]Product{{SKU: "existing-a", Name: "a"}}).Error)
	oc := clause.OnConflict{Columns: []clause.Column{{Name: "sku"}}, DoNothing: true}
	batch := []Product{{SKU: "new-x", Name: "x"}, {SKU: "existing-a", Name: "a2"}, {SKU: "new-y", Name: "y"}}
	require.NoError(t, b.db.Clauses(oc).Create(&batch).Error)
	ids := b.productIDs(t)
	var got []productEvent
	for _, e := range decodeAll(t, slot.Messages(t, b.plugin.Config().WALPrefix())) {
		var pe productEvent
		require.NoError(t, json.Unmarshal(e.Value, &pe))
		got = append(got, pe)
	}
	require.Equal(t, []productEvent{
		{Op: "created", ID: ids["existing-a"], Key: "existing-a", Name: "a"},
		{Op: "created", ID: ids["new-x"], Key: "new-x", Name: "x"},
		{Op: "created", ID: ids["new-y"], Key: "new-y", Name: "y"},
	}, got)
	require.Equal(t, []uint64{ids["new-x"], 0, ids["new-y"]}, []uint64{batch[0].ID, batch[1].ID, batch[2].ID})
}
