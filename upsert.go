package outbox

import (
	"fmt"
	"reflect"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"

	"github.com/gorm-outbox/outbox/internal/sqlrows"
)

// An upsert (INSERT … ON CONFLICT, MySQL's ON DUPLICATE KEY UPDATE) of a
// model with rules inserts some rows and updates or skips the others, and
// no supported database tells which did what: PostgreSQL and SQLite count
// an inserted and an updated row alike, MySQL counts 1 per inserted, 2 per
// changed and 0 per unchanged row. GORM issues such upserts on its own:
// Save of a slice, Save of a row the update did not change (MySQL), and
// every association it saves with its parent (ON CONFLICT (id) DO UPDATE
// SET fk = …, or DO NOTHING).
//
// So the plugin finds out inside the transaction, before the INSERT, which
// of the entities' conflict keys already exist (locking those rows on
// PostgreSQL and MySQL, where a concurrent delete could otherwise turn an
// update into an insert), and checks after it that the rows affected agree
// with that plan. An entity whose key existed is an Update (or nothing for
// DO NOTHING), one whose key did not is an Insert. When the count
// disagrees (a conflict on another unique key than the one checked, or a
// concurrent insert of the same new key) the write is refused with
// ErrUnsupportedWrite and rolled back rather than described wrongly. For
// DO NOTHING it also gives each inserted entity the generated values of
// its own row, which GORM hands out shifted when rows existed
// (fixReturned, checkInserted); two entities with the same new key are
// refused before the INSERT.

// upsertPlan is what beforeCreate learned of an upsert's entities.
type upsertPlan struct {
	existed   []bool          // per entity, in entities order
	keys      []string        // per entity, its conflict key's keyString; "" for a key the database generates
	fields    []*schema.Field // the conflict key
	doNothing bool
	inserts   int
	updates   int
	// before holds, for DO NOTHING, a copy of each entity as it was
	// before the INSERT: GORM may write RETURNING values onto the wrong
	// entities (see fixReturned).
	before []reflect.Value
}

// planUpsert reads which conflict keys of the statement's entities exist.
func (p *Plugin) planUpsert(db *gorm.DB, oc clause.OnConflict) (*upsertPlan, error) {
	s := db.Statement.Schema
	var fields []*schema.Field
	for _, c := range oc.Columns {
		f := s.LookUpField(c.Name)
		if f == nil {
			return nil, fmt.Errorf("%w: %s: upsert on conflict column %q that is not a field of the model", ErrUnsupportedWrite, s.Name, c.Name)
		}
		fields = append(fields, f)
	}
	if len(fields) == 0 {
		fields = s.PrimaryFields
	}
	if len(fields) == 0 {
		return nil, fmt.Errorf("%w: %s: upsert of a model without a primary key: which rows were inserted cannot be known", ErrUnsupportedWrite, s.Name)
	}
	onlyPK := true
	for _, f := range fields {
		onlyPK = onlyPK && f.PrimaryKey
	}
	ctx := db.Statement.Context
	plan := &upsertPlan{doNothing: oc.DoNothing, fields: fields}
	var keys []string  // per entity, "" for a key the database generates
	var lookup [][]any // distinct keys to look up
	seen := map[string]bool{}
	_ = entities(db, func(ptr reflect.Value) error {
		if oc.DoNothing {
			cp := reflect.New(ptr.Elem().Type()).Elem()
			cp.Set(ptr.Elem())
			plan.before = append(plan.before, cp)
		}
		vals := make([]any, len(fields))
		generated := false
		for i, f := range fields {
			v, zero := f.ValueOf(ctx, ptr.Elem())
			if zero && (onlyPK && (f.AutoIncrement || f.HasDefaultValue) || dbGenerated(f)) {
				generated = true
			}
			vals[i] = v
		}
		if generated {
			keys = append(keys, "")
			return nil
		}
		k := keyString(vals)
		keys = append(keys, k)
		if !seen[k] {
			seen[k] = true
			lookup = append(lookup, vals)
		}
		return nil
	})
	existing := map[string]bool{}
	for start := 0; start < len(lookup); start += sqlrows.InsertChunk {
		chunk := lookup[start:min(start+sqlrows.InsertChunk, len(lookup))]
		found, err := p.existingKeys(db, fields, chunk, true)
		if err != nil {
			return nil, err
		}
		for _, k := range found {
			existing[k] = true
		}
	}
	plan.keys = keys
	plan.existed = make([]bool, len(keys))
	newKeys := map[string]bool{}
	for i, k := range keys {
		plan.existed[i] = k != "" && existing[k]
		if plan.existed[i] {
			plan.updates++
			continue
		}
		plan.inserts++
		if k == "" {
			continue
		}
		if newKeys[k] {
			// The database inserts one of the two and skips (DO NOTHING)
			// or updates (SQLite, MySQL) it with the other: which entity
			// describes the row cannot be told.
			return nil, fmt.Errorf("%w: %s: upsert of two entities with the same key %s, which does not exist yet: one is inserted and the other skipped or applied over it, and which entity the row holds cannot be known; drop the duplicate or write them in separate statements",
				ErrUnsupportedWrite, s.Name, describeKey(fields, k))
		}
		newKeys[k] = true
	}
	return plan, nil
}

