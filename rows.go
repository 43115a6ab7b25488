package outbox

import (
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/callbacks"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"
)

// Writes by condition, per row.
//
// An update or delete that names no entity with a primary key
// (db.Where(…).Delete(&T{}), db.Model(&T{}).Where(…).Update(…), the
// SET fk = NULL WHERE … of an association unlink, gorm.G[T] forms) runs
// its rules once per row it changes. So does one that names entities with
// a primary key when a rule of the model for the operation has ReadRow:
// its condition is the keys GORM takes from the entities, with any
// condition the caller added. Before the statement runs, the plugin reads
// the rows its WHERE matches, in the write's transaction, into fresh
// values of the rule's model:
//
//	SELECT * FROM t WHERE <the statement's conditions> ORDER BY <pk> LIMIT n+1 FOR UPDATE
//
// (no FOR UPDATE on SQLite), refuses the write with a *TooManyRowsError
// when more than n rows match, and otherwise replaces the statement's
// WHERE with the keys it read (pk IN (…)). After an update it reads the
// same keys again: the rule sees the row as it is after the update and,
// in Change.Before, as it was before. A delete publishes the rows as they
// were. So the statement changes exactly the rows that were read:
//
//   - PostgreSQL: SELECT … FOR UPDATE locks every row it returns; a row a
//     concurrent transaction changed is waited for and its WHERE checked
//     again on the new version (EvalPlanQual in READ COMMITTED; a
//     serialization error in REPEATABLE READ and SERIALIZABLE). No other
//     transaction can update or delete a locked row before the write
//     commits, and rows inserted after the read are not among the keys.
//   - MySQL/MariaDB (InnoDB): SELECT … FOR UPDATE is a locking read of
//     the newest committed versions in every isolation level, with the
//     same guarantee; the statement's ORDER BY and LIMIT are applied to
//     the read.
//   - SQLite: one writer at a time. With BEGIN IMMEDIATE (_txlock=immediate)
//     the write's transaction holds the write lock from its start, so
//     nothing can change between the read and the statement; with a
//     deferred BEGIN a concurrent commit in between makes the statement
//     fail with SQLITE_BUSY, and nothing is written.
//
// As a last check, where the database counts every row the statement
// matched (PostgreSQL and SQLite, and deletes on MySQL), a count other
// than the number of keys read fails the write with ErrUnsupportedWrite.
//
// RETURNING (PostgreSQL, SQLite) would save the read after an update, but
// not the read before it: the limit must hold before anything changes,
// also in a transaction whose owner ignores the error and commits, and
// Change.Before needs the old row. One mechanism on the three databases
// is also one set of semantics to test.

// target is the rule set a write runs: the rules of the statement's
// model, or, for a write through Table(name) without a model or through
// another struct mapped to the same table, the rules of the model that
// owns the table.
type target struct {
	m      *modelRules
	schema *schema.Schema // the rules' model
	// foreign is true when the statement's model is not the rules'
	// model: the rows are read from the table into the rules' model.
	foreign bool
}

// resolve returns the rules that apply to the statement's rows.
func (p *Plugin) resolve(db *gorm.DB) target {
	stmt := db.Statement
	if s := stmt.Schema; s != nil {
		if m := p.rulesFor(s.ModelType); m != nil {
			if _, ok := p.tables.Load(s.Table); !ok {
				p.tables.Store(s.Table, s.ModelType)
			}
			return target{m: m, schema: s}
		}
	}
	if stmt.Table == "" {
		return target{}
	}
	mt := p.modelForTable(db, stmt.Table)
	if mt == nil {
		return target{}
	}
	m := p.rulesFor(mt)
	if m == nil {
		return target{}
	}
	s, err := parseModel(db, mt)
	if err != nil {
		return target{}
	}
	return target{m: m, schema: s, foreign: true}
}

