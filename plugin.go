package outbox

import (
	"context"
	"fmt"
	"reflect"
	"sync"
	"sync/atomic"

	"gorm.io/gorm"
)

// Plugin is the GORM plugin of one outbox. Register it right after
// gorm.Open, before deriving sessions from the *gorm.DB:
//
//	p, err := outbox.NewPlugin(outbox.Config{Rules: rules})
//	if err != nil { ... }
//	if err := db.Use(p); err != nil { ... }
//	if err := p.AutoMigrate(ctx, db); err != nil { ... }
//
// It wraps the connection pool so it can see commits, registers the
// callbacks that run the publish rules inside each write's transaction,
// and feeds its Notifier after every commit that wrote messages.
//
// Several plugins with different table names can be registered on one
// *gorm.DB; each is a separate outbox.
type Plugin struct {
	cfg      Config
	notifier *Notifier

	mu    sync.RWMutex
	rules []Rule
	// models caches, per model struct type, the rules that apply to it.
	models sync.Map // reflect.Type -> *modelRules
	// singleInsert caches the single-row INSERT per table and style.
	singleInsert sync.Map // singleInsertKey -> string
	// tables maps a table name to the model struct type with rules
	// that owns it, for writes through Table(name) or another struct;
	// tablesKnown is set once the pointer-to-struct rule types are in.
	tables      sync.Map // string -> reflect.Type
	tablesKnown atomic.Bool
	// packetLimit is MySQL's max_allowed_packet once read; -1 when it
	// could not be read.
	packetLimit atomic.Int64
}

type modelRules struct {
	ops     Operation // union of the operations of rules
	readRow Operation // union of the operations of rules built with ReadRow
	rules   []Rule
}

func (m *modelRules) for_(op Operation) bool { return m != nil && m.ops&op != 0 }

// NewPlugin validates cfg and returns a plugin for it.
func NewPlugin(cfg Config) (*Plugin, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Plugin{cfg: cfg, notifier: NewNotifier(cfg.BucketCount)}
	for _, r := range cfg.Rules {
		if err := p.AddRule(r); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Name is the GORM plugin name: "outbox:" followed by the outbox name.
func (p *Plugin) Name() string { return "outbox:" + p.cfg.Name }

// Config returns the configuration with defaults filled in.
func (p *Plugin) Config() Config { return p.cfg }

// Notifier returns the notifier that commits feed. Pass it to the local
// relay as its hint source.
func (p *Plugin) Notifier() *Notifier { return p.notifier }

// AddRule adds a publish rule. Rules added while writes run apply to
// writes that start afterwards.
func (p *Plugin) AddRule(r Rule) error {
	if r == nil {
		return &ConfigError{Package: "outbox", Field: "Rules", Value: nil, Reason: "nil rule"}
	}
	if err := r.check(); err != nil {
		return &ConfigError{Package: "outbox", Field: "Rules", Value: r.String(), Reason: err.Error()}
	}
	p.mu.Lock()
	p.rules = append(p.rules, r)
	p.models.Clear()
	p.tablesKnown.Store(false)
	p.mu.Unlock()
	return nil
}

// rulesFor returns the rules that apply to the model struct type, nil for
// none.
func (p *Plugin) rulesFor(model reflect.Type) *modelRules {
	if model == nil {
		return nil
	}
	if v, ok := p.models.Load(model); ok {
		return v.(*modelRules)
	}
	// The cache is filled under the read lock, so AddRule (which clears it
	// under the write lock) cannot run between computing the rules and
	// storing them: a stale entry would hide the new rule for good.
	p.mu.RLock()
	defer p.mu.RUnlock()
	if v, ok := p.models.Load(model); ok {
		return v.(*modelRules)
	}
	var m *modelRules
	for _, r := range p.rules {
		if r.matches(model) {
			if m == nil {
				m = &modelRules{}
			}
			m.ops |= r.operations()
			if r.readsRow() {
				m.readRow |= r.operations()
			}
			m.rules = append(m.rules, r)
		}
	}
	p.models.Store(model, m)
	return m
}

// AutoMigrate creates or updates the outbox tables under the configured
// names and schema. Running it again changes nothing.
func (p *Plugin) AutoMigrate(ctx context.Context, db *gorm.DB) error {
	return p.cfg.Tables.AutoMigrate(ctx, db)
}

// Initialize implements gorm.Plugin. It is called by db.Use.
func (p *Plugin) Initialize(db *gorm.DB) error {
	if db.ConnPool == nil {
		return fmt.Errorf("outbox: %s: the *gorm.DB has no connection pool", p.Name())
	}
	if p.cfg.Mode == ModeWAL {
		if err := p.checkWAL(db); err != nil {
			return err
		}
	}
	// With PrepareStmt set at gorm.Open the pool is a *gorm.PreparedStmtDB,
	// which GORM documents as assertable (db.ConnPool.(*gorm.PreparedStmtDB)):
	// wrap what it prepares on instead of hiding it. Its transactions are
	// then *gorm.PreparedStmtTX around a *txConn, which findTx unwraps.
	if ps, ok := db.ConnPool.(*gorm.PreparedStmtDB); ok {
		ps.ConnPool = &pool{ConnPool: ps.ConnPool, plugin: p}
		return p.registerCallbacks(db)
	}
	wrapped := &pool{ConnPool: db.ConnPool, plugin: p}
	db.ConnPool = wrapped
	if db.Statement != nil {
		db.Statement.ConnPool = wrapped
	}
	return p.registerCallbacks(db)
}

// lookup finds the outbox plugin registered on db: the only one, or
// ErrNoPlugin / ErrAmbiguousPlugin.
func lookup(db *gorm.DB) (*Plugin, error) {
	var found *Plugin
	for _, pl := range db.Config.Plugins {
		if op, ok := pl.(*Plugin); ok {
			if found != nil {
				return nil, ErrAmbiguousPlugin
			}
			found = op
		}
	}
	if found == nil {
		return nil, ErrNoPlugin
	}
	return found, nil
}

// Lookup returns the outbox plugin registered on db under name (the
// Config.Name), or the only one when name is empty.
func Lookup(db *gorm.DB, name string) (*Plugin, error) {
	if name == "" {
		return lookup(db)
	}
	if pl, ok := db.Config.Plugins["outbox:"+name].(*Plugin); ok {
		return pl, nil
	}
	return nil, fmt.Errorf("%w: none named %q", ErrNoPlugin, name)
}
