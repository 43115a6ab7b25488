package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/publisher"
)

// The models of the GORM fidelity tests: an owner with has-many pets and a
// has-one profile, as GORM saves them with their parent, and a model with
// soft delete.
type Owner struct {
	ID      uint64 `gorm:"primaryKey"`
	Name    string `gorm:"size:64"`
	Pets    []Pet
	Profile *Profile
}

type Pet struct {
	ID      uint64 `gorm:"primaryKey"`
	OwnerID uint64
	Name    string `gorm:"size:64"`
}

type Profile struct {
	ID      uint64 `gorm:"primaryKey"`
	OwnerID uint64
	Bio     string `gorm:"size:64"`
}

type Note struct {
	ID        uint64 `gorm:"primaryKey"`
	Text      string `gorm:"size:64"`
	DeletedAt gorm.DeletedAt
}

// events records every change the rules see as "op model id [changed]",
// and the messages' values are the same text.
type events struct {
	mu  sync.Mutex
	all []outbox.Change[any]
}

func eventRule[T any](ev *events, model string, id func(T) uint64, opts ...outbox.RuleOption) outbox.Rule {
	return outbox.On(outbox.Insert|outbox.Update|outbox.Delete, func(c outbox.Change[T]) (*outbox.Message, error) {
		var n uint64
		if !c.Bulk {
			n = id(c.Entity)
		}
		ev.mu.Lock()
		ev.all = append(ev.all, outbox.Change[any]{Op: c.Op, Entity: c.Entity, Changed: c.Changed, SoftDelete: c.SoftDelete, Bulk: c.Bulk, KeyOnly: c.KeyOnly})
		ev.mu.Unlock()
		return &outbox.Message{Topic: model, Key: key(n), Value: fmt.Appendf(nil, "%s %s %d", c.Op, model, n)}, nil
	}, opts...)
}

func fidelityRules(ev *events) []outbox.Rule {
	return []outbox.Rule{
		eventRule(ev, "owner", func(o *Owner) uint64 { return o.ID }),
		eventRule(ev, "pet", func(p *Pet) uint64 { return p.ID }),
		eventRule(ev, "profile", func(p *Profile) uint64 { return p.ID }),
		eventRule(ev, "note", func(n *Note) uint64 { return n.ID }),
	}
}

func setupFidelity(t *testing.T, dbt *dbtest.DB, cfg outbox.Config) *wbundle {
	t.Helper()
	b := setupWrite(t, dbt, cfg)
	require.NoError(t, b.db.AutoMigrate(&Owner{}, &Pet{}, &Profile{}, &Note{}))
	return b
}

// clear deletes the outbox rows written so far.
func (b *wbundle) clear(t *testing.T) {
	t.Helper()
	require.NoError(t, b.db.Table(b.plugin.Config().Tables.MessagesTable()).Where("1 = 1").Delete(&outbox.MessageRow{}).Error)
}

func (b *wbundle) inUse(t *testing.T) int {
	t.Helper()
	sqlDB, err := b.db.DB()
	require.NoError(t, err)
	return sqlDB.Stats().InUse
}

// (a) A struct value whose type cannot be compared with == (slice fields)
// passed to Updates used to panic in the update callback and leak the
// transaction's connection.
func TestUpdatesWithAnUncomparableStructValue(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		ev := &events{}
		panicky := outbox.OnCreate(func(outbox.Change[*Invoice]) (*outbox.Message, error) { panic("rule bug") })
		b := setupFidelity(t, dbt, outbox.Config{Rules: append(fidelityRules(ev), panicky)})
		o := Owner{Name: "a"}
		require.NoError(t, b.db.Create(&o).Error)
		b.clear(t)

		require.NotPanics(t, func() {
			require.NoError(t, b.db.Where("id = ?", o.ID).Updates(Owner{Name: "x"}).Error, "an update by condition, per row")
			n, err := gorm.G[Owner](b.db).Where("id = ?", o.ID).Updates(context.Background(), Owner{Name: "y"})
			require.NoError(t, err)
			require.Equal(t, 1, n)
		})
		var got Owner
		require.NoError(t, b.db.First(&got, o.ID).Error)
		require.Equal(t, "y", got.Name)

		// The same struct value on a loaded model is an update by entity.
		require.NoError(t, b.db.Model(&o).Updates(Owner{Name: "z"}).Error)
		want := fmt.Sprintf("update owner %d", o.ID)
		require.Equal(t, []string{want, want, want}, values(b.rows(t)))

		// A rule that panics fails the write instead of unwinding through
		// GORM with the transaction open.
		var err error
		require.NotPanics(t, func() { err = b.db.Create(&Invoice{Amount: 1}).Error })
		var re *outbox.RuleError
		require.ErrorAs(t, err, &re)
		require.ErrorContains(t, err, "rule bug")
		var n int64
		require.NoError(t, b.db.Model(&Invoice{}).Count(&n).Error)
		require.Zero(t, n)
		require.Zero(t, b.inUse(t), "no connection left behind")
	})
}

