// Package gormlog keeps the library's own background statements (the
// relay store's reads, deletes and leases, the WAL reader's leases and
// dead letters, the admin API) out of the application's GORM log unless
// they fail: GORM's logger would otherwise print every one at Info level
// and the slow ones ("SLOW SQL >= 200ms") at Warn level, as if the
// application had run them.
package gormlog

import (
	"context"
	"errors"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// failures is a logger.Interface that forwards a statement to the inner
// logger only when it failed.
type failures struct{ inner logger.Interface }

// OnlyFailures wraps inner: Trace calls inner's Trace only for a
// statement that failed with an error other than gorm.ErrRecordNotFound
// or its context's cancellation (a deadline that passed still logs), so
// the inner logger's level still decides whether the failure prints;
// successful and slow statements never reach it. Info, Warn and Error are
// forwarded. A nil inner is returned as is.
func OnlyFailures(inner logger.Interface) logger.Interface {
	if inner == nil {
		return nil
	}
	if _, ok := inner.(failures); ok {
		return inner
	}
	return failures{inner: inner}
}

// Session returns db in a session whose logger is OnlyFailures of db's.
func Session(db *gorm.DB) *gorm.DB {
	return db.Session(&gorm.Session{Logger: OnlyFailures(db.Logger)})
}

// LogMode returns the wrapper around inner.LogMode(level).
func (f failures) LogMode(level logger.LogLevel) logger.Interface {
	return failures{inner: f.inner.LogMode(level)}
}

// Info forwards to the inner logger.
func (f failures) Info(ctx context.Context, msg string, args ...any) { f.inner.Info(ctx, msg, args...) }

// Warn forwards to the inner logger.
func (f failures) Warn(ctx context.Context, msg string, args ...any) { f.inner.Warn(ctx, msg, args...) }

// Error forwards to the inner logger.
func (f failures) Error(ctx context.Context, msg string, args ...any) {
	f.inner.Error(ctx, msg, args...)
}

// Trace forwards a failed statement to the inner logger, but not one
// cancelled with its context: the library cancels its own statements
// when the work they serve ends (a relay stopping, DrainOnce returning
// while a lease renewal is in flight), which is no failure of the
// database.
func (f failures) Trace(ctx context.Context, begin time.Time, fc func() (string, int64), err error) {
	if err == nil || errors.Is(err, gorm.ErrRecordNotFound) {
		return
	}
	if errors.Is(err, context.Canceled) || errors.Is(ctx.Err(), context.Canceled) {
		return
	}
	f.inner.Trace(ctx, begin, fc, err)
}
