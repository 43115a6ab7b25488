package outbox

import (
	"context"
	"fmt"
	"reflect"
	"slices"

	"gorm.io/gorm"
)

// Change describes one entity written by a GORM call, as a publish rule
// sees it. T is the type the rule was registered for: a pointer to a
// model struct (*Order) or an interface that pointers to models implement.
type Change[T any] struct {
	// Ctx is the context of the write.
	Ctx context.Context
	// Tx is the transaction of the write. Reads through it see the write;
	// writes through it are part of it.
	Tx *gorm.DB
	// Op is what the write did to the entity.
	Op Operation
	// Entity is the entity as written. After an insert it carries the keys
	// the database generated. For a write by condition (an update or
	// delete that names no entity with a primary key), an update or delete
	// of entities when a rule of the model for the operation has ReadRow,
	// a create from a map, or a write through Table(name) or another
	// struct mapped to the table, it is a fresh value read from the table:
	// the row after an update, the row as it was for a delete, the
	// inserted row. It is the zero T for a bulk change.
	Entity T
	// Before is the row before the update. For an update read from the
	// table (see Entity) it is the row as read, and locked, before the
	// statement. For an update of an entity when no rule of the model for
	// updates has ReadRow it is the model value the update was called on
	// (for a slice of entities, the entity's element), as it was before
	// the update assigned the new values: Before.Status
	// is the old status after db.Model(&order).Update("status", "paid") on
	// a loaded order, only as good as that value (GORM reads nothing), and
	// the zero T for Save and db.Updates(&order), whose model holds the
	// new values.
	// It is the zero T for inserts, deletes, upserts that updated a row
	// and bulk changes.
	Before T
	// Changed lists the columns the write set: every column for an insert,
	// the SET columns of an update (including updated_at when GORM sets
	// it), the DO UPDATE columns of an upsert that found the row, the
	// deleted-at column of a soft delete, nil for a hard delete.
	Changed []string
	// SoftDelete is true for a delete that GORM turned into an UPDATE of
	// the model's gorm.DeletedAt column: the row is still there, hidden
	// from ordinary queries. It is false for a hard delete, of a model
	// without DeletedAt or with Unscoped.
	SoftDelete bool
	// KeyOnly is true for a delete or an update of an entity whose fields
	// other than the primary key were all zero before the write
	// (db.Delete(&Order{ID: 7}), db.Model(&Order{ID: 7}).Update("status",
	// "paid"), each such element of db.Model(&[]Order{...})) when no rule of the model for the operation has ReadRow:
	// the row is not read, and the rule must not rely on other fields: in
	// Entity only the key and the columns the update set hold values, in
	// Before only the key. A write by key values or by condition
	// (db.Delete(&Order{}, 7), db.Model(&Order{}).Where("id = ?", 7).Update(...))
	// reads the row, and so does every write of entities when a rule of
	// the model for the operation has ReadRow: KeyOnly is then false.
	KeyOnly bool
	// Bulk is true for an update or delete by condition seen by a rule
	// built with AllowBulk: one change for the whole statement; Entity is
	// the zero T and RowsAffected says how many rows the statement hit.
	Bulk bool
	// RowsAffected is what the database reported for the statement.
	RowsAffected int64
}

// HasChanged reports whether the write set the column.
func (c Change[T]) HasChanged(column string) bool { return slices.Contains(c.Changed, column) }

// RuleFunc builds the message for one change, or returns nil to publish
// nothing. An error rolls back the whole write.
type RuleFunc[T any] func(Change[T]) (*Message, error)

// RuleOption tunes a rule.
type RuleOption func(*ruleOptions)

type ruleOptions struct {
	bulk    bool
	maxRows int
	readRow bool
}

// AllowBulk makes the rule see an update or delete by condition (one that
// names no entity with a primary key, db.Where("status = ?", "x").Delete(&Order{}))
// as one bulk change for the whole statement: Change.Bulk is set, Entity
// is the zero T and RowsAffected says how many rows the statement hit.
// When every rule of the model for the operation allows bulk, the plugin
// reads no rows and applies no row limit. Without it the rule runs once
// per changed row (see docs/rules.md).
func AllowBulk() RuleOption { return func(o *ruleOptions) { o.bulk = true } }