// (b) With PrepareStmt at gorm.Open the pool stays a *gorm.PreparedStmtDB,
// as GORM documents, and writes still publish and notify.
func TestPrepareStmtPoolStaysAssertable(t *testing.T) {
	t.Parallel()
	for _, dialect := range dbtest.Dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			dbt := dbtest.Open(t, dialect, dbtest.Options{Config: &gorm.Config{PrepareStmt: true, Logger: logger.Discard}})
			b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
			ps, ok := b.db.ConnPool.(*gorm.PreparedStmtDB)
			require.True(t, ok, "db.ConnPool is %T", b.db.ConnPool)
			o := Order{Status: "new"}
			require.NoError(t, b.db.Create(&o).Error)
			require.Equal(t, []string{"placed:" + strconv.FormatUint(o.ID, 10)}, values(b.rows(t)))
			got, _ := b.taken()
			require.Equal(t, []int{bucketOf(key(o.ID))}, got)
			require.NotEmpty(t, ps.Stmts.Keys(), "statements went through the prepared-statement pool")
			for _, k := range ps.Stmts.Keys() {
				require.False(t, strings.HasPrefix(k, "INSERT INTO "+b.db.Statement.Quote("outbox_messages")), "the outbox's own INSERT is not cached among the application's statements")
				require.NotEqual(t, "SELECT @@max_allowed_packet", k, "nor its reading of MySQL's packet limit")
			}
		})
	}
}

// (c) SkipDefaultTransaction set at gorm.Open (GORM then compiles its
// begin and commit out of the chain) stays atomic for every operation.
func TestSkipDefaultTransactionAtOpenStaysAtomic(t *testing.T) {
	t.Parallel()
	bad := errors.New("refused")
	rule := outbox.On(outbox.Insert|outbox.Update|outbox.Delete, func(c outbox.Change[*Order]) (*outbox.Message, error) {
		switch c.Entity.Status {
		case "big":
			return &outbox.Message{Topic: "orders", Value: make([]byte, outbox.MaxMessageBytesDefault)}, nil
		case "bad":
			return nil, bad
		}
		return &outbox.Message{Topic: "orders", Key: key(c.Entity.ID), Value: []byte(c.Op.String())}, nil
	})
	for _, dialect := range dbtest.Dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			dbt := dbtest.Open(t, dialect, dbtest.Options{Config: &gorm.Config{SkipDefaultTransaction: true, Logger: logger.Discard}})
			b := setupWrite(t, dbt, outbox.Config{Rules: []outbox.Rule{rule}})

			err := b.db.Create(&Order{Status: "big"}).Error
			var tl *outbox.TooLargeError
			require.ErrorAs(t, err, &tl)
			require.Zero(t, b.orders(t), "the business row rolled back with the refused message")

			o := Order{Status: "new"}
			require.NoError(t, b.db.Create(&o).Error)
			require.ErrorIs(t, b.db.Model(&o).Update("status", "bad").Error, bad)
			var got Order
			require.NoError(t, b.db.First(&got, o.ID).Error)
			require.Equal(t, "new", got.Status, "the update rolled back")

			got.Status = "bad"
			require.ErrorIs(t, b.db.Delete(&got).Error, bad)
			require.Equal(t, int64(1), b.orders(t), "the delete rolled back")

			require.Equal(t, []string{"insert"}, values(b.rows(t)))
			require.Zero(t, b.inUse(t))
		})
	}
}

