package outbox

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync/atomic"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/bucketset"
)

// pool wraps the *gorm.DB's connection pool so that every transaction
// GORM begins through it is a *txConn, which sees its own COMMIT. It adds
// nothing to statements outside transactions.
type pool struct {
	gorm.ConnPool
	plugin *Plugin
	// driver is driverPgx once a WAL mode transaction began on a pgx
	// connection, driverOther once the pool is known not to have them.
	driver atomic.Int32
}

var (
	_ gorm.ConnPoolBeginner = (*pool)(nil)
	_ gorm.GetDBConnector   = (*pool)(nil)
	_ gorm.Tx               = (*txConn)(nil)
	_ gorm.GetDBConnector   = (*txConn)(nil)
)

// BeginTx begins a transaction on the wrapped pool and wraps it. In WAL
// mode, on a *sql.DB of pgx's stdlib driver, the transaction is a pgxTx
// (walconn.go), whose COMMIT carries the messages.
func (p *pool) BeginTx(ctx context.Context, opts *sql.TxOptions) (gorm.ConnPool, error) {
	if p.plugin.cfg.Mode == ModeWAL && p.driver.Load() != driverOther {
		if sqlDB, ok := p.ConnPool.(*sql.DB); ok {
			pt, err := p.beginPgx(ctx, sqlDB, opts)
			switch {
			case err == nil:
				p.driver.Store(driverPgx)
				return &txConn{Tx: pt, plugin: p.plugin, pool: p}, nil
			case errors.Is(err, errNotPgx):
				p.driver.Store(driverOther)
			default:
				return nil, err
			}
		} else {
			p.driver.Store(driverOther)
		}
	}
	var inner gorm.ConnPool
	switch b := p.ConnPool.(type) {
	case gorm.TxBeginner:
		tx, err := b.BeginTx(ctx, opts)
		if err != nil {
			return nil, err
		}
		inner = tx
	case gorm.ConnPoolBeginner:
		cp, err := b.BeginTx(ctx, opts)
		if err != nil {
			return nil, err
		}
		inner = cp
	default:
		return nil, gorm.ErrInvalidTransaction
	}
	tx, ok := inner.(gorm.Tx)
	if !ok {
		return nil, gorm.ErrInvalidTransaction
	}
	return &txConn{Tx: tx, plugin: p.plugin, pool: p}, nil
}

// PrepareContext prepares a statement on the wrapped pool. In WAL mode
// its query is kept (without keeping the statement alive), so a pgxTx
// can prepare it again on its own connection (pgxTx.StmtContext).
func (p *pool) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	s, err := p.ConnPool.PrepareContext(ctx, query)
	if err == nil && p.plugin.cfg.Mode == ModeWAL {
		registerStmt(s, query)
	}
	return s, err
}

// GetDBConn returns the *sql.DB behind the pool, so db.DB() keeps working.
func (p *pool) GetDBConn() (*sql.DB, error) {
	switch c := p.ConnPool.(type) {
	case *sql.DB:
		return c, nil
	case gorm.GetDBConnector:
		return c.GetDBConn()
	}
	return nil, gorm.ErrInvalidDB
}

// Ping pings the wrapped pool when it can.
func (p *pool) Ping() error {
	if pinger, ok := p.ConnPool.(interface{ Ping() error }); ok {
		return pinger.Ping()
	}
	return nil
}

// txConn is a transaction begun through pool. It accumulates the buckets
// that received messages and hands them to the plugin's notifier after a
// successful COMMIT. Savepoints are tracked so that a rolled-back savepoint
// drops the buckets added after it.
type txConn struct {
	gorm.Tx
	plugin *Plugin
	pool   *pool

	// seen holds the buckets already recorded; added lists them in the
	// order they were first recorded, so a savepoint can truncate it.
	seen       bucketset.Set
	added      []int
	savepoints []savepoint
	done       bool
}

type savepoint struct {
	name string
	mark int
}

func (t *txConn) record(bucket int) {
	if t.seen.Size() == 0 { // allocated by the first message, not by every transaction
		t.seen = bucketset.New(t.plugin.cfg.BucketCount)
	}
	if t.seen.Add(bucket) {
		t.added = append(t.added, bucket)
	}
}

func (t *txConn) truncate(mark int) {
	for _, b := range t.added[mark:] {
		t.seen.Remove(b)
	}
	t.added = t.added[:mark]
}

// Commit commits and, only if that succeeded, notifies the buckets.
func (t *txConn) Commit() error {
	if err := t.Tx.Commit(); err != nil {
		t.added = nil
		return err
	}
	if !t.done && len(t.added) > 0 {
		t.plugin.notifier.Notify(t.added)
	}
	t.done = true
	t.added = nil
	return nil
}

