package outbox

import (
	"fmt"
	"reflect"

	"gorm.io/gorm"
	"gorm.io/gorm/callbacks"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"
)

// Instance keys the callbacks keep on a statement.
const (
	keyStartedTx = "outbox:started_transaction"
	keyBefore    = "outbox:before"
	keyBefores   = "outbox:befores"
	keyUpsert    = "outbox:upsert"
	keySetAdded  = "outbox:set_added"
	keyRows      = "outbox:rows"
	keyReturned  = "outbox:returned"
)

// registerCallbacks places the plugin's callbacks. Every callback that
// writes is anchored before gorm:commit_or_rollback_transaction: one
// registered only after gorm:create would run after the implicit
// transaction committed, outside it. The plugin's own begin and end run
// first and last in the chain ("*"): with SkipDefaultTransaction set at
// gorm.Open, GORM compiles its begin and commit out of the chain, and an
// anchor on a callback that is not there places nothing.
func (p *Plugin) registerCallbacks(db *gorm.DB) error {
	prefix := "outbox:" + p.cfg.Name + ":"
	steps := []struct {
		kind   string // create, update or delete
		name   string
		after  string
		before string
		fn     func(*gorm.DB)
	}{
		{"create", "begin", "", "*", p.beginTx},
		{"create", "before_create", "gorm:before_create", "gorm:create", p.beforeCreate},
		{"create", "check_upsert", "gorm:create", "gorm:save_after_associations", p.checkCreated},
		{"create", "after_create", "gorm:after_create", "gorm:commit_or_rollback_transaction", p.afterCreate},
		{"create", "end", "*", "", p.endTx},
		{"update", "begin", "", "*", p.beginTx},
		{"update", "before_update", "gorm:save_before_associations", "gorm:update", p.beforeUpdate},
		{"update", "after_update", "gorm:after_update", "gorm:commit_or_rollback_transaction", p.afterUpdate},
		{"update", "end", "*", "", p.endTx},
		{"delete", "begin", "", "*", p.beginTx},
		{"delete", "before_delete", "gorm:delete_before_associations", "gorm:delete", p.beforeDelete},
		{"delete", "after_delete", "gorm:after_delete", "gorm:commit_or_rollback_transaction", p.afterDelete},
		{"delete", "end", "*", "", p.endTx},
	}
	if p.cfg.GuardRawSQL {
		for _, err := range []error{
			db.Callback().Raw().Before("gorm:raw").Register(prefix+"raw:guard", p.guardRaw),
			db.Callback().Query().Before("gorm:query").Register(prefix+"query:guard", p.guardRaw),
			db.Callback().Row().Before("gorm:row").Register(prefix+"row:guard", p.guardRaw),
		} {
			if err != nil {
				return fmt.Errorf("outbox: register the raw SQL guard: %w", err)
			}
		}
	}
	for _, s := range steps {
		name := prefix + s.kind + ":" + s.name
		var err error
		switch s.kind {
		case "create":
			err = db.Callback().Create().After(s.after).Before(s.before).Register(name, s.fn)
		case "update":
			err = db.Callback().Update().After(s.after).Before(s.before).Register(name, s.fn)
		case "delete":
			err = db.Callback().Delete().After(s.after).Before(s.before).Register(name, s.fn)
		}
		if err != nil {
			return fmt.Errorf("outbox: register callback %s: %w", name, err)
		}
	}
	return nil
}

// beginTx opens a transaction for a write of a model with rules when GORM
// will not (SkipDefaultTransaction), so the business row and its message
// stay atomic. It never writes anything outside a transaction.
func (p *Plugin) beginTx(db *gorm.DB) {
	if db.Error != nil || !db.Config.SkipDefaultTransaction || db.DryRun {
		return
	}
	t := p.resolve(db)
	if t.m == nil || inTransaction(db.Statement.ConnPool) {
		return
	}
	tx := db.Begin()
	if tx.Error != nil {
		_ = db.AddError(fmt.Errorf("outbox: open a transaction for a write of %s with publish rules: %w", t.schema.Name, tx.Error))
		return
	}
	db.Statement.ConnPool = tx.Statement.ConnPool
	db.InstanceSet(keyStartedTx, true)
}

