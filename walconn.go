package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"gorm.io/gorm/logger"
)

// In WAL mode on pgx's database/sql driver, a transaction begun through
// the plugin's pool is a pgxTx: BEGIN and the statements run on one
// *sql.Conn, the messages written in it are held, encoded, and COMMIT
// sends them with the commit in one pipeline (one round trip), so the
// messages cost no round trip of their own. database/sql's *sql.Tx sends
// COMMIT itself, so nothing could join it.

// pgxDriverConn is the driver connection of pgx's database/sql driver
// (*stdlib.Conn), asserted by its method so that this package does not
// import the driver and register it in every program that links the
// plugin (MySQL and SQLite ones too).
type pgxDriverConn interface{ Conn() *pgx.Conn }

// errNotPgx reports that a connection's driver is not pgx's stdlib.
var errNotPgx = errors.New("outbox: not a pgx connection")

// ErrStatementUnknown is the error of a statement that a WAL mode
// transaction was asked to run (StmtContext) but that was not prepared
// through the plugin's pool or one of its transactions: its query is not
// known, so it cannot be prepared on the transaction's connection, and it
// is not run outside the transaction.
var ErrStatementUnknown = errors.New("outbox: statement not prepared through the outbox's connection pool")

// What a pool knows of its connections' driver (pool.driver).
const (
	driverUnknown int32 = iota
	driverPgx
	driverOther
)

