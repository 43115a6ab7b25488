package outbox

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm"
)

// Admin is the operational API of one outbox: it reads and repairs the
// outbox tables directly and works without a running relay.
type Admin struct {
	db  *gorm.DB
	cfg Config
}

// NewAdmin returns the operational API for the outbox configured by cfg
// on db. It validates cfg like NewPlugin.
func NewAdmin(db *gorm.DB, cfg Config) (*Admin, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Admin{db: db.Session(&gorm.Session{NewDB: true, SkipHooks: true}), cfg: cfg}, nil
}

// Admin returns the operational API of the plugin's outbox on db.
func (p *Plugin) Admin(db *gorm.DB) *Admin {
	return &Admin{db: db.Session(&gorm.Session{NewDB: true, SkipHooks: true}), cfg: p.cfg}
}

// BucketBacklog is the backlog of one bucket.
type BucketBacklog struct {
	Bucket  int
	Pending int64
	// Oldest is the creation time of the oldest pending message.
	Oldest time.Time
}

// Backlog is what is waiting to be published.
type Backlog struct {
	// Pending counts the messages in the messages table.
	Pending int64
	// Oldest is the creation time of the oldest pending message; zero
	// when nothing is pending.
	Oldest time.Time
	// Buckets lists the buckets with pending messages, in bucket order.
	Buckets []BucketBacklog
	// SampledAt is when the backlog was read.
	SampledAt time.Time
}

// OldestAge is how long the oldest pending message has waited at
// SampledAt; zero when nothing is pending.
func (b Backlog) OldestAge() time.Duration {
	if b.Oldest.IsZero() {
		return 0
	}
	return b.SampledAt.Sub(b.Oldest)
}

// Backlog reads the pending count and the oldest pending message, in total
// and per bucket, with one grouped query.
func (a *Admin) Backlog(ctx context.Context) (Backlog, error) {
	var rows []struct {
		Bucket  int
		Pending int64
		Oldest  int64
	}
	err := a.db.WithContext(ctx).Table(a.cfg.Tables.MessagesTable()).
		Select("bucket, COUNT(*) AS pending, MIN(created_at_ms) AS oldest").
		Group("bucket").Order("bucket").Scan(&rows).Error
	if err != nil {
		return Backlog{}, fmt.Errorf("outbox: read backlog of %s: %w", a.cfg.Tables.MessagesTable(), err)
	}
	b := Backlog{SampledAt: time.Now()}
	for _, r := range rows {
		oldest := time.UnixMilli(r.Oldest)
		b.Buckets = append(b.Buckets, BucketBacklog{Bucket: r.Bucket, Pending: r.Pending, Oldest: oldest})
		b.Pending += r.Pending
		if b.Oldest.IsZero() || oldest.Before(b.Oldest) {
			b.Oldest = oldest
		}
	}
	return b, nil
}