// endTx commits or rolls back the transaction beginTx opened. A write of
// a table with rules that failed reports 0 rows affected: it was rolled
// back, or (in a transaction of the caller's) refused before it ran or
// failed after; either way the caller must not count its rows.
func (p *Plugin) endTx(db *gorm.DB) {
	if db.Error != nil && db.RowsAffected != 0 && p.resolve(db).m != nil {
		db.RowsAffected = 0
		if db.Statement.Result != nil {
			db.Statement.Result.RowsAffected = 0
		}
	}
	if !db.Config.SkipDefaultTransaction {
		return // beginTx opened nothing; checked first: InstanceGet formats a key
	}
	if _, ok := db.InstanceGet(keyStartedTx); !ok {
		return
	}
	if db.Error != nil {
		db.Rollback()
	} else {
		db.Commit()
	}
	db.Statement.ConnPool = db.ConnPool
}

// entities calls fn with a pointer to every model struct the statement
// holds: one for a struct, one per element for a slice or array.
func entities(db *gorm.DB, fn func(ptr reflect.Value) error) error {
	rv := db.Statement.ReflectValue
	switch rv.Kind() {
	case reflect.Struct:
		if rv.CanAddr() {
			return fn(rv.Addr())
		}
		cp := reflect.New(rv.Type())
		cp.Elem().Set(rv)
		return fn(cp)
	case reflect.Slice, reflect.Array:
		for i := 0; i < rv.Len(); i++ {
			e := reflect.Indirect(rv.Index(i))
			for e.Kind() == reflect.Pointer || e.Kind() == reflect.Interface {
				e = reflect.Indirect(e.Elem())
			}
			if e.Kind() != reflect.Struct {
				continue
			}
			if e.CanAddr() {
				if err := fn(e.Addr()); err != nil {
					return err
				}
				continue
			}
			cp := reflect.New(e.Type())
			cp.Elem().Set(e)
			if err := fn(cp); err != nil {
				return err
			}
		}
	}
	return nil
}

func entityCount(db *gorm.DB) int {
	rv := db.Statement.ReflectValue
	switch rv.Kind() {
	case reflect.Struct:
		return 1
	case reflect.Slice, reflect.Array:
		return rv.Len()
	}
	return 0
}

// primaryKeyKnown reports whether every primary key field of the entity
// holds a non-zero value.
func primaryKeyKnown(db *gorm.DB, ptr reflect.Value) bool {
	s := db.Statement.Schema
	if len(s.PrimaryFields) == 0 {
		return false
	}
	for _, f := range s.PrimaryFields {
		if _, zero := f.ValueOf(db.Statement.Context, ptr.Elem()); zero {
			return false
		}
	}
	return true
}

// onlyPrimaryKey reports whether no field but the primary key holds a
// non-zero value.
func onlyPrimaryKey(db *gorm.DB, ptr reflect.Value) bool {
	for _, f := range db.Statement.Schema.Fields {
		if f.PrimaryKey || f.DBName == "" {
			continue
		}
		if _, zero := f.ValueOf(db.Statement.Context, ptr.Elem()); !zero {
			return false
		}
	}
	return true
}

// beforeCreate plans an upsert of a model with rules: which of its
// entities' keys already exist (see upsert.go). An upsert from maps,
// through Table(name) or through another struct mapped to a rule's table
// is refused: which rows it inserted and which it updated cannot be read
// back.
func (p *Plugin) beforeCreate(db *gorm.DB) {
	if db.Error != nil || db.DryRun {
		return
	}
	t := p.resolve(db)
	if !t.m.for_(Insert | Update) {
		return
	}
	oc, ok := statementClause[clause.OnConflict](db, "ON CONFLICT")
	if !ok {
		if isMapCreate(db) && t.m.for_(Insert) {
			returnKeys(db, t)
		}
		return
	}
	if isMapCreate(db) || db.Statement.Schema == nil {
		_ = db.AddError(fmt.Errorf("%w: %s: upsert (ON CONFLICT) from maps: which rows were inserted and which updated cannot be known; upsert structs", ErrUnsupportedWrite, t.schema.Name))
		return
	}
	if entityCount(db) == 0 {
		return
	}
	plan, err := p.planUpsert(db, oc)
	if err != nil {
		_ = db.AddError(err)
		return
	}
	db.InstanceSet(keyUpsert, plan)
}