// (i) The write side refuses what the default Kafka publisher refuses,
// counted as its producer counts: nothing that commits is dead-lettered
// at its first publish for its size.
func TestDefaultLimitIsThePublishersLimit(t *testing.T) {
	t.Parallel()
	require.Equal(t, publisher.MaxMessageBytesDefault, outbox.MaxMessageBytesDefault)
	dbt := dbtest.Open(t, dbtest.SQLite)
	b := setupWrite(t, dbt, outbox.Config{})
	require.Equal(t, publisher.MaxMessageBytesDefault, b.plugin.Config().MaxMessageBytes)

	enqueue := func(m *outbox.Message) error {
		return b.db.Transaction(func(tx *gorm.DB) error { return outbox.Enqueue(tx, m) })
	}
	// Key and value alone under the limit, but not with the headers, the
	// message-id header and the framing the producer counts.
	m := &outbox.Message{Topic: "t", Key: []byte("k"), Value: make([]byte, outbox.MaxMessageBytesDefault-1),
		Headers: []outbox.Header{{Key: "h", Value: []byte("v")}}}
	var tl *outbox.TooLargeError
	require.ErrorAs(t, enqueue(m), &tl)
	require.Equal(t, outbox.MaxMessageBytesDefault, tl.Limit)

	m.Value = m.Value[:len(m.Value)-(m.Size()-outbox.MaxMessageBytesDefault)]
	require.Equal(t, outbox.MaxMessageBytesDefault, m.Size())
	require.NoError(t, enqueue(m), "exactly the limit is accepted")
	m2 := &outbox.Message{Topic: "t", Key: []byte("k"), Value: append(slices.Clone(m.Value), 0), Headers: m.Headers}
	require.ErrorAs(t, enqueue(m2), &tl, "one byte over is refused")
	require.Len(t, b.rows(t), 1)
}

// (d) GORM saves new has-one and has-many children with an upsert (ON
// CONFLICT (id) DO UPDATE SET owner_id = …; MySQL ON DUPLICATE KEY
// UPDATE): every child inserted gets an Insert, every existing child
// updated an Update, in the parent's transaction.
func TestAssociationsArePublished(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		ev := &events{}
		b := setupFidelity(t, dbt, outbox.Config{Rules: fidelityRules(ev)})

		o := Owner{Name: "ann", Pets: []Pet{{Name: "rex"}, {Name: "tom"}}, Profile: &Profile{Bio: "hi"}}
		require.NoError(t, b.db.Create(&o).Error)
		require.ElementsMatch(t, []string{
			fmt.Sprintf("insert owner %d", o.ID),
			fmt.Sprintf("insert pet %d", o.Pets[0].ID),
			fmt.Sprintf("insert pet %d", o.Pets[1].ID),
			fmt.Sprintf("insert profile %d", o.Profile.ID),
		}, values(b.rows(t)))
		require.NotEqual(t, o.Pets[0].ID, o.Pets[1].ID)
		b.clear(t)

		// Save with one new child and the existing ones: GORM upserts all.
		o.Pets = append(o.Pets, Pet{Name: "kit"})
		require.NoError(t, b.db.Save(&o).Error)
		require.ElementsMatch(t, []string{
			fmt.Sprintf("update owner %d", o.ID),
			fmt.Sprintf("update pet %d", o.Pets[0].ID),
			fmt.Sprintf("update pet %d", o.Pets[1].ID),
			fmt.Sprintf("insert pet %d", o.Pets[2].ID),
			fmt.Sprintf("update profile %d", o.Profile.ID),
		}, values(b.rows(t)))
		b.clear(t)

		// Association.Append inserts the new child.
		extra := Pet{Name: "bo"}
		require.NoError(t, b.db.Model(&o).Association("Pets").Append(&extra))
		require.Contains(t, values(b.rows(t)), fmt.Sprintf("insert pet %d", extra.ID))
		require.NotContains(t, strings.Join(values(b.rows(t)), ","), "insert pet 0")
		b.clear(t)

		// FullSaveAssociations updates every column of existing children.
		o.Pets[0].Name = "rex2"
		ev.all = nil
		require.NoError(t, b.db.Session(&gorm.Session{FullSaveAssociations: true}).Save(&o).Error)
		require.Contains(t, values(b.rows(t)), fmt.Sprintf("update pet %d", o.Pets[0].ID))
		var renamed *outbox.Change[any]
		for i, c := range ev.all {
			if p, ok := c.Entity.(*Pet); ok && p.ID == o.Pets[0].ID {
				renamed = &ev.all[i]
			}
		}
		require.NotNil(t, renamed)
		require.Contains(t, renamed.Changed, "name")
		b.clear(t)

		// CreateInBatches and FirstOrCreate of parents with new children.
		batch := []Owner{{Name: "b1", Pets: []Pet{{Name: "p1"}}}, {Name: "b2", Pets: []Pet{{Name: "p2"}, {Name: "p3"}}}, {Name: "b3"}}
		require.NoError(t, b.db.CreateInBatches(&batch, 2).Error)
		foc := Owner{Name: "foc", Pets: []Pet{{Name: "p4"}}}
		require.NoError(t, b.db.Where(Owner{Name: "foc"}).FirstOrCreate(&foc).Error)
		want := []string{fmt.Sprintf("insert owner %d", foc.ID), fmt.Sprintf("insert pet %d", foc.Pets[0].ID)}
		for _, ow := range batch {
			want = append(want, fmt.Sprintf("insert owner %d", ow.ID))
			for _, p := range ow.Pets {
				want = append(want, fmt.Sprintf("insert pet %d", p.ID))
			}
		}
		require.ElementsMatch(t, want, values(b.rows(t)))

		// Every message matches a row that exists with that key.
		var pets []Pet
		require.NoError(t, b.db.Find(&pets).Error)
		require.Len(t, pets, 8)
		require.Zero(t, b.inUse(t))
	})
}