// MaxRows bounds how many rows one update or delete by condition (or of
// entities read by key for a ReadRow rule) may change for the rule,
// which runs once per row: a write that matches more is refused with a
// *TooManyRowsError before it changes anything. It overrides
// Config.MaxRowsPerWrite for the rule, from 1 to MaxRowsPerWriteMax; the
// smallest bound of the rules a write runs holds.
func MaxRows(n int) RuleOption { return func(o *ruleOptions) { o.maxRows = n } }

// ReadRow makes the plugin read the rows of every update or delete that
// names entities of the model by their primary key, whatever else the
// entities hold: key-only (db.Model(&Order{ID: 7}).Update("status",
// "paid"), db.Delete(&Order{ID: 7})), partly filled
// (db.Updates(&Order{ID: 7, Status: "paid"})), loaded (db.Model(&o).Updates(...),
// db.Updates(&o), db.Delete(&o), db.Delete(&[]Order{...})) or saved
// (db.Save(&o) of an existing row). The write runs as an update or delete
// by condition on the entities' keys, with any condition the caller added
// (db.Model(&o).Where("status = ?", "new")): the plugin reads and locks
// the rows in the write's transaction before the statement, restricts
// the statement to the keys it read and, after an update, reads them
// again. The rule gets the rows from the table, never the caller's value:
// Entity is the row after the update, every column, or the row as it was
// before the delete; Before is the row before the update, also when the
// caller's copy is stale; KeyOnly is false. A key whose row does not
// exist, or does not meet the added conditions, publishes nothing, as no
// row changed. The cost is a SELECT … FOR UPDATE (without the lock on
// SQLite) before each update or delete, and another SELECT after each
// update.
//
// The write is then one by condition for every rule of the model for
// the operation, with ReadRow or not and AllowBulk included: each runs
// once per row read, with the rows read, and the write is bounded by
// Config.MaxRowsPerWrite and MaxRows (a *TooManyRowsError before anything
// changes). An update that changes an entity's primary key is refused
// with ErrUnsupportedWrite, as by condition; one that sets nothing runs
// no statement and reads nothing. db.Save(&o) of a row that does not
// exist matches nothing, and GORM's fallback upsert publishes an Insert,
// as without ReadRow. ReadRow reads nothing for inserts and upserts
// (db.Save of a slice, Clauses(clause.OnConflict{...}).Create, children
// saved with their parent), as without it.
func ReadRow() RuleOption { return func(o *ruleOptions) { o.readRow = true } }

// Rule is a declarative publish rule; build one with On, OnCreate,
// OnUpdate or OnDelete.
type Rule interface {
	// check reports a rule that cannot work, e.g. T neither a pointer to
	// a struct nor an interface.
	check() error
	// matches reports whether the rule applies to the model struct type.
	matches(model reflect.Type) bool
	operations() Operation
	allowsBulk() bool
	// maxRows is the rule's MaxRows, 0 for the Config default.
	maxRows() int
	readsRow() bool
	// modelType is the model struct type of a pointer-to-struct rule,
	// nil for an interface rule.
	modelType() reflect.Type
	// build runs the rule for one entity (a pointer to the model struct,
	// or an invalid Value for bulk changes).
	build(c *change) (*Message, error)
	String() string
}

// change is the untyped form of Change, filled by the callbacks.
type change struct {
	ctx          context.Context
	tx           *gorm.DB
	op           Operation
	entity       reflect.Value // pointer to the model struct, or invalid
	before       reflect.Value // pointer to a copy, or invalid
	changed      []string
	keyOnly      bool
	soft         bool
	bulk         bool
	rowsAffected int64
}

type typedRule[T any] struct {
	ops  Operation
	fn   RuleFunc[T]
	opts ruleOptions
	t    reflect.Type
}