// checkCreated checks, right after the INSERT of an upsert, that the rows
// it affected agree with the plan beforeCreate made.
func (p *Plugin) checkCreated(db *gorm.DB) {
	if isMapCreate(db) {
		restoreMaps(db)
		return
	}
	c, ok := db.Statement.Clauses["ON CONFLICT"]
	if !ok || db.Error != nil || db.DryRun {
		return // checked first: InstanceGet formats a key
	}
	v, ok := db.InstanceGet(keyUpsert)
	if !ok {
		return
	}
	oc, _ := c.Expression.(clause.OnConflict)
	if err := p.checkUpsert(db, v.(*upsertPlan), oc); err != nil {
		_ = db.AddError(err)
	}
}

// afterCreate runs the Insert rules for every created entity and, for an
// upsert, the Update rules for every entity whose row existed and was
// updated.
func (p *Plugin) afterCreate(db *gorm.DB) {
	if db.Error != nil || db.DryRun {
		return
	}
	t := p.resolve(db)
	if !t.m.for_(Insert | Update) {
		return
	}
	if t.foreign || isMapCreate(db) {
		p.publishCreatedRows(db, t)
		return
	}
	m := t.m
	if entityCount(db) == 0 {
		return
	}
	var plan *upsertPlan
	if _, upsert := db.Statement.Clauses["ON CONFLICT"]; upsert {
		if v, ok := db.InstanceGet(keyUpsert); ok {
			plan = v.(*upsertPlan)
		}
	}
	all := db.Statement.Schema.DBNames
	var updated []string
	if plan != nil && !plan.doNothing {
		updated = upsertColumns(db)
	}
	var msgs []*Message
	i := 0
	err := entities(db, func(ptr reflect.Value) error {
		existed := plan != nil && i < len(plan.existed) && plan.existed[i]
		i++
		var c *change
		var op Operation
		switch {
		case !existed:
			op, c = Insert, &change{entity: ptr, changed: all, rowsAffected: db.RowsAffected}
		case plan.doNothing:
			return nil // the row existed: nothing was written
		default:
			op, c = Update, &change{entity: ptr, changed: updated, rowsAffected: db.RowsAffected}
		}
		if !m.for_(op) {
			return nil
		}
		out, err := p.runRules(db, t, m, op, c)
		msgs = append(msgs, out...)
		return err
	})
	p.finish(db, t, msgs, err)
}

// beforeUpdate keeps a copy of the model value before the update assigns
// the new values, so rules can compare, and computes the SET clause the
// way gorm:update would, keeping it on the statement so the rules learn
// which columns the update wrote (gorm:update drops the clause it builds
// itself). An update that names no entity with a key, or entities with a
// key when a rule of the model has ReadRow, is prepared by byCondition
// (rows.go), once the SET (and with it GORM's WHERE on the entities'
// keys) is built.
func (p *Plugin) beforeUpdate(db *gorm.DB) {
	if db.Error != nil {
		return
	}
	t := p.resolve(db)
	if !t.m.for_(Update) {
		return
	}
	byKey := readsByKey(db, t, Update)
	defer func() {
		if db.Error != nil || db.DryRun {
			return
		}
		if _, ok := db.Statement.Clauses["SET"]; !ok && db.Statement.SQL.Len() == 0 {
			return // nothing to set: gorm:update runs no statement
		}
		if t.foreign || byKey || len(keyedEntities(db)) == 0 {
			p.byCondition(db, t, Update, byKey)
		}
	}()
	// When the model is also the source of the values (Save, Updates on
	// the model itself), it already holds the new values; a write read by
	// key takes Before from the table.
	if !byKey && !sameValue(db.Statement.Dest, db.Statement.Model) {
		switch rv := db.Statement.ReflectValue; rv.Kind() {
		case reflect.Struct:
			cp := reflect.New(rv.Type())
			cp.Elem().Set(rv)
			db.InstanceSet(keyBefore, cp)
		case reflect.Slice, reflect.Array:
			// db.Model(&[]Order{{ID: 1}, {ID: 2}}).Update(...): GORM
			// assigns the new values to every element; each keeps its
			// copy, found again by the element's address.
			befores := map[uintptr]reflect.Value{}
			_ = entities(db, func(ptr reflect.Value) error {
				cp := reflect.New(ptr.Elem().Type())
				cp.Elem().Set(ptr.Elem())
				befores[ptr.Pointer()] = cp
				return nil
			})
			db.InstanceSet(keyBefores, befores)
		}
	}
	if _, ok := db.Statement.Clauses["SET"]; ok || db.Statement.SQL.Len() != 0 {
		return
	}
	if set := callbacks.ConvertToAssignments(db.Statement); len(set) != 0 {
		db.Statement.AddClause(set)
		db.InstanceSet(keySetAdded, true)
	}
}