// (e) (f) Upserts of batches: rows that existed get nothing (DO NOTHING)
// or an Update, the others an Insert, on every database; a DO NOTHING
// batch whose rows all existed writes nothing and is not refused.
func TestUpsertBatchesAreDescribedExactly(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		require.NoError(t, b.db.Create(&[]Order{{ID: 101, Status: "a"}, {ID: 102, Status: "b"}}).Error)
		b.clear(t)

		err := b.db.Clauses(clause.OnConflict{DoNothing: true}).Create(&[]Order{{ID: 101, Status: "x"}, {ID: 102, Status: "y"}}).Error
		require.NoError(t, err, "nothing was written, nothing to refuse")
		require.Empty(t, b.rows(t))

		err = b.db.Clauses(clause.OnConflict{DoNothing: true}).Create(&[]Order{{ID: 102, Status: "y"}, {ID: 103, Status: "c"}}).Error
		require.NoError(t, err)
		require.Equal(t, []string{"placed:103"}, values(b.rows(t)), "no phantom insert for the row that existed")
		b.clear(t)

		require.NoError(t, b.db.Clauses(clause.OnConflict{DoNothing: true}).Create(&Order{ID: 101, Status: "z"}).Error)
		require.Empty(t, b.rows(t))

		// UpdateAll on a batch: existing rows are updates, new ones inserts.
		batch := []Order{{ID: 101, Status: "a2"}, {ID: 104, Status: "d"}}
		require.NoError(t, b.db.Clauses(clause.OnConflict{UpdateAll: true}).Create(&batch).Error)
		require.Equal(t, []string{"status:?->a2", "placed:104"}, values(b.rows(t)))
		b.clear(t)

		// Save of a slice is such an upsert too; a new row without a key
		// gets the key the database generated.
		saved := []*Order{{ID: 102, Status: "b2"}, {Status: "new"}}
		require.NoError(t, b.db.Save(&saved).Error)
		require.NotZero(t, saved[1].ID)
		require.Equal(t, []string{"status:?->b2", "placed:" + strconv.FormatUint(saved[1].ID, 10)}, values(b.rows(t)))
		var got Order
		require.NoError(t, b.db.First(&got, saved[1].ID).Error)
		require.Equal(t, "new", got.Status, "the key in the message is the row's")
		require.Equal(t, int64(5), b.orders(t))
		b.clear(t)

		if dbt.Dialect == dbtest.Postgres {
			// The sequence is behind a key inserted explicitly: the
			// generated key hits an existing row, which the upsert updates.
			// Refused rather than published as an insert.
			next := saved[1].ID + 1
			require.NoError(t, b.db.Create(&Order{ID: next, Status: "explicit"}).Error)
			b.clear(t)
			err := b.db.Save(&[]*Order{{ID: 101, Status: "a3"}, {Status: "gen"}}).Error
			require.ErrorIs(t, err, outbox.ErrUnsupportedWrite)
			var kept Order
			require.NoError(t, b.db.First(&kept, next).Error)
			require.Equal(t, "explicit", kept.Status, "rolled back")
			require.Empty(t, b.rows(t))
		}
	})
}

// (f) (g) An update that changes nothing publishes the same on every
// database: MySQL counts 0 changed rows where PostgreSQL and SQLite count
// 1 matched row. Save of an unchanged row is one Update, never an Insert
// (MySQL: GORM retries the 0 as an upsert).
func TestUnchangedUpdatesPublishAlike(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		b := setupWrite(t, dbt, outbox.Config{Rules: orderRules()})
		o := Order{Status: "new", Total: 1}
		require.NoError(t, b.db.Create(&o).Error)
		b.clear(t)

		require.NoError(t, b.db.Model(&o).Updates(map[string]any{"status": "new"}).Error)
		require.Equal(t, []string{"status:new->new"}, values(b.rows(t)))
		b.clear(t)

		require.NoError(t, b.db.Save(&o).Error)
		require.Equal(t, []string{"status:?->new"}, values(b.rows(t)))
		require.Equal(t, int64(1), b.orders(t))
		b.clear(t)

		// A row that does not exist is still no update at all.
		require.NoError(t, b.db.Model(&Order{ID: 999}).Updates(map[string]any{"status": "new"}).Error)
		require.Empty(t, b.rows(t))
	})
}