// beginPgx begins a WAL mode transaction on a connection of sqlDB when its
// driver is pgx's stdlib. It returns errNotPgx, having released the
// connection, when it is not.
func (p *pool) beginPgx(ctx context.Context, sqlDB *sql.DB, opts *sql.TxOptions) (*pgxTx, error) {
	var txOpts pgx.TxOptions
	if opts != nil {
		// As pgx's stdlib maps them (stdlib.Conn.BeginTx).
		switch opts.Isolation {
		case sql.LevelDefault:
		case sql.LevelReadUncommitted:
			txOpts.IsoLevel = pgx.ReadUncommitted
		case sql.LevelReadCommitted:
			txOpts.IsoLevel = pgx.ReadCommitted
		case sql.LevelRepeatableRead, sql.LevelSnapshot:
			txOpts.IsoLevel = pgx.RepeatableRead
		case sql.LevelSerializable:
			txOpts.IsoLevel = pgx.Serializable
		default:
			return nil, fmt.Errorf("unsupported isolation: %v", driver.IsolationLevel(opts.Isolation))
		}
		if opts.ReadOnly {
			txOpts.AccessMode = pgx.ReadOnly
		}
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	err = conn.Raw(func(dc any) error {
		sc, ok := dc.(pgxDriverConn)
		if !ok {
			return errNotPgx
		}
		_, err := sc.Conn().BeginTx(ctx, txOpts)
		return err
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	t := &pgxTx{conn: conn, ctx: ctx}
	t.stop = context.AfterFunc(ctx, t.contextDone)
	return t, nil
}

// pgxTx is a WAL mode transaction on one pgx connection. It implements
// gorm.Tx.
type pgxTx struct {
	conn *sql.Conn
	ctx  context.Context
	stop func() bool

	// state is txActive until Commit, Rollback or the end of ctx.
	state atomic.Int32

	mu sync.Mutex
	// held lists the encoded messages not yet sent, in order, all written
	// after the newest savepoint (savepoint sends what is held before
	// creating one); heldBytes is their size; marks names the open
	// savepoints.
	held      []heldMessage
	heldBytes int
	marks     []string
	// trace is the GORM logger of the last write that held messages; the
	// emitting statements sent by Commit are traced to it.
	trace logger.Interface
	// stmts are the statements prepared on conn, by query; closed at the
	// end of the transaction.
	stmts map[string]*sql.Stmt
}

type heldMessage struct {
	prefix string
	env    []byte
}

const (
	txActive int32 = iota
	txCancelled
	txDone
)

// contextDone runs when the transaction's context ends before Commit or
// Rollback: as database/sql does, the transaction is rolled back by
// discarding its connection.
func (t *pgxTx) contextDone() {
	if !t.state.CompareAndSwap(txActive, txCancelled) {
		return
	}
	t.discard()
}

// discard closes the connection rather than returning it to the pool,
// which rolls back whatever transaction it has open. It waits for the
// statements running on it.
func (t *pgxTx) discard() {
	_ = t.conn.Raw(func(any) error { return driver.ErrBadConn })
	t.release()
}

// release closes the statements prepared in the transaction and returns
// the connection to the pool (a no-op after discard closed it).
func (t *pgxTx) release() {
	t.mu.Lock()
	stmts := t.stmts
	t.stmts = nil
	t.held = nil
	t.marks = nil
	t.mu.Unlock()
	for _, s := range stmts {
		s.Close()
	}
	t.conn.Close()
}

// finish moves the transaction to done. It returns the error of Commit or
// Rollback when it was not active.
func (t *pgxTx) finish() error {
	if t.state.CompareAndSwap(txActive, txDone) {
		t.stop()
		return nil
	}
	if t.state.CompareAndSwap(txCancelled, txDone) {
		return fmt.Errorf("outbox: transaction rolled back, its context ended: %w", t.ctx.Err())
	}
	return sql.ErrTxDone
}

func (t *pgxTx) checkActive() error {
	switch t.state.Load() {
	case txActive:
		return nil
	case txCancelled:
		return t.ctx.Err()
	}
	return sql.ErrTxDone
}

// hold keeps msgs, encoded, to be sent with COMMIT. When more than one
// statement's worth is held, everything held is sent at once instead.
func (t *pgxTx) hold(ctx context.Context, lg logger.Interface, prefix string, envs [][]byte) error {
	if err := t.checkActive(); err != nil {
		return err
	}
	t.mu.Lock()
	for _, e := range envs {
		t.held = append(t.held, heldMessage{prefix: prefix, env: e})
		t.heldBytes += len(e) + rowOverhead
	}
	t.trace = lg
	over := len(t.held) > emitChunk || t.heldBytes > statementBytes
	var send []heldMessage
	if over {
		send = t.held
		t.held = nil
		t.heldBytes = 0
	}
	t.mu.Unlock()
	if !over {
		return nil
	}
	return t.send(ctx, lg, send)
}

// heldChunk is a run of held messages with one prefix that one emitting
// statement writes.
type heldChunk []heldMessage

// emitChunks splits msgs into the statements that write them: one prefix
// each, at most emitChunk messages and, unless one message is larger,
// statementBytes.
func emitChunks(msgs []heldMessage) []heldChunk {
	var out []heldChunk
	for start := 0; start < len(msgs); {
		end, bytes := start, 0
		for end < len(msgs) && end-start < emitChunk && msgs[end].prefix == msgs[start].prefix {
			size := len(msgs[end].env) + rowOverhead
			if end > start && bytes+size > statementBytes {
				break
			}
			bytes += size
			end++
		}
		out = append(out, heldChunk(msgs[start:end]))
		start = end
	}
	return out
}

func (c heldChunk) statement() (string, []any) {
	args := make([]any, 1, 1+len(c))
	args[0] = c[0].prefix
	for _, m := range c {
		args = append(args, m.env)
	}
	if len(c) == 1 {
		return emitSQL, args
	}
	return emitManySQL(len(c)), args
}

// ErrCommitFailed is wrapped by the error of a WAL mode Commit whose
// messages could not be written: the transaction did not commit.
var ErrCommitFailed = errors.New("outbox: the transaction did not commit")

// pipeline sends, in one round trip on pc, the statements that write
// msgs and then tail (none when empty), and returns tail's command tag.
// An emit's error is returned wrapped, and tail has not run; emitFailed
// says the server refused the emit.
func pipeline(ctx context.Context, pc *pgx.Conn, lg logger.Interface, msgs []heldMessage, tail string) (_ pgconn.CommandTag, emitFailed bool, _ error) {
	if len(msgs) == 0 && tail != "" {
		tag, err := pc.Exec(ctx, tail) // a plain statement: no arguments, simple protocol
		return tag, false, err
	}
	chunks := emitChunks(msgs)
	b := &pgx.Batch{QueuedQueries: make([]*pgx.QueuedQuery, 0, len(chunks)+1)}
	for _, c := range chunks {
		q, args := c.statement()
		b.Queue(q, args...)
	}
	if tail != "" {
		b.Queue(tail)
	}
	begin := time.Now()
	br := pc.SendBatch(ctx, b)
	var tag pgconn.CommandTag
	var result error
	for i, c := range chunks {
		_, err := br.Exec()
		if lg != nil {
			q := b.QueuedQueries[i].SQL
			lg.Trace(ctx, begin, func() (string, int64) { return q, int64(len(c)) }, err)
		}
		if err != nil {
			result = fmt.Errorf("write %d messages to the WAL: %w", len(c), err)
			// The server refused it, so it ran nothing after it. Any other
			// error (the connection lost after the pipeline was sent) leaves
			// the outcome unknown.
			var pe *pgconn.PgError
			emitFailed = errors.As(err, &pe)
			break
		}
	}
	if result == nil && tail != "" {
		tag, result = br.Exec()
	}
	if err := br.Close(); err != nil && result == nil {
		result = err
	}
	return tag, emitFailed, result
}

// Commit sends the held messages and COMMIT in one pipeline, checks every
// result, and returns the connection to the pool idle.
func (t *pgxTx) Commit() error {
	if err := t.finish(); err != nil {
		return err
	}
	defer t.release()
	t.mu.Lock()
	held, lg := t.held, t.trace
	t.mu.Unlock()
	ctx := t.ctx
	var result error
	_ = t.conn.Raw(func(dc any) error {
		pc := dc.(pgxDriverConn).Conn()
		tag, emitFailed, err := pipeline(ctx, pc, lg, held, "commit")
		switch {
		case emitFailed:
			result = fmt.Errorf("%w: %w", ErrCommitFailed, err)
		case err != nil:
			result = err
		case tag.String() == "ROLLBACK":
			result = pgx.ErrTxCommitRollback
		}
		return idle(ctx, pc)
	})
	return result
}

// idle leaves pc with no transaction open: it rolls back what is still
// open (after a failed pipeline) and returns driver.ErrBadConn, which
// makes database/sql discard the connection, when it cannot.
func idle(ctx context.Context, pc *pgx.Conn) error {
	if !pc.IsClosed() && pc.PgConn().TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = pc.Exec(rctx, "rollback")
	}
	if pc.IsClosed() || pc.PgConn().TxStatus() != 'I' {
		return driver.ErrBadConn
	}
	return nil
}

// Rollback rolls back and forgets the held messages.
func (t *pgxTx) Rollback() error {
	if err := t.finish(); err != nil {
		return err
	}
	defer t.release()
	var result error
	_ = t.conn.Raw(func(dc any) error {
		pc := dc.(pgxDriverConn).Conn()
		_, result = pc.Exec(t.ctx, "rollback")
		return idle(t.ctx, pc)
	})
	return result
}

// ExecContext runs a statement of the transaction; savepoint statements
// also mark or drop the held messages.
func (t *pgxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	if err := t.checkActive(); err != nil {
		return nil, err
	}
	kind, name := savepointStatement(query)
	if kind == spCreate && len(args) == 0 {
		return t.savepoint(ctx, query, name)
	}
	res, err := t.conn.ExecContext(ctx, query, args...)
	if err != nil || kind == spNone {
		return res, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch kind {
	case spCreate:
		t.marks = append(t.marks, name)
	case spRollback:
		for i := len(t.marks) - 1; i >= 0; i-- {
			if t.marks[i] == name {
				// Every held message was written after the newest savepoint,
				// so after this one.
				clear(t.held)
				t.held = t.held[:0]
				t.heldBytes = 0
				t.marks = t.marks[:i+1]
				break
			}
		}
	case spRelease:
		for i := len(t.marks) - 1; i >= 0; i-- {
			if t.marks[i] == name {
				t.marks = t.marks[:i]
				break
			}
		}
	}
	return res, nil
}

// savepoint creates a savepoint. The messages held so far are sent
// first: they belong before the savepoint, where a ROLLBACK TO it cannot
// drop them, and every message held afterwards is one it drops. (They
// are not pipelined with the SAVEPOINT: pgx would prepare and cache each
// savepoint's statement, whose name GORM makes unique.)
func (t *pgxTx) savepoint(ctx context.Context, query, name string) (sql.Result, error) {
	t.mu.Lock()
	held, lg := t.held, t.trace
	t.held, t.heldBytes = nil, 0
	t.mu.Unlock()
	if err := t.send(ctx, lg, held); err != nil {
		return nil, err
	}
	res, err := t.conn.ExecContext(ctx, query)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.marks = append(t.marks, name)
	t.mu.Unlock()
	return res, nil
}

// send writes msgs now, in the transaction, in one round trip.
func (t *pgxTx) send(ctx context.Context, lg logger.Interface, msgs []heldMessage) error {
	if len(msgs) == 0 {
		return nil
	}
	var err error
	if rerr := t.conn.Raw(func(dc any) error {
		_, _, err = pipeline(ctx, dc.(pgxDriverConn).Conn(), lg, msgs, "")
		return nil
	}); rerr != nil {
		return rerr
	}
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

// QueryContext runs a query of the transaction.
func (t *pgxTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	if err := t.checkActive(); err != nil {
		return nil, err
	}
	return t.conn.QueryContext(ctx, query, args...)
}

// QueryRowContext runs a query of the transaction that returns one row.
func (t *pgxTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return t.conn.QueryRowContext(ctx, query, args...)
}

// PrepareContext prepares a statement on the transaction's connection;
// it is closed when the transaction ends, as database/sql's Tx does.
func (t *pgxTx) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	if err := t.checkActive(); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.stmts[query]; ok {
		return s, nil
	}
	return t.prepareLocked(ctx, query)
}

func (t *pgxTx) prepareLocked(ctx context.Context, query string) (*sql.Stmt, error) {
	s, err := t.conn.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	registerStmt(s, query)
	if t.stmts == nil {
		t.stmts = make(map[string]*sql.Stmt)
	}
	t.stmts[query] = s
	return s, nil
}

// StmtContext returns stmt, prepared on any connection through the
// plugin's pool or one of its transactions, as a statement of this
// transaction: prepared again on its connection, once per transaction.
// A statement whose query is unknown is not run: its methods return
// ErrStatementUnknown.
func (t *pgxTx) StmtContext(ctx context.Context, stmt *sql.Stmt) *sql.Stmt {
	if err := t.checkActive(); err != nil {
		return failedStmt(err)
	}
	query, ok := stmtQuery(stmt)
	if !ok {
		return failedStmt(ErrStatementUnknown)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.stmts[query]; ok {
		return s
	}
	s, err := t.prepareLocked(ctx, query)
	if err != nil {
		return failedStmt(err)
	}
	return s
}

// stmtQueries maps every statement prepared through the plugin's pools
// and WAL mode transactions to its query, without keeping it alive.
var stmtQueries sync.Map // weak.Pointer[sql.Stmt] -> string

func registerStmt(s *sql.Stmt, query string) {
	wp := weak.Make(s)
	if _, loaded := stmtQueries.LoadOrStore(wp, query); loaded {
		return
	}
	runtime.AddCleanup(s, func(wp weak.Pointer[sql.Stmt]) { stmtQueries.Delete(wp) }, wp)
}

func stmtQuery(s *sql.Stmt) (string, bool) {
	if s == nil {
		return "", false
	}
	v, ok := stmtQueries.Load(weak.Make(s))
	if !ok {
		return "", false
	}
	return v.(string), true
}

// failedStmt returns a statement whose every method returns err, without
// touching a connection: database/sql's Tx.StmtContext returns such a
// statement when its context has ended, with the context's Err.
func failedStmt(err error) *sql.Stmt {
	var none sql.Tx
	return none.StmtContext(errContext{err: err}, nil)
}

// errContext is an ended context whose Err is err.
type errContext struct{ err error }

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (errContext) Deadline() (time.Time, bool) { return time.Time{}, false }
func (errContext) Done() <-chan struct{}       { return closedChan }
func (c errContext) Err() error                { return c.err }
func (errContext) Value(any) any               { return nil }
