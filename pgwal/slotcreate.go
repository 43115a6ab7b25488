package pgwal

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"gorm.io/gorm"
)

// Creating a logical slot builds a snapshot: the server waits for every
// transaction that holds a transaction id, in any database of the
// server, to end. A session left idle in a transaction makes it wait
// for as long as it stays open.
const (
	// slotWaitWarnAfter is how long a slot's creation may wait before
	// the sessions it waits for are logged, and slotWaitWarnEvery how
	// often they are logged again while it still waits.
	slotWaitWarnAfter = 2 * time.Second
	slotWaitWarnEvery = 30 * time.Second
)

// creation watches the creation of a slot by the server process pid:
// until stop is called, it logs, after slotWaitWarnAfter and then every
// slotWaitWarnEvery, the sessions the creation waits for, read through
// db (an ordinary connection).
//
// Ending the creation's context cancels it on the server: pgconn closes
// the connection and sends the server a cancel request, so no server
// process is left waiting to create the slot for no one
// (TestSlotCreationWaitsForOpenTransactions checks it). A process killed
// while it creates a slot sends no cancel request: the server process
// waits until the sessions end (docs/wal-mode.md, Creating the slot).
type creation struct {
	done, finished chan struct{}
}

func watchCreation(ctx context.Context, db *gorm.DB, log *slog.Logger, pid uint32) *creation {
	c := &creation{done: make(chan struct{}), finished: make(chan struct{})}
	go func() {
		defer close(c.finished)
		began := time.Now()
		warn := time.NewTimer(slotWaitWarnAfter)
		defer warn.Stop()
		for {
			select {
			case <-c.done:
				return
			case <-ctx.Done():
				return
			case <-warn.C:
				logWaiting(ctx, db, log, pid, time.Since(began))
				warn.Reset(slotWaitWarnEvery)
			}
		}
	}()
	return c
}

// stop ends the watch once the creation returned.
func (c *creation) stop() {
	close(c.done)
	<-c.finished
}

// logWaiting logs the sessions the creation by pid waits for: those
// pg_blocking_pids names, or, when it names none, every session whose
// transaction holds a transaction id.
func logWaiting(ctx context.Context, db *gorm.DB, log *slog.Logger, pid uint32, waited time.Duration) {
	type session struct {
		PID       int64      `gorm:"column:pid"`
		Datname   string     `gorm:"column:datname"`
		Usename   string     `gorm:"column:usename"`
		State     string     `gorm:"column:state"`
		XactStart *time.Time `gorm:"column:xact_start"`
	}
	const cols = "SELECT pid, coalesce(datname, '') AS datname, coalesce(usename::text, '') AS usename, coalesce(state, '') AS state, xact_start FROM pg_stat_activity"
	qctx, cancel := context.WithTimeout(ctx, slotWaitWarnAfter)
	defer cancel()
	q := db.WithContext(qctx).Session(&gorm.Session{NewDB: true, SkipHooks: true})
	var ss []session
	err := q.Raw(cols+" WHERE pid = ANY(pg_blocking_pids(?)) ORDER BY xact_start", pid).Scan(&ss).Error
	if err == nil && len(ss) == 0 {
		err = q.Raw(cols+" WHERE backend_xid IS NOT NULL AND pid <> ? ORDER BY xact_start", pid).Scan(&ss).Error
	}
	var b strings.Builder
	pids := make([]int64, 0, len(ss))
	for i, s := range ss {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "pid=%d datname=%s usename=%s state=%q", s.PID, s.Datname, s.Usename, s.State)
		if s.XactStart != nil {
			fmt.Fprintf(&b, " xact_start=%s", s.XactStart.UTC().Format(time.RFC3339))
		}
		pids = append(pids, s.PID)
	}
	attrs := []any{"waited", waited.Round(time.Millisecond), "pid", pid, "blocking_pids", pids, "sessions", b.String()}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	log.Warn("pgwal: creating the replication slot waits for the transactions open on the server, in any database, to end "+
		"(end them, or cancel the creation: SELECT pg_cancel_backend(pid))", attrs...)
}