// On builds a rule that runs fn for every entity of type T written with
// one of ops (Insert, Update, Delete, combined with |). T is a pointer to
// a model struct (*Order), or an interface: the rule then applies to every
// model whose pointer implements it.
//
// The rule belongs to the model's table, not to the GORM call: it runs
// once per row that any GORM write changes there, by entity or by
// condition, from a struct or a map, through the model, Table(name) or
// another struct mapped to the table; where the rows cannot be known the
// write is refused with ErrUnsupportedWrite. Updates and deletes by
// condition are bounded by Config.MaxRowsPerWrite or MaxRows. Raw SQL
// (Exec, Raw) is outside the rules. docs/rules.md lists every write shape
// and what it publishes.
//
// The rule runs inside the write's transaction, after GORM's own
// after-hooks and before COMMIT; the message it returns is written in that
// transaction, and an error rolls the write back.
func On[T any](ops Operation, fn RuleFunc[T], opts ...RuleOption) Rule {
	r := &typedRule[T]{ops: ops, fn: fn, t: reflect.TypeFor[T]()}
	for _, o := range opts {
		o(&r.opts)
	}
	return r
}

// OnCreate builds a rule for inserts of T. See On.
func OnCreate[T any](fn RuleFunc[T], opts ...RuleOption) Rule { return On(Insert, fn, opts...) }

// OnUpdate builds a rule for updates of T. See On.
func OnUpdate[T any](fn RuleFunc[T], opts ...RuleOption) Rule { return On(Update, fn, opts...) }

// OnDelete builds a rule for deletes of T. See On.
func OnDelete[T any](fn RuleFunc[T], opts ...RuleOption) Rule { return On(Delete, fn, opts...) }

func (r *typedRule[T]) String() string {
	return fmt.Sprintf("rule(%s on %s)", r.t, r.ops)
}

func (r *typedRule[T]) check() error {
	if r.fn == nil {
		return fmt.Errorf("%s: nil function", r)
	}
	if r.ops == 0 || r.ops&^(Insert|Update|Delete) != 0 {
		return fmt.Errorf("%s: operations must combine Insert, Update and Delete", r)
	}
	switch {
	case r.t.Kind() == reflect.Interface:
	case r.t.Kind() == reflect.Pointer && r.t.Elem().Kind() == reflect.Struct:
	default:
		return fmt.Errorf("%s: T must be a pointer to a model struct or an interface, not %s", r, r.t)
	}
	if r.opts.maxRows < 0 || r.opts.maxRows > MaxRowsPerWriteMax {
		return fmt.Errorf("%s: MaxRows(%d) must be between 1 and %d", r, r.opts.maxRows, MaxRowsPerWriteMax)
	}
	return nil
}

func (r *typedRule[T]) matches(model reflect.Type) bool {
	if r.t.Kind() == reflect.Interface {
		return reflect.PointerTo(model).Implements(r.t)
	}
	return r.t == reflect.PointerTo(model)
}

func (r *typedRule[T]) operations() Operation { return r.ops }
func (r *typedRule[T]) allowsBulk() bool      { return r.opts.bulk }
func (r *typedRule[T]) maxRows() int          { return r.opts.maxRows }
func (r *typedRule[T]) readsRow() bool        { return r.opts.readRow }

func (r *typedRule[T]) modelType() reflect.Type {
	if r.t.Kind() == reflect.Pointer && r.t.Elem().Kind() == reflect.Struct {
		return r.t.Elem()
	}
	return nil
}

func (r *typedRule[T]) build(c *change) (*Message, error) {
	ch := Change[T]{
		Ctx:          c.ctx,
		Tx:           c.tx,
		Op:           c.op,
		Changed:      c.changed,
		KeyOnly:      c.keyOnly,
		SoftDelete:   c.soft,
		Bulk:         c.bulk,
		RowsAffected: c.rowsAffected,
	}
	if c.entity.IsValid() {
		ch.Entity = c.entity.Interface().(T)
	}
	if c.before.IsValid() {
		ch.Before = c.before.Interface().(T)
	}
	return r.fn(ch)
}