// dbGenerated reports whether the database generates the field's value
// when the INSERT leaves it out (a sequence, an expression default): a
// conflict key with such a field left zero is known only after the
// INSERT.
func dbGenerated(f *schema.Field) bool {
	return f.AutoIncrement || (f.HasDefaultValue && f.DefaultValueInterface == nil)
}

// describeKey formats a keyString of fields for an error message.
func describeKey(fields []*schema.Field, k string) string {
	vals := strings.Split(k, "\x00")
	parts := make([]string, len(fields))
	for i, f := range fields {
		v := ""
		if i < len(vals) {
			v = vals[i]
		}
		parts[i] = f.DBName + "=" + v
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

// existingKeys returns, as keyString values, which of keys exist in the
// statement's table, soft-deleted rows included (they conflict too).
func (p *Plugin) existingKeys(db *gorm.DB, fields []*schema.Field, keys [][]any, lock bool, extra ...clause.Expression) ([]string, error) {
	rows, err := p.keyRows(db, fields, keys, lock, false, extra...)
	if err != nil {
		return nil, err
	}
	ctx := db.Statement.Context
	out := make([]string, 0, rows.Len())
	for i := 0; i < rows.Len(); i++ {
		vals := make([]any, len(fields))
		for j, f := range fields {
			vals[j], _ = f.ValueOf(ctx, rows.Index(i))
		}
		out = append(out, keyString(vals))
	}
	return out, nil
}

// keyRows reads the rows of the statement's table with the given keys
// (and meeting extra), soft-deleted rows included, as a slice of the
// model: the key columns only, or every column with all.
func (p *Plugin) keyRows(db *gorm.DB, fields []*schema.Field, keys [][]any, lock, all bool, extra ...clause.Expression) (reflect.Value, error) {
	s := db.Statement.Schema
	cols := make([]string, len(fields))
	for i, f := range fields {
		cols[i] = f.DBName
	}
	var cond clause.Expression
	if len(fields) == 1 {
		vals := make([]any, len(keys))
		for i, k := range keys {
			vals[i] = k[0]
		}
		cond = clause.IN{Column: clause.Column{Table: clause.CurrentTable, Name: cols[0]}, Values: vals}
	} else {
		ors := make([]clause.Expression, len(keys))
		for i, k := range keys {
			ands := make([]clause.Expression, len(fields))
			for j := range fields {
				ands[j] = clause.Eq{Column: clause.Column{Table: clause.CurrentTable, Name: cols[j]}, Value: k[j]}
			}
			ors[i] = clause.And(ands...)
		}
		cond = clause.Or(ors...)
	}
	q := db.Session(&gorm.Session{NewDB: true, SkipHooks: true}).Unscoped().Table(db.Statement.Table).Where(cond)
	if !all {
		q = q.Select(cols)
	}
	for _, e := range extra {
		q = q.Where(e)
	}
	switch db.Dialector.Name() {
	case "postgres", "mysql":
		if !lock {
			break
		}
		q = q.Clauses(clause.Locking{Strength: clause.LockingStrengthUpdate})
	}
	found := reflect.New(reflect.SliceOf(s.ModelType))
	if err := q.Find(found.Interface()).Error; err != nil {
		return reflect.Value{}, fmt.Errorf("outbox: %s: read which keys of the upsert exist: %w", s.Name, err)
	}
	return found.Elem(), nil
}

// keyString is a comparable form of a key's field values.
func keyString(vals []any) string {
	var sb strings.Builder
	for i, v := range vals {
		if i > 0 {
			sb.WriteByte(0)
		}
		fmt.Fprintf(&sb, "%v", reflect.Indirect(reflect.ValueOf(v)))
	}
	return sb.String()
}

// checkUpsert compares the rows the upsert affected with its plan.
func (p *Plugin) checkUpsert(db *gorm.DB, plan *upsertPlan, oc clause.OnConflict) error {
	r := db.RowsAffected
	ins, upd := int64(plan.inserts), int64(plan.updates)
	var ok bool
	switch {
	case plan.doNothing && db.Dialector.Name() == "mysql":
		// GORM's MySQL dialect writes DO NOTHING as ON DUPLICATE KEY
		// UPDATE id = id: 0 per existing row (1 with CLIENT_FOUND_ROWS).
		ok = r >= ins && r <= ins+upd
	case plan.doNothing:
		// GORM's count is no help here: with RETURNING it counts the
		// entities it walked, not the rows inserted. Check the rows.
		return p.checkInserted(db, plan)
	case db.Dialector.Name() == "mysql":
		// 1 per inserted row, 2 per changed and 0 (1 with
		// CLIENT_FOUND_ROWS) per unchanged updated row.
		ok = r >= ins && r <= ins+2*upd
	case len(oc.Where.Exprs) > 0:
		// DO UPDATE … WHERE may skip rows: which cannot be known.
		ok = upd == 0 && r == ins
	default:
		ok = r == ins+upd
	}
	if ok && plan.doNothing {
		return p.fixInsertIDs(db, plan) // MySQL
	}
	if ok {
		return p.checkNotUpdated(db, plan)
	}
	if !ok {
		return fmt.Errorf("%w: %s: upsert affected %d rows where %d inserts and %d existing keys were expected: it conflicted on another unique key than the one checked, or a concurrent transaction wrote the same keys; which rows were inserted cannot be known",
			ErrUnsupportedWrite, db.Statement.Schema.Name, r, ins, upd)
	}
	return nil
}

// plannedInserts returns the conflict keys of the entities planned as
// inserts, as they are after the INSERT (with the keys the database
// generated), and how many of them still have no key.
func plannedInserts(db *gorm.DB, plan *upsertPlan) (keys [][]any, missing int) {
	ctx := db.Statement.Context
	i := 0
	_ = entities(db, func(ptr reflect.Value) error {
		existed := i < len(plan.existed) && plan.existed[i]
		i++
		if existed {
			return nil
		}
		vals := make([]any, len(plan.fields))
		for j, f := range plan.fields {
			v, zero := f.ValueOf(ctx, ptr.Elem())
			if zero && f.PrimaryKey && (f.AutoIncrement || f.HasDefaultValue) {
				missing++
				return nil
			}
			vals[j] = v
		}
		keys = append(keys, vals)
		return nil
	})
	return keys, missing
}

// countKeys counts the rows with the given keys that also meet extra.
func (p *Plugin) countKeys(db *gorm.DB, plan *upsertPlan, keys [][]any, extra ...clause.Expression) (int, error) {
	n := 0
	for start := 0; start < len(keys); start += sqlrows.InsertChunk {
		found, err := p.existingKeys(db, plan.fields, keys[start:min(start+sqlrows.InsertChunk, len(keys))], false, extra...)
		if err != nil {
			return 0, err
		}
		n += len(found)
	}
	return n, nil
}

// checkInserted checks, after an ON CONFLICT DO NOTHING on PostgreSQL or
// SQLite, that every entity planned as an insert was inserted by this
// statement, and gives each entity the values the database generated for
// its own row (fixReturned, readInserted). A conflict on another unique
// key than the one checked, or a concurrent transaction that inserted the
// same new key, leaves a planned insert without its row and refuses the
// write.
func (p *Plugin) checkInserted(db *gorm.DB, plan *upsertPlan) error {
	ptrs, err := upsertEntities(db, plan)
	if err != nil {
		return err
	}
	fields := returnedFields(db)
	if err := fixReturned(db, plan, ptrs, fields); err != nil {
		return err
	}
	// On PostgreSQL the row must also be this transaction's own: a
	// concurrent transaction that committed the same key while the INSERT
	// waited made it skip the entity, and that row is not this write's.
	// Its xmin (32 bits) is widened with the epoch of txid_current() to
	// the id txid_status reads; a row of this transaction or one of its
	// subtransactions is "in progress", a committed one is not. SQLite
	// has one writer: a key that did not exist when the plan read it and
	// exists now was inserted by this statement.
	var extra []clause.Expression
	if db.Dialector.Name() == "postgres" {
		extra = append(extra, clause.Expr{SQL: "txid_status(txid_current() + ((xmin::text::bigint - txid_current() % 4294967296 + 6442450944) % 4294967296) - 2147483648) = 'in progress'"})
	}
	return p.readInserted(db, plan, ptrs, fields, extra...)
}

// fixInsertIDs gives, after a DO NOTHING on MySQL without RETURNING, each
// entity the key of its own row. GORM gives the entities whose key is
// zero LAST_INSERT_ID() onwards, in order, whether or not their rows
// existed: LAST_INSERT_ID() is the first inserted row's, so an entity
// whose row existed takes a key, and the entities after it are shifted.
// Entities whose row existed get back the key they held; planned inserts
// with a known conflict key get theirs read by that key. MySQL does not
// require the conflict columns to be unique: a key that now has more
// rows than the statement inserted is refused.
func (p *Plugin) fixInsertIDs(db *gorm.DB, plan *upsertPlan) error {
	pk := db.Statement.Schema.PrioritizedPrimaryField
	if _, ret := db.Statement.Clauses["RETURNING"]; ret || pk == nil || !pk.HasDefaultValue || !pk.Readable {
		return nil // GORM scanned RETURNING (every row, in order) or wrote no key
	}
	ptrs, err := upsertEntities(db, plan)
	if err != nil {
		return err
	}
	fields := []*schema.Field{pk}
	if err := restoreExisted(db, plan, ptrs, fields); err != nil {
		return err
	}
	// Entities whose key the database generates keep GORM's keys when
	// they are the only rows inserted: LAST_INSERT_ID() onwards is then
	// the keys of every multi-row INSERT GORM does on MySQL.
	generated, known := 0, 0
	for i := range ptrs {
		switch {
		case plan.existed[i]:
		case plan.keys[i] == "":
			generated++
		default:
			known++
		}
	}
	if generated > 0 && known > 0 {
		return errGeneratedMixed(db)
	}
	return p.readInserted(db, plan, ptrs, fields)
}

// upsertEntities returns the statement's entities, as many as the plan
// has.
func upsertEntities(db *gorm.DB, plan *upsertPlan) ([]reflect.Value, error) {
	var ptrs []reflect.Value
	_ = entities(db, func(ptr reflect.Value) error {
		ptrs = append(ptrs, ptr)
		return nil
	})
	if len(ptrs) != len(plan.existed) {
		return nil, fmt.Errorf("%w: %s: ON CONFLICT DO NOTHING with RETURNING of every column replaced the entities with the rows inserted: which entity was which cannot be known; return named columns (clause.Returning{Columns: …})",
			ErrUnsupportedWrite, db.Statement.Schema.Name)
	}
	return ptrs, nil
}

// errGeneratedMixed refuses a DO NOTHING whose generated keys cannot be
// told apart.
func errGeneratedMixed(db *gorm.DB) error {
	return fmt.Errorf("%w: %s: ON CONFLICT DO NOTHING of entities whose keys the database generates, together with entities that give a new key of their own: which generated key belongs to which entity cannot be known; create the entities without a key in a separate statement",
		ErrUnsupportedWrite, db.Statement.Schema.Name)
}

// restoreExisted gives the entities whose rows existed back the values of
// fields they held before the INSERT.
func restoreExisted(db *gorm.DB, plan *upsertPlan, ptrs []reflect.Value, fields []*schema.Field) error {
	if len(plan.before) != len(ptrs) {
		return nil
	}
	ctx := db.Statement.Context
	for i, ptr := range ptrs {
		if !plan.existed[i] {
			continue
		}
		for _, f := range fields {
			v, _ := f.ValueOf(ctx, plan.before[i])
			if err := f.Set(ctx, ptr.Elem(), v); err != nil {
				return fmt.Errorf("outbox: %s: restore %s of an entity whose row existed: %w", db.Statement.Schema.Name, f.Name, err)
			}
		}
	}
	return nil
}

// readInserted reads the rows of the planned inserts with a known
// conflict key (meeting extra), refuses the write unless each has exactly
// one, and gives each such entity the values of fields from its own row,
// found by its key: no order of the rows the INSERT returned is assumed.
// On PostgreSQL and SQLite the conflict key is unique (both refuse an
// ON CONFLICT target that no unique index matches).
func (p *Plugin) readInserted(db *gorm.DB, plan *upsertPlan, ptrs []reflect.Value, fields []*schema.Field, extra ...clause.Expression) error {
	s := db.Statement.Schema
	ctx := db.Statement.Context
	var keys [][]any
	current := make([]string, len(ptrs)) // the conflict key each planned insert was inserted with
	for i, ptr := range ptrs {
		if plan.existed[i] || plan.keys[i] == "" {
			continue
		}
		vals := make([]any, len(plan.fields))
		for j, f := range plan.fields {
			vals[j], _ = f.ValueOf(ctx, ptr.Elem())
		}
		keys = append(keys, vals)
		current[i] = keyString(vals)
	}
	rows := map[string]reflect.Value{}
	read := 0
	for start := 0; start < len(keys); start += sqlrows.InsertChunk {
		found, err := p.keyRows(db, plan.fields, keys[start:min(start+sqlrows.InsertChunk, len(keys))], false, true, extra...)
		if err != nil {
			return err
		}
		read += found.Len()
		for i := 0; i < found.Len(); i++ {
			row := found.Index(i)
			vals := make([]any, len(plan.fields))
			for j, f := range plan.fields {
				vals[j], _ = f.ValueOf(ctx, row)
			}
			rows[keyString(vals)] = row
		}
	}
	if len(rows) != len(keys) || read != len(keys) {
		return fmt.Errorf("%w: %s: ON CONFLICT DO NOTHING inserted rows for %d of the %d keys that did not exist (%d rows with those keys now): they conflicted on another unique key than the one checked, or a concurrent transaction inserted the same keys; which rows were inserted cannot be known",
			ErrUnsupportedWrite, s.Name, len(rows), len(keys), read)
	}
	for i, ptr := range ptrs {
		if plan.existed[i] || plan.keys[i] == "" {
			continue
		}
		row, ok := rows[current[i]]
		if !ok {
			return fmt.Errorf("%w: %s: the row inserted with key %s cannot be read back", ErrUnsupportedWrite, s.Name, describeKey(plan.fields, current[i]))
		}
		for _, f := range fields {
			v, _ := f.ValueOf(ctx, row)
			if err := f.Set(ctx, ptr.Elem(), v); err != nil {
				return fmt.Errorf("outbox: %s: set %s of an inserted row: %w", s.Name, f.Name, err)
			}
		}
	}
	return nil
}

// returnedFields returns the fields GORM scanned an INSERT's RETURNING
// rows into: nil when the statement has no RETURNING clause, or returns
// every column.
func returnedFields(db *gorm.DB) []*schema.Field {
	ret, ok := statementClause[clause.Returning](db, "RETURNING")
	if !ok || len(ret.Columns) == 0 || (len(ret.Columns) == 1 && ret.Columns[0].Name == "*") {
		return nil
	}
	var out []*schema.Field
	for _, c := range ret.Columns {
		if f := db.Statement.Schema.LookUpField(c.Name); f != nil {
			out = append(out, f)
		}
	}
	return out
}

// fixReturned undoes what GORM wrote onto the entities of an ON CONFLICT
// DO NOTHING from its RETURNING rows, and sets the statement's count to
// the rows inserted. PostgreSQL and SQLite return a row only for each row
// inserted; GORM (callbacks.Create, gorm.Scan with
// ScanOnConflictDoNothing) hands those rows, in order, to the entities
// whose returned fields are all zero, skipping the others, whether or not
// their rows existed. An entity whose row existed, and holds no key of
// its own, so takes the values of the next inserted row, and the later
// inserted entities are shifted by one.
//
// Entities whose row existed get back what they held before. Planned
// inserts with a known conflict key are given their row's values by
// readInserted, read by key. A planned insert whose key the database
// generates has no key to read its row by: GORM's assignment stands only
// when the entities it filled are exactly the planned inserts and it
// filled all of them, which is then the mapping of every multi-row
// INSERT … RETURNING GORM does (the rows in the order of the VALUES);
// otherwise the write is refused.
func fixReturned(db *gorm.DB, plan *upsertPlan, ptrs []reflect.Value, fields []*schema.Field) error {
	if len(fields) == 0 || len(plan.before) != len(ptrs) {
		return nil
	}
	if err := restoreExisted(db, plan, ptrs, fields); err != nil {
		return err
	}
	ctx := db.Statement.Context
	walked := int(db.RowsAffected)
	filled, exact, generated := 0, true, false
	for i := range ptrs {
		empty := true
		for _, f := range fields {
			if _, zero := f.ValueOf(ctx, plan.before[i]); !zero {
				empty = false
			}
		}
		if db.Statement.ReflectValue.Kind() == reflect.Struct {
			empty = walked > 0 // GORM scans a single entity whatever it holds
		}
		if empty && i < walked {
			filled++
		}
		exact = exact && empty == !plan.existed[i]
		generated = generated || (!plan.existed[i] && plan.keys[i] == "")
	}
	if generated && (!exact || filled != plan.inserts) {
		return errGeneratedMixed(db)
	}
	db.RowsAffected = int64(plan.inserts)
	if db.Statement.Result != nil {
		db.Statement.Result.RowsAffected = db.RowsAffected
	}
	return nil
}

// checkNotUpdated checks on PostgreSQL, after an ON CONFLICT DO UPDATE,
// that no row planned as an insert was updated instead: its key existed
// after all (a sequence behind keys inserted explicitly, or a concurrent
// transaction that inserted the same new key). A row the upsert updated
// carries the transaction's id in xmax; one it inserted has none, as long
// as nothing locked it since, which is why this runs right after
// gorm:create, before the associations are saved (their foreign key
// checks lock the parent row).
func (p *Plugin) checkNotUpdated(db *gorm.DB, plan *upsertPlan) error {
	if db.Dialector.Name() != "postgres" || plan.inserts == 0 {
		return nil
	}
	keys, _ := plannedInserts(db, plan)
	n, err := p.countKeys(db, plan, keys, clause.Expr{SQL: "xmax::text <> '0'"})
	if err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("%w: %s: the upsert updated %d row(s) whose keys did not exist when it began: the keys were generated by a sequence behind keys inserted explicitly, or a concurrent transaction inserted them; which rows were inserted cannot be known",
			ErrUnsupportedWrite, db.Statement.Schema.Name, n)
	}
	return nil
}

// upsertColumns returns the columns an upsert's DO UPDATE sets, as GORM
// finally built them (it turns UpdateAll into DoUpdates).
func upsertColumns(db *gorm.DB) []string {
	oc, ok := statementClause[clause.OnConflict](db, "ON CONFLICT")
	if !ok {
		return nil
	}
	return columnNames(oc.DoUpdates)
}