// modelForTable returns the model struct type with rules whose table is
// name, or nil. The table of every pointer-to-struct rule type is known
// once the first write asks; a model matched only by an interface rule
// is known once it has been written through its own type.
func (p *Plugin) modelForTable(db *gorm.DB, name string) reflect.Type {
	if !p.tablesKnown.Load() {
		p.mu.RLock()
		rules := append([]Rule(nil), p.rules...)
		p.mu.RUnlock()
		for _, r := range rules {
			mt := r.modelType()
			if mt == nil {
				continue
			}
			if s, err := parseModel(db, mt); err == nil {
				if _, ok := p.tables.Load(s.Table); !ok {
					p.tables.Store(s.Table, mt)
				}
			}
		}
		p.tablesKnown.Store(true)
	}
	if v, ok := p.tables.Load(name); ok {
		return v.(reflect.Type)
	}
	return nil
}

// parseModel returns the schema of a model struct type, from GORM's
// cache, on a statement of its own (a Session shares the caller's
// statement until a method is chained).
func parseModel(db *gorm.DB, mt reflect.Type) (*schema.Schema, error) {
	stmt := &gorm.Statement{DB: db}
	if err := stmt.Parse(reflect.New(mt).Interface()); err != nil {
		return nil, err
	}
	return stmt.Schema, nil
}

// rawWrite finds the tables raw SQL writes to.
var rawWrite = regexp.MustCompile("(?is)\\b(?:insert\\s+(?:ignore\\s+)?into|replace\\s+into|merge\\s+into|update|delete\\s+from|truncate(?:\\s+table)?)\\s+((?:[`\"\\[]?\\w+[`\"\\]]?\\.)?[`\"\\[]?\\w+[`\"\\]]?)")

// guardRaw refuses, with Config.GuardRawSQL, raw SQL that writes to a
// table with rules. GORM's own statements are built by its callbacks,
// after this one: only Exec and Raw arrive with their SQL already written.
func (p *Plugin) guardRaw(db *gorm.DB) {
	if db.Error != nil || db.Statement.SQL.Len() == 0 {
		return
	}
	sql := db.Statement.SQL.String()
	for _, m := range rawWrite.FindAllStringSubmatch(sql, -1) {
		name := strings.Trim(m[1], "`\"[]")
		if i := strings.LastIndexByte(name, '.'); i >= 0 {
			name = strings.Trim(name[i+1:], "`\"[]")
		}
		if p.modelForTable(db, name) == nil && p.modelForTable(db, strings.ToLower(name)) == nil {
			continue
		}
		if len(sql) > 200 {
			sql = sql[:200]
		}
		_ = db.AddError(&RawWriteError{Table: name, SQL: sql})
		return
	}
}

// rowSet is what readRows found before a write by condition.
type rowSet struct {
	t      target
	shape  string        // "by condition", or "of entities" (read by key)
	before reflect.Value // *[]Model, in key order
	keys   []string      // keyString per row
	perRow *modelRules   // the rules that run once per row
	bulk   *modelRules   // the AllowBulk rules, run once for the statement
}

// splitRules returns the rules of m covering op that run per row and
// those that opted in to one bulk change per statement; with byKey (a
// write of entities read by key for a ReadRow rule) every rule runs per
// row, as for any write of entities.
func splitRules(m *modelRules, op Operation, byKey bool) (perRow, bulk *modelRules) {
	perRow, bulk = &modelRules{}, &modelRules{}
	for _, r := range m.rules {
		if r.operations()&op == 0 {
			continue
		}
		if r.allowsBulk() && !byKey {
			bulk.ops |= r.operations()
			bulk.rules = append(bulk.rules, r)
		} else {
			perRow.ops |= r.operations()
			perRow.rules = append(perRow.rules, r)
		}
	}
	return perRow, bulk
}

// rowLimit is the most rows a write by condition may change for the
// rules: the smallest MaxRows of a rule, or Config.MaxRowsPerWrite.
func (p *Plugin) rowLimit(m *modelRules) int {
	limit := p.cfg.MaxRowsPerWrite
	for _, r := range m.rules {
		if n := r.maxRows(); n > 0 && n < limit {
			limit = n
		}
	}
	return limit
}

