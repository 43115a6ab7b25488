package dbtest

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
)

// LogBuffer is a log sink that a logger's goroutines and a test may share:
// give it to slog.NewTextHandler and read String.
type LogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// WatchLog returns a logger that writes where Logger(t) does and sends
// each record whose message is one of msgs, with its time, to the
// returned channel (buffered for 1,000 records; a record that finds it
// full waits).
func WatchLog(t testing.TB, msgs ...string) (*slog.Logger, <-chan slog.Record) {
	h := &watch{Handler: Logger(t).Handler(), msgs: msgs, c: make(chan slog.Record, 1000)}
	return slog.New(h), h.c
}

// watch is WatchLog's handler.
type watch struct {
	slog.Handler
	msgs []string
	c    chan slog.Record
}

func (h *watch) Handle(ctx context.Context, rec slog.Record) error {
	if slices.Contains(h.msgs, rec.Message) {
		h.c <- rec.Clone()
	}
	if !h.Handler.Enabled(ctx, rec.Level) {
		return nil
	}
	return h.Handler.Handle(ctx, rec)
}

func (h *watch) Enabled(context.Context, slog.Level) bool { return true }

func (h *watch) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &watch{Handler: h.Handler.WithAttrs(attrs), msgs: h.msgs, c: h.c}
}

func (h *watch) WithGroup(name string) slog.Handler {
	return &watch{Handler: h.Handler.WithGroup(name), msgs: h.msgs, c: h.c}
}

// Attr returns the value of rec's attribute key, and whether it has one.
func Attr(rec slog.Record, key string) (v slog.Value, ok bool) {
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v, ok = a.Value, true
			return false
		}
		return true
	})
	return v, ok
}