// (h) A rule tells a soft delete from a hard one.
func TestSoftAndHardDeletesAreDistinct(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		ev := &events{}
		b := setupFidelity(t, dbt, outbox.Config{Rules: fidelityRules(ev)})
		ns := []Note{{Text: "a"}, {Text: "b"}, {Text: "c"}}
		require.NoError(t, b.db.Create(&ns).Error)
		ev.all = nil

		require.NoError(t, b.db.Delete(&ns[0]).Error)
		require.NoError(t, b.db.Delete(&Note{}, ns[1].ID).Error)
		require.NoError(t, b.db.Unscoped().Delete(&ns[2]).Error)
		require.NoError(t, b.db.Unscoped().Delete(&ns[0]).Error, "purging a soft-deleted row")

		require.Len(t, ev.all, 4)
		for i, c := range ev.all[:2] {
			require.Equal(t, outbox.Delete, c.Op)
			require.True(t, c.SoftDelete, i)
			require.Equal(t, []string{"deleted_at"}, c.Changed)
		}
		require.False(t, ev.all[1].KeyOnly, "a delete by key values reads the row")
		require.Equal(t, ns[1].ID, ev.all[1].Entity.(*Note).ID)
		require.Equal(t, "b", ev.all[1].Entity.(*Note).Text, "the row as it was before the delete")
		for _, c := range ev.all[2:] {
			require.False(t, c.SoftDelete)
			require.Nil(t, c.Changed)
		}
		var n int64
		require.NoError(t, b.db.Unscoped().Model(&Note{}).Count(&n).Error)
		require.Equal(t, int64(1), n, "the key-only soft delete kept its row")
	})
}

// An update of an entity that holds nothing but its key reads no row: the
// rule is told (KeyOnly), as for a delete. A loaded entity, an update by
// condition and Save are not key-only.
func TestUpdateOfAnEntityKnownByItsKeyOnly(t *testing.T) {
	t.Parallel()
	dbtest.ForEach(t, func(t *testing.T, dbt *dbtest.DB) {
		ev := &events{}
		b := setupFidelity(t, dbt, outbox.Config{Rules: fidelityRules(ev)})
		o := Owner{Name: "a"}
		require.NoError(t, b.db.Create(&o).Error)
		// last is the one change the write made; its entity's name is
		// read now, before the test changes o again.
		last := func(write string) (keyOnly bool, name string) {
			t.Helper()
			require.Len(t, ev.all, 1, write)
			c := ev.all[0]
			ev.all = nil
			require.Equal(t, outbox.Update, c.Op, write)
			return c.KeyOnly, c.Entity.(*Owner).Name
		}
		ev.all = nil

		require.NoError(t, b.db.Model(&Owner{ID: o.ID}).Update("name", "b").Error)
		keyOnly, name := last("by key only")
		require.True(t, keyOnly, "only the key was known")
		require.Equal(t, "b", name, "the column the update set")

		require.NoError(t, b.db.Model(&o).Update("name", "c").Error)
		keyOnly, name = last("a loaded entity")
		require.False(t, keyOnly)
		require.Equal(t, "c", name)

		require.NoError(t, b.db.Model(&Owner{}).Where("id = ?", o.ID).Update("name", "d").Error)
		keyOnly, name = last("by condition")
		require.False(t, keyOnly, "the row is read")
		require.Equal(t, "d", name)

		o.Name = "e"
		require.NoError(t, b.db.Save(&o).Error)
		keyOnly, name = last("save")
		require.False(t, keyOnly)
		require.Equal(t, "e", name)

		// A slice of entities: each is key-only or not by what it held
		// before GORM assigned the new value to every element.
		o2 := Owner{Name: "x"}
		require.NoError(t, b.db.Create(&o2).Error)
		ev.all = nil
		require.NoError(t, b.db.Model(&[]Owner{{ID: o.ID}, o2}).Update("name", "f").Error)
		require.Len(t, ev.all, 2)
		for i, want := range []bool{true, false} {
			c := ev.all[i]
			require.Equal(t, outbox.Update, c.Op)
			require.Equal(t, want, c.KeyOnly, "element %d", i)
			require.Equal(t, "f", c.Entity.(*Owner).Name, "element %d: the column the update set", i)
		}
	})
}