// byCondition prepares an update or delete that names no entity: it reads
// and locks the matching rows, refuses the write when they are more than
// the limit, and restricts the statement to their keys. It does nothing
// when every rule covering op opted in to bulk changes, or when GORM will
// refuse the statement itself (no WHERE without AllowGlobalUpdate).
// With byKey it prepares, the same way, a write of entities read by key
// for a ReadRow rule: the statement's WHERE holds their keys, and every
// rule runs once per row read.
func (p *Plugin) byCondition(db *gorm.DB, t target, op Operation, byKey bool) {
	stmt := db.Statement
	perRow, bulk := splitRules(t.m, op, byKey)
	if len(perRow.rules) == 0 {
		return
	}
	where, hasWhere := statementClause[clause.Where](db, "WHERE")
	if (!hasWhere || len(where.Exprs) == 0) && !db.AllowGlobalUpdate {
		return // GORM fails the statement with ErrMissingWhereClause
	}
	shape := "by condition"
	if byKey {
		shape = "of entities"
	}
	fail := func(format string, args ...any) {
		_ = db.AddError(fmt.Errorf("%w: %s: %s %s: %s", ErrUnsupportedWrite, t.schema.Name, op, shape, fmt.Sprintf(format, args...)))
	}
	if stmt.SQL.Len() != 0 {
		fail("the statement was built before the rules could read its rows")
		return
	}
	if len(t.schema.PrimaryFields) == 0 {
		fail("the model has no primary key: the changed rows cannot be told apart")
		return
	}
	// The keys are bound as parameters: a key of k columns binds k per
	// row.
	limit := min(p.rowLimit(perRow), MaxRowsPerWriteMax/len(t.schema.PrimaryFields))
	rows, err := p.readRows(db, t, where, limit+1)
	if err != nil {
		_ = db.AddError(fmt.Errorf("outbox: %s: read the rows a %s %s matches: %w", t.schema.Name, op, shape, err))
		return
	}
	n := rows.Elem().Len()
	if n > limit {
		_ = db.AddError(&TooManyRowsError{Model: t.schema.ModelType.String(), Table: stmt.Table, Operation: op, Limit: limit})
		return
	}
	keys := make([][]any, n)
	names := make([]string, n)
	for i := range n {
		keys[i] = keyValues(db, t.schema.PrimaryFields, rows.Elem().Index(i))
		names[i] = keyString(keys[i])
	}
	// The statement changes the rows read, and only them. An
	// UPDATE … FROM keeps its conditions: they join the other tables the
	// SET may read from.
	cond := clause.Expression(clause.Expr{SQL: "1 = 0"})
	if n > 0 {
		cond = keyCondition(t.schema.PrimaryFields, keys)
	}
	exprs := []clause.Expression{cond}
	if _, ok := stmt.Clauses["FROM"]; ok && op == Update {
		exprs = append(append([]clause.Expression(nil), where.Exprs...), cond)
	}
	stmt.Clauses["WHERE"] = clause.Clause{Name: "WHERE", Expression: clause.Where{Exprs: exprs}}
	db.InstanceSet(keyRows, &rowSet{t: t, shape: shape, before: rows, keys: names, perRow: perRow, bulk: bulk})
}