// sameValue reports whether the statement's Dest and Model are the same
// value. They are interfaces that may hold structs of types that cannot be
// compared with == (slice or map fields), as in
// db.Where(...).Updates(User{...}), where GORM sets Model to Dest.
func sameValue(a, b any) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	if va.Type() != vb.Type() {
		return false
	}
	if va.Comparable() {
		return va.Equal(vb)
	}
	return reflect.DeepEqual(a, b)
}

// setColumns returns the columns of the statement's SET clause.
func setColumns(db *gorm.DB) []string {
	set, ok := statementClause[clause.Set](db, "SET")
	if !ok {
		return nil
	}
	return columnNames(set)
}

// statementClause returns the expression of the statement's clause name,
// and false when the statement has no such clause or its expression is
// not a T.
func statementClause[T clause.Expression](db *gorm.DB, name string) (T, bool) {
	c, ok := db.Statement.Clauses[name]
	if !ok {
		var zero T
		return zero, false
	}
	e, ok := c.Expression.(T)
	return e, ok
}

// columnNames returns the columns a SET (or DO UPDATE SET) assigns.
func columnNames(set clause.Set) []string {
	cols := make([]string, 0, len(set))
	for _, a := range set {
		cols = append(cols, a.Column.Name)
	}
	return cols
}

// afterUpdate runs the Update rules for the updated entity, or for a bulk
// update when every rule opted in.
func (p *Plugin) afterUpdate(db *gorm.DB) {
	changed := setColumns(db)
	if _, ok := db.InstanceGet(keySetAdded); ok {
		delete(db.Statement.Clauses, "SET")
	}
	if db.Error != nil || db.DryRun || db.Statement.SQL.Len() == 0 {
		return // a failed update, a dry run, or nothing to set: no UPDATE ran
	}
	t := p.resolve(db)
	if !t.m.for_(Update) {
		return
	}
	if v, ok := db.InstanceGet(keyRows); ok {
		p.publishRows(db, v.(*rowSet), Update, changed, false)
		return
	}
	m := t.m
	affected := db.RowsAffected
	if affected == 0 {
		affected = p.matchedUnchanged(db)
		saveMatched(db, affected)
	}
	if affected == 0 {
		return // no row matched: nothing was written
	}
	var before reflect.Value
	keyOnly := false
	if v, ok := db.InstanceGet(keyBefore); ok {
		before = v.(reflect.Value)
		// db.Model(&Order{ID: 7}).Update(...): nothing but the key was
		// known before the write, and nothing is read.
		keyOnly = onlyPrimaryKey(db, before)
	}
	var befores map[uintptr]reflect.Value // nil but for a slice of entities
	if v, ok := db.InstanceGet(keyBefores); ok {
		befores = v.(map[uintptr]reflect.Value)
	}
	p.runEach(db, t, m, Update, ownEntities(db, t), changed, false, func(ptr reflect.Value) *change {
		c := &change{entity: ptr, before: before, keyOnly: keyOnly, changed: changed, rowsAffected: affected}
		if b, ok := befores[ptr.Pointer()]; ok {
			c.before, c.keyOnly = b, onlyPrimaryKey(db, b)
		}
		return c
	})
}

