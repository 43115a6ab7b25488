package gormrelay

import (
	"net/http"
	"net/url"
	"time"

	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/ops/opsui"
)

// The front ends of the operator API live in ops/opshttp and ops/opsui,
// where they take any ops.Operator. These are their gormrelay names,
// taking the Admin.

// AdminHandlerOptions configures NewAdminHandler (opshttp.Options).
type AdminHandlerOptions = opshttp.Options

// RequeueRequest is the body of POST /dead-letters/requeue
// (opshttp.RequeueRequest).
type RequeueRequest = opshttp.RequeueRequest

// NewAdminHandler returns the Admin's operations as JSON over HTTP
// (opshttp.NewHandler, which documents the routes).
func NewAdminHandler(admin *Admin, opts AdminHandlerOptions) http.Handler {
	return opshttp.NewHandler(admin, opts)
}

// UI is the operator's web interface (opsui.UI).
type UI = opsui.UI

// UIOptions configures NewUI (opsui.Options).
type UIOptions = opsui.Options

// UI defaults (opsui.RefreshIntervalDefault and the rest).
const (
	UIRefreshIntervalDefault = opsui.RefreshIntervalDefault
	UIThroughputWindow       = opsui.ThroughputWindow
	UIChartWindow            = opsui.ChartWindow
	UIChartStep              = opsui.ChartStep
	UITokenLifetime          = opsui.TokenLifetime
)

// NewUI returns the web interface of admin's outbox (opsui.New).
func NewUI(admin *Admin, opts UIOptions) *UI { return opsui.New(admin, opts) }

// ParseDeadLetterQuery reads a dead-letter filter from URL query
// parameters (ops.ParseDeadLetterQuery).
func ParseDeadLetterQuery(v url.Values, now time.Time) (DeadLetterQuery, error) {
	return ops.ParseDeadLetterQuery(v, now)
}

// ParseAdminTime parses a time given to the admin tools: RFC 3339, or a
// duration meaning that long before now (ops.ParseTime).
func ParseAdminTime(s string, now time.Time) (time.Time, error) { return ops.ParseTime(s, now) }