// Rollback rolls back and forgets the buckets.
func (t *txConn) Rollback() error {
	t.added = nil
	t.done = true
	return t.Tx.Rollback()
}

// walTx returns the pgxTx at the bottom of the transaction, nil when it
// is another kind (a *sql.Tx).
func (t *txConn) walTx() *pgxTx {
	var found *pgxTx
	txLayers(t.Tx, func(cp gorm.ConnPool) bool {
		found, _ = cp.(*pgxTx)
		return found != nil
	})
	return found
}

// GetDBConn returns the *sql.DB the transaction came from.
func (t *txConn) GetDBConn() (*sql.DB, error) { return t.pool.GetDBConn() }

// ExecContext runs statements of the transaction, watching for the
// savepoint statements GORM's dialects issue for nested transactions.
func (t *txConn) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	kind, name := savepointStatement(query)
	if kind == spNone {
		return t.Tx.ExecContext(ctx, query, args...)
	}
	// Savepoint statements cannot be prepared on MySQL: bypass a
	// prepared-statement wrapper.
	target := gorm.ConnPool(t.Tx)
	if ps, ok := t.Tx.(*gorm.PreparedStmtTX); ok {
		target = ps.Tx
	}
	res, err := target.ExecContext(ctx, query, args...)
	if err != nil {
		return res, err
	}
	switch kind {
	case spCreate:
		t.savepoints = append(t.savepoints, savepoint{name: name, mark: len(t.added)})
	case spRollback:
		for i := len(t.savepoints) - 1; i >= 0; i-- {
			if t.savepoints[i].name == name {
				t.truncate(t.savepoints[i].mark)
				// The savepoint survives ROLLBACK TO; later ones do not.
				t.savepoints = t.savepoints[:i+1]
				break
			}
		}
	case spRelease:
		for i := len(t.savepoints) - 1; i >= 0; i-- {
			if t.savepoints[i].name == name {
				t.savepoints = t.savepoints[:i]
				break
			}
		}
	}
	return res, nil
}

const (
	spNone = iota
	spCreate
	spRollback
	spRelease
)

func savepointStatement(q string) (kind int, name string) {
	if len(q) < 9 {
		return spNone, ""
	}
	switch c := q[0]; c {
	case 'S', 's', 'R', 'r':
	default:
		return spNone, ""
	}
	fields := strings.Fields(q)
	switch {
	case len(fields) == 2 && strings.EqualFold(fields[0], "SAVEPOINT"):
		return spCreate, fields[1]
	case len(fields) == 4 && strings.EqualFold(fields[0], "ROLLBACK") && strings.EqualFold(fields[1], "TO") && strings.EqualFold(fields[2], "SAVEPOINT"):
		return spRollback, fields[3]
	case len(fields) == 3 && strings.EqualFold(fields[0], "ROLLBACK") && strings.EqualFold(fields[1], "TO"):
		return spRollback, fields[2]
	case len(fields) == 3 && strings.EqualFold(fields[0], "RELEASE") && strings.EqualFold(fields[1], "SAVEPOINT"):
		return spRelease, fields[2]
	}
	return spNone, ""
}

// findTx returns the outbox transaction of plugin p behind a statement's
// connection, unwrapping GORM's prepared-statement wrapper and other
// outboxes' transactions. It returns nil outside a transaction begun
// through the plugin's pool (a user's own *sql.Tx, db.Connection).
func (p *Plugin) findTx(cp gorm.ConnPool) *txConn {
	var found *txConn
	txLayers(cp, func(cp gorm.ConnPool) bool {
		if c, ok := cp.(*txConn); ok && c.plugin == p {
			found = c
		}
		return found != nil
	})
	return found
}

// txLayers calls fn with each layer of a transaction's connection,
// outermost first, through outbox transactions (other outboxes' too) and
// GORM's prepared-statement wrapper, until fn returns true or a layer is
// neither.
func txLayers(cp gorm.ConnPool, fn func(gorm.ConnPool) bool) {
	for i := 0; i < 8 && cp != nil; i++ {
		if fn(cp) {
			return
		}
		switch c := cp.(type) {
		case *txConn:
			cp = c.Tx
		case *gorm.PreparedStmtTX:
			cp = c.Tx
		default:
			return
		}
	}
}

// inTransaction reports whether statements on cp run inside a database
// transaction.
func inTransaction(cp gorm.ConnPool) bool {
	if cp == nil {
		return false
	}
	c, ok := cp.(gorm.TxCommitter)
	return ok && c != nil
}