// saveMatched tells GORM's Save that its update matched rows, which
// MySQL reports as not affected when their values did not change: Save
// answers 0 rows affected with a second write, an upsert that saves every
// association again.
func saveMatched(db *gorm.DB, matched int64) {
	if sel := db.Statement.Selects; db.RowsAffected == 0 && matched > 0 && len(sel) == 1 && sel[0] == "*" {
		db.RowsAffected = matched
	}
}

// readsByKey reports whether a write of op names entities of the rules'
// model with a known primary key while a rule of the model for op was
// built with ReadRow: the write is then read as a write by condition on
// the entities' keys, whatever else the entities hold.
func readsByKey(db *gorm.DB, t target, op Operation) bool {
	if t.foreign || t.m == nil || t.m.readRow&op == 0 || db.Statement.Schema == nil {
		return false
	}
	return len(keyedEntities(db)) > 0
}

// keyedEntities returns the statement's entities whose primary key is
// known.
func keyedEntities(db *gorm.DB) []reflect.Value {
	var targets []reflect.Value
	_ = entities(db, func(ptr reflect.Value) error {
		if primaryKeyKnown(db, ptr) {
			targets = append(targets, ptr)
		}
		return nil
	})
	return targets
}

// ownEntities returns the statement's keyed entities when they are
// values of the rules' model; none for a write through Table(name) or
// another struct, which reaches here only when every rule allows bulk.
func ownEntities(db *gorm.DB, t target) []reflect.Value {
	if t.foreign {
		return nil
	}
	return keyedEntities(db)
}

// runEach runs the rules of op for each target, with the change changeOf
// makes of it, or the bulk rules when there is no target, and finishes the
// statement with the messages.
func (p *Plugin) runEach(db *gorm.DB, t target, m *modelRules, op Operation, targets []reflect.Value, changed []string, soft bool, changeOf func(ptr reflect.Value) *change) {
	var msgs []*Message
	var err error
	if len(targets) == 0 {
		msgs, err = p.runBulk(db, t, m, op, changed, soft)
	} else {
		for _, ptr := range targets {
			var out []*Message
			out, err = p.runRules(db, t, m, op, changeOf(ptr))
			msgs = append(msgs, out...)
			if err != nil {
				break
			}
		}
	}
	p.finish(db, t, msgs, err)
}

// matchedUnchanged returns, on MySQL and MariaDB, how many rows an update
// that reported 0 rows affected matched: they count only the rows whose
// values changed, where PostgreSQL and SQLite count every row the WHERE
// matched. Re-reading the same WHERE is exact: nothing changed. So an
// update rule runs for a same-value update on every database.
func (p *Plugin) matchedUnchanged(db *gorm.DB) int64 {
	if db.Dialector.Name() != "mysql" {
		return 0
	}
	where, ok := db.Statement.Clauses["WHERE"]
	if !ok {
		return 0
	}
	var n int64
	q := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Unscoped().
		Model(reflect.New(db.Statement.Schema.ModelType).Interface()).Table(db.Statement.Table)
	q.Statement.AddClause(where.Expression.(clause.Where))
	if err := q.Count(&n).Error; err != nil {
		_ = db.AddError(fmt.Errorf("outbox: %s: count the rows an unchanged update matched: %w", db.Statement.Schema.Name, err))
		return 0
	}
	return n
}

// beforeDelete prepares a delete that names no entity with a key (a
// delete by condition, by key values, or through Table(name) or another
// struct), or entities with a key when a rule of the model has ReadRow:
// see byCondition (rows.go).
func (p *Plugin) beforeDelete(db *gorm.DB) {
	if db.Error != nil || db.DryRun {
		return
	}
	t := p.resolve(db)
	if !t.m.for_(Delete) {
		return
	}
	byKey := readsByKey(db, t, Delete)
	if t.foreign || byKey {
		// gorm:delete adds the keys of the statement's entities to the
		// WHERE; add them first, so the rows read are the rows deleted.
		if s := db.Statement.Schema; s != nil {
			for i, v := range []reflect.Value{db.Statement.ReflectValue, reflect.ValueOf(db.Statement.Model)} {
				if !v.IsValid() || i == 1 && sameValue(db.Statement.Model, db.Statement.Dest) {
					continue // no model, or the model is the entities
				}
				_, vals := schema.GetIdentityFieldValuesMap(db.Statement.Context, v, s.PrimaryFields)
				if column, values := schema.ToQueryValues(db.Statement.Table, s.PrimaryFieldDBNames, vals); len(values) > 0 {
					db.Statement.AddClause(clause.Where{Exprs: []clause.Expression{clause.IN{Column: column, Values: values}}})
				}
			}
		}
	} else if len(keyedEntities(db)) > 0 {
		return
	}
	p.byCondition(db, t, Delete, byKey)
}