// readRows reads, in the write's transaction and locked where the
// database can, the rows the statement's WHERE matches, at most limit,
// into a new *[]Model of the rules' model, ordered by key.
func (p *Plugin) readRows(db *gorm.DB, t target, where clause.Where, limit int) (reflect.Value, error) {
	stmt := db.Statement
	q := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Table(stmt.Table)
	if stmt.Schema != nil {
		// The statement's model brings its soft-delete condition, as
		// GORM adds it to the UPDATE or the soft DELETE.
		q = q.Model(reflect.New(stmt.Schema.ModelType).Interface())
	}
	if stmt.Unscoped {
		q = q.Unscoped()
	}
	if from, ok := statementClause[clause.From](db, "FROM"); ok && len(where.Exprs) > 0 {
		// UPDATE t SET … FROM other WHERE <join>: the rows of t for
		// which the join finds a row, each once.
		sub := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Table(stmt.Table).Select("1")
		sub.Statement.AddClause(from)
		sub.Statement.AddClause(where)
		q = q.Where("EXISTS (?)", sub)
	} else if len(where.Exprs) > 0 {
		q.Statement.AddClause(where)
	}
	mysql := db.Dialector.Name() == "mysql"
	if ob, ok := statementClause[clause.OrderBy](db, "ORDER BY"); ok && mysql {
		q.Statement.AddClause(ob)
	} else {
		cols := make([]clause.OrderByColumn, len(t.schema.PrimaryFields))
		for i, f := range t.schema.PrimaryFields {
			cols[i] = clause.OrderByColumn{Column: clause.Column{Table: clause.CurrentTable, Name: f.DBName}}
		}
		q.Statement.AddClause(clause.OrderBy{Columns: cols})
	}
	// MySQL applies an UPDATE's or DELETE's ORDER BY and LIMIT; the
	// other dialects of GORM drop them.
	if l, ok := statementClause[clause.Limit](db, "LIMIT"); ok && mysql && l.Limit != nil && *l.Limit < limit {
		limit = *l.Limit
	}
	q = q.Limit(limit)
	switch db.Dialector.Name() {
	case "postgres", "mysql":
		q = q.Clauses(clause.Locking{Strength: clause.LockingStrengthUpdate})
	}
	out := reflect.New(reflect.SliceOf(t.schema.ModelType))
	if err := q.Find(out.Interface()).Error; err != nil {
		return reflect.Value{}, err
	}
	return out, nil
}

