package gormlog

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// Trace forwards only failures other than ErrRecordNotFound; LogMode
// keeps the filter and the inner logger's level still decides.
func TestOnlyFailures(t *testing.T) {
	var buf bytes.Buffer
	inner := logger.New(log.New(&buf, "", 0), logger.Config{LogLevel: logger.Info, SlowThreshold: time.Nanosecond})
	l := OnlyFailures(inner)
	sql := func() (string, int64) { return "SELECT 42", 1 }
	begin := time.Now().Add(-time.Second) // slow

	l.Trace(context.Background(), begin, sql, nil)
	require.Empty(t, buf.String(), "a slow successful statement")
	l.Trace(context.Background(), begin, sql, gorm.ErrRecordNotFound)
	require.Empty(t, buf.String(), "record not found")
	l.Trace(context.Background(), begin, sql, errors.New("relation does not exist"))
	require.Contains(t, buf.String(), "relation does not exist")
	require.Contains(t, buf.String(), "SELECT 42")
	buf.Reset()

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	l.Trace(cancelled, begin, sql, errors.New("driver: query interrupted"))
	l.Trace(context.Background(), begin, sql, fmt.Errorf("renew: %w", context.Canceled))
	require.Empty(t, buf.String(), "a statement cancelled with its context")
	expired, stop := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer stop()
	l.Trace(expired, begin, sql, context.DeadlineExceeded)
	require.Contains(t, buf.String(), "deadline exceeded", "a deadline that passed is a failure")
	buf.Reset()

	debug := l.LogMode(logger.Info)
	debug.Trace(context.Background(), begin, sql, nil)
	require.Empty(t, buf.String(), "LogMode keeps the filter")
	silent := l.LogMode(logger.Silent)
	silent.Trace(context.Background(), begin, sql, errors.New("boom"))
	require.Empty(t, buf.String(), "the inner level decides whether a failure prints")

	require.Equal(t, l, OnlyFailures(l), "not wrapped twice")
	require.Nil(t, OnlyFailures(nil))
}