// afterDelete runs the Delete rules for every deleted entity, or for
// every row a delete by condition deleted.
func (p *Plugin) afterDelete(db *gorm.DB) {
	if db.Error != nil || db.DryRun {
		return
	}
	t := p.resolve(db)
	if !t.m.for_(Delete) {
		return
	}
	// A soft delete (a model with gorm.DeletedAt, not Unscoped) is an
	// UPDATE of the deleted-at column: GORM leaves its SET clause on the
	// statement.
	changed := setColumns(db)
	soft := changed != nil
	if v, ok := db.InstanceGet(keyRows); ok {
		p.publishRows(db, v.(*rowSet), Delete, changed, soft)
		return
	}
	if db.RowsAffected == 0 {
		return
	}
	p.runEach(db, t, t.m, Delete, ownEntities(db, t), changed, soft, func(ptr reflect.Value) *change {
		return &change{entity: ptr, keyOnly: onlyPrimaryKey(db, ptr), changed: changed, soft: soft, rowsAffected: db.RowsAffected}
	})
}

// runBulk runs the rules for a statement by condition that names no
// entity: only rules that opted in with AllowBulk may see it; any other
// rule makes the write fail.
func (p *Plugin) runBulk(db *gorm.DB, t target, m *modelRules, op Operation, changed []string, soft bool) ([]*Message, error) {
	for _, r := range m.rules {
		if r.operations()&op != 0 && !r.allowsBulk() {
			return nil, fmt.Errorf("%w: %s: %s by condition: %s needs each row, and the rows could not be read before the statement", ErrUnsupportedWrite, t.schema.Name, op, r)
		}
	}
	if db.RowsAffected == 0 {
		return nil, nil
	}
	return p.runRules(db, t, m, op, &change{bulk: true, changed: changed, soft: soft, rowsAffected: db.RowsAffected})
}

// runRules calls every rule of m that covers op and returns their
// messages. A rule that panics fails the write with a *RuleError instead
// of unwinding through GORM, which would leave the write's transaction,
// and its connection, open.
func (p *Plugin) runRules(db *gorm.DB, t target, m *modelRules, op Operation, c *change) (out []*Message, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &RuleError{Model: t.schema.ModelType.String(), Operation: op, Err: fmt.Errorf("rule panicked: %v", v)}
		}
	}()
	c.ctx = db.Statement.Context
	c.tx = db.Session(&gorm.Session{NewDB: true})
	c.op = op
	for _, r := range m.rules {
		if r.operations()&op == 0 {
			continue
		}
		msg, err := r.build(c)
		if err == nil && msg != nil {
			// Prepared (trace headers added, validated) here, not when
			// written, so that a refusal names the model and the rule
			// that built the message.
			err = p.prepare(c.ctx, msg)
		}
		if err != nil {
			return out, &RuleError{Model: t.schema.ModelType.String(), Operation: op, Rule: r.String(), Err: err}
		}
		if msg != nil {
			out = append(out, msg)
		}
	}
	return out, nil
}

// finish writes the messages the rules built, in the write's transaction,
// or records the error so GORM rolls the write back.
func (p *Plugin) finish(db *gorm.DB, t target, msgs []*Message, err error) {
	if err != nil {
		_ = db.AddError(err)
		return
	}
	if len(msgs) == 0 {
		return
	}
	if !inTransaction(db.Statement.ConnPool) {
		_ = db.AddError(fmt.Errorf("%w (the write of %s ran outside a transaction)", ErrNoTransaction, t.schema.Name))
		return
	}
	if err := p.insertPrepared(db, msgs); err != nil {
		_ = db.AddError(err)
	}
}