// readKeys reads the rows with the given keys from the statement's table
// into the rules' model, soft-deleted rows included, indexed by
// keyString.
func (p *Plugin) readKeys(db *gorm.DB, t target, keys [][]any) (map[string]reflect.Value, error) {
	out := make(map[string]reflect.Value, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	q := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Unscoped().Table(db.Statement.Table).
		Where(keyCondition(t.schema.PrimaryFields, keys))
	rows := reflect.New(reflect.SliceOf(t.schema.ModelType))
	if err := q.Find(rows.Interface()).Error; err != nil {
		return nil, err
	}
	for i := 0; i < rows.Elem().Len(); i++ {
		row := rows.Elem().Index(i)
		out[keyString(keyValues(db, t.schema.PrimaryFields, row))] = row.Addr()
	}
	return out, nil
}

// keyValues returns the values of the key fields of a model struct.
func keyValues(db *gorm.DB, fields []*schema.Field, row reflect.Value) []any {
	vals := make([]any, len(fields))
	for i, f := range fields {
		vals[i], _ = f.ValueOf(db.Statement.Context, row)
	}
	return vals
}

// keyCondition matches the rows with the given keys.
func keyCondition(fields []*schema.Field, keys [][]any) clause.Expression {
	if len(fields) == 1 {
		vals := make([]any, len(keys))
		for i, k := range keys {
			vals[i] = k[0]
		}
		return clause.IN{Column: clause.Column{Table: clause.CurrentTable, Name: fields[0].DBName}, Values: vals}
	}
	ors := make([]clause.Expression, len(keys))
	for i, k := range keys {
		ands := make([]clause.Expression, len(fields))
		for j, f := range fields {
			ands[j] = clause.Eq{Column: clause.Column{Table: clause.CurrentTable, Name: f.DBName}, Value: k[j]}
		}
		ors[i] = clause.And(ands...)
	}
	return clause.Or(ors...)
}

// publishRows runs the rules of a write by condition once per row it
// changed, and the AllowBulk rules once for the statement.
func (p *Plugin) publishRows(db *gorm.DB, rs *rowSet, op Operation, changed []string, soft bool) {
	n := rs.before.Elem().Len()
	countsMatched := db.Dialector.Name() != "mysql" || op == Delete || soft
	if countsMatched && db.RowsAffected != int64(n) {
		p.finish(db, rs.t, nil, fmt.Errorf("%w: %s: %s %s changed %d rows where %d were read and locked: a concurrent transaction changed them; which rows changed cannot be known",
			ErrUnsupportedWrite, rs.t.schema.Name, op, rs.shape, db.RowsAffected, n))
		return
	}
	if op == Update {
		saveMatched(db, int64(n))
	}
	var after map[string]reflect.Value
	if op == Update && n > 0 {
		keys := make([][]any, n)
		for i := range n {
			keys[i] = keyValues(db, rs.t.schema.PrimaryFields, rs.before.Elem().Index(i))
		}
		var err error
		if after, err = p.readKeys(db, rs.t, keys); err != nil {
			p.finish(db, rs.t, nil, fmt.Errorf("outbox: %s: read the rows an update %s changed: %w", rs.t.schema.Name, rs.shape, err))
			return
		}
	}
	var msgs []*Message
	for i := range n {
		before := rs.before.Elem().Index(i).Addr()
		c := &change{entity: before, changed: changed, soft: soft, rowsAffected: db.RowsAffected}
		if op == Update {
			row, ok := after[rs.keys[i]]
			if !ok {
				p.finish(db, rs.t, nil, fmt.Errorf("%w: %s: update %s changed the primary key of a row: its new key cannot be known", ErrUnsupportedWrite, rs.t.schema.Name, rs.shape))
				return
			}
			c.entity, c.before = row, before
		}
		out, err := p.runRules(db, rs.t, rs.perRow, op, c)
		msgs = append(msgs, out...)
		if err != nil {
			p.finish(db, rs.t, msgs, err)
			return
		}
	}
	if len(rs.bulk.rules) > 0 && n > 0 {
		out, err := p.runRules(db, rs.t, rs.bulk, op, &change{bulk: true, changed: changed, soft: soft, rowsAffected: db.RowsAffected})
		msgs = append(msgs, out...)
		if err != nil {
			p.finish(db, rs.t, msgs, err)
			return
		}
	}
	p.finish(db, rs.t, msgs, nil)
}

// createdKeys returns the primary keys, in the rules' model's key order,
// of the rows a create through a map, Table(name) or another struct
// inserted. GORM writes a generated key back into the map (RETURNING on
// PostgreSQL and SQLite, LastInsertId under the key's column name or
// "@id" on MySQL) and into the struct.
func createdKeys(db *gorm.DB, t target) ([][]any, error) {
	keys, err := knownKeys(db, t)
	if err == nil || !errors.Is(err, errKeyUnknown) || len(t.schema.PrimaryFields) != 1 || db.RowsAffected != 1 {
		return keys, err
	}
	// One row whose generated key GORM did not write back (a struct
	// whose key field is not readable, `gorm:"->:false"`): the
	// connection's last generated key for this table is that row's.
	// MySQL's LAST_INSERT_ID() and SQLite's last_insert_rowid() are the
	// statement's own (a trigger's inserts do not change them). On
	// PostgreSQL lastval() would be any sequence's last value in the
	// session (a trigger's, another serial column's), so the value is
	// read from the key column's own sequence; a key no sequence feeds
	// is refused.
	var (
		q    string
		args []any
	)
	switch db.Dialector.Name() {
	case "mysql":
		q = "SELECT LAST_INSERT_ID()"
	case "sqlite":
		q = "SELECT last_insert_rowid()"
	case "postgres":
		q = "SELECT currval(pg_get_serial_sequence(?, ?))"
		args = []any{db.Statement.Table, t.schema.PrimaryFields[0].DBName}
	default:
		return nil, err
	}
	var id int64
	if qerr := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Raw(q, args...).Scan(&id).Error; qerr != nil || id == 0 {
		return nil, err
	}
	return [][]any{{id}}, nil
}

// errKeyUnknown marks a created row whose key knownKeys could not find.
var errKeyUnknown = errors.New("key unknown")

// keyUnknownMark wraps errKeyUnknown into an error without adding text.
type keyUnknownMark struct{}

func (keyUnknownMark) Error() string { return "" }
func (keyUnknownMark) Unwrap() error { return errKeyUnknown }

// knownKeys returns the keys createdKeys finds in the maps or structs.
func knownKeys(db *gorm.DB, t target) ([][]any, error) {
	fields := t.schema.PrimaryFields
	if len(fields) == 0 {
		return nil, fmt.Errorf("%w: %s: the model has no primary key: the created rows cannot be read back", ErrUnsupportedWrite, t.schema.Name)
	}
	var maps []map[string]any
	switch d := db.Statement.Dest.(type) {
	case map[string]any:
		maps = []map[string]any{d}
	case *map[string]any:
		maps = []map[string]any{*d}
	case []map[string]any:
		maps = d
	case *[]map[string]any:
		maps = *d
	}
	unknown := func() error {
		return fmt.Errorf("%w: %s: create through %s: the created row's primary key is not known (give it in the values, or write through the model %s so the database returns it)%w",
			ErrUnsupportedWrite, t.schema.Name, db.Statement.Table, t.schema.ModelType, keyUnknownMark{})
	}
	var keys [][]any
	if maps != nil {
		for _, m := range maps {
			k := make([]any, len(fields))
			for i, f := range fields {
				v, ok := m[f.DBName]
				if !ok {
					v, ok = m[f.Name]
				}
				if !ok && len(fields) == 1 {
					v, ok = m["@id"]
				}
				if !ok || v == nil {
					return nil, unknown()
				}
				k[i] = v
			}
			keys = append(keys, k)
		}
		return keys, nil
	}
	s := db.Statement.Schema
	if s == nil {
		return nil, unknown()
	}
	var plan *upsertPlan
	if v, ok := db.InstanceGet(keyUpsert); ok {
		plan = v.(*upsertPlan)
	}
	n := 0
	err := entities(db, func(ptr reflect.Value) error {
		n++
		if plan != nil && plan.doNothing && n <= len(plan.existed) && plan.existed[n-1] {
			// The row existed and was not written: nothing to read back,
			// and its entity need not hold its key.
			keys = append(keys, nil)
			return nil
		}
		k := make([]any, len(fields))
		for i, f := range fields {
			sf := s.LookUpField(f.DBName)
			if sf == nil {
				return unknown()
			}
			v, zero := sf.ValueOf(db.Statement.Context, ptr.Elem())
			if zero {
				return unknown()
			}
			k[i] = v
		}
		keys = append(keys, k)
		return nil
	})
	return keys, err
}

// returnedMaps is the caller's slice of maps of a create through
// Table(name) while GORM scans the returned keys into fresh maps.
type returnedMaps struct {
	dest  any
	maps  []map[string]any
	fresh *[]map[string]any
	atID  string // the key column stored as "@id", or ""
}

// returnKeys makes a create from maps return the generated keys where
// GORM would not write them into the caller's maps:
//
//   - through Table(name) without a model on PostgreSQL, GORM asks for no
//     key at all (MySQL and SQLite report LastInsertId, which GORM writes
//     into each map as "@id"): the plugin adds RETURNING of the rule's key
//     and stores it as "@id" too;
//   - for a slice of maps on PostgreSQL, SQLite and MariaDB, GORM scans RETURNING
//     into the statement's destination, which appends the returned rows to
//     the caller's slice instead of filling its maps.
//
// For a slice the statement is built here from the caller's maps, as
// gorm:create would build it, and GORM scans into fresh maps, whose values
// restoreMaps copies into the caller's maps after the INSERT.
func returnKeys(db *gorm.DB, t target) {
	stmt := db.Statement
	// PostgreSQL, SQLite and MariaDB (GORM's MySQL dialect enables
	// RETURNING on MariaDB) return created rows; MySQL does not.
	if !slices.Contains(stmt.BuildClauses, "RETURNING") || stmt.SQL.Len() != 0 {
		return
	}
	if _, ok := stmt.Clauses["RETURNING"]; ok {
		return
	}
	var cols []clause.Column
	if s := stmt.Schema; s != nil {
		for _, f := range s.FieldsWithDefaultDBValue {
			if f.Readable {
				cols = append(cols, clause.Column{Name: f.DBName})
			}
		}
	} else if db.Dialector.Name() == "postgres" {
		for _, f := range t.schema.PrimaryFields {
			cols = append(cols, clause.Column{Name: f.DBName})
		}
	}
	if len(cols) == 0 {
		return
	}
	var maps []map[string]any
	one := false
	switch d := stmt.Dest.(type) {
	case map[string]any:
		maps, one = []map[string]any{d}, true
	case *map[string]any:
		maps, one = []map[string]any{*d}, true
	case []map[string]any:
		maps = d
	case *[]map[string]any:
		maps = *d
	}
	if len(maps) == 0 || (one && stmt.Schema != nil) {
		return // with a model GORM returns the key into a single map itself
	}
	if s := stmt.Schema; s != nil && !stmt.Unscoped {
		for _, c := range s.CreateClauses {
			stmt.AddClause(c)
		}
	}
	stmt.AddClause(clause.Returning{Columns: cols})
	stmt.AddClauseIfNotExists(clause.Insert{})
	stmt.AddClause(callbacks.ConvertToCreateValues(stmt))
	stmt.Build(stmt.BuildClauses...)
	rm := &returnedMaps{dest: stmt.Dest, maps: maps, fresh: &[]map[string]any{}}
	if stmt.Schema == nil && len(t.schema.PrimaryFields) == 1 {
		// Without a model GORM gives a generated key as "@id".
		rm.atID = t.schema.PrimaryFields[0].DBName
	}
	stmt.Dest = rm.fresh
	db.InstanceSet(keyReturned, rm)
}

// restoreMaps puts back the caller's maps returnKeys set aside, with the
// returned keys.
func restoreMaps(db *gorm.DB) {
	if !isMapCreate(db) {
		return
	}
	v, ok := db.InstanceGet(keyReturned)
	if !ok {
		return
	}
	rm := v.(*returnedMaps)
	db.Statement.Dest = rm.dest
	for i, row := range *rm.fresh {
		if i < len(rm.maps) && rm.maps[i] != nil {
			for k, v := range row {
				if k == rm.atID {
					k = "@id"
				}
				rm.maps[i][k] = v
			}
		}
	}
}

// isMapCreate reports whether the statement creates from maps.
func isMapCreate(db *gorm.DB) bool {
	switch db.Statement.Dest.(type) {
	case map[string]any, *map[string]any, []map[string]any, *[]map[string]any:
		return true
	}
	return false
}

// publishCreatedRows runs the Insert rules for the rows a create through
// a map, Table(name) or another struct inserted, read back by key into
// the rules' model.
func (p *Plugin) publishCreatedRows(db *gorm.DB, t target) {
	if db.RowsAffected == 0 {
		return
	}
	keys, err := createdKeys(db, t)
	if err != nil {
		p.finish(db, t, nil, err)
		return
	}
	written := make([][]any, 0, len(keys))
	for _, k := range keys {
		if k != nil {
			written = append(written, k)
		}
	}
	rows, err := p.readKeys(db, t, written)
	if err != nil {
		p.finish(db, t, nil, fmt.Errorf("outbox: %s: read the created rows back: %w", t.schema.Name, err))
		return
	}
	var plan *upsertPlan
	if v, ok := db.InstanceGet(keyUpsert); ok {
		plan = v.(*upsertPlan)
	}
	var msgs []*Message
	for i, k := range keys {
		op, changed := Insert, t.schema.DBNames
		if plan != nil && i < len(plan.existed) && plan.existed[i] {
			if plan.doNothing {
				continue // the row existed: nothing was written
			}
			op, changed = Update, upsertColumns(db)
		}
		if !t.m.for_(op) {
			continue
		}
		row, ok := rows[keyString(k)]
		if !ok {
			p.finish(db, t, msgs, fmt.Errorf("%w: %s: the created row with key %v cannot be read back", ErrUnsupportedWrite, t.schema.Name, k))
			return
		}
		out, err := p.runRules(db, t, t.m, op, &change{entity: row, changed: changed, rowsAffected: db.RowsAffected})
		msgs = append(msgs, out...)
		if err != nil {
			p.finish(db, t, msgs, err)
			return
		}
	}
	p.finish(db, t, msgs, nil)
}
