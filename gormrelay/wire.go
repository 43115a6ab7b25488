package gormrelay

import (
	"log/slog"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/relay"
)

// Option adjusts what New wires.
type Option func(*options)

type options struct {
	relay   relay.Config
	store   StoreConfig
	failure *FailurePolicyConfig
	logger  *slog.Logger
}

// WithRelayConfig sets the relay's configuration (batch size, poll
// interval, leases, backoff, observer, ...). New fills in what it wires
// itself when left zero: Hints (the plugin's Notifier), BucketCount (the
// plugin's), FailureHandler (the failure policy) and Logger (WithLogger).
func WithRelayConfig(cfg relay.Config) Option { return func(o *options) { o.relay = cfg } }

// WithStoreConfig sets the store's configuration (its operation timeout).
// Default: the zero StoreConfig.
func WithStoreConfig(cfg StoreConfig) Option { return func(o *options) { o.store = cfg } }

// WithFailurePolicy sets the failure policy's configuration. Default: the
// store's own policy, the zero FailurePolicyConfig (dead-letter after
// MaxAttemptsDefault attempts or at the first permanent error).
func WithFailurePolicy(cfg FailurePolicyConfig) Option {
	return func(o *options) { o.failure = &cfg }
}

// WithLogger sets the logger of the relay and the failure policy when
// their configurations leave it nil, and of the store (its warnings, and
// its own failure policy when WithFailurePolicy is not given). Default:
// the plugin's Config.Logger for the store, slog.Default() for the rest.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// New wires a relay for the outbox of plugin on db, publishing to pub: the
// GORM store of the plugin's tables, the failure policy, the plugin's
// Notifier as hints (a local commit wakes the relay at once) and the
// plugin's BucketCount. It starts nothing: call Start on the returned
// relay, which fails at once on missing tables or a BucketCount mismatch,
// and Stop on shutdown.
//
//	r, err := gormrelay.New(db, plugin, pub)
//	if err != nil { ... }
//	if err := r.Start(ctx); err != nil { ... }
//	defer r.Stop(shutdownCtx)
//
// A relay.Config passed with WithRelayConfig whose BucketCount differs
// from the plugin's is refused by relay.New with a *relay.ConfigError
// (Field "BucketCount") wrapping relay.CheckBucketCount's error.
func New(db *gorm.DB, plugin *outbox.Plugin, pub relay.Publisher, opts ...Option) (*relay.Relay, error) {
	if plugin == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "plugin", Value: nil, Reason: "an *outbox.Plugin is required"}
	}
	if pub == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "publisher", Value: nil, Reason: "a relay.Publisher is required"}
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	cfg := plugin.Config()
	store, err := NewStore(db, cfg, o.store)
	if err != nil {
		return nil, err
	}
	if o.logger != nil {
		store.logger = o.logger
	}
	rc := o.relay // relay.New takes BucketCount from the store, the plugin's
	if rc.Hints == nil {
		rc.Hints = plugin.Notifier()
	}
	if rc.Logger == nil {
		rc.Logger = o.logger
	}
	if rc.FailureHandler == nil && o.failure != nil {
		fc := *o.failure
		if fc.Logger == nil {
			fc.Logger = o.logger
		}
		policy, err := NewFailurePolicy(store, fc)
		if err != nil {
			return nil, err
		}
		rc.FailureHandler = policy
	} // else the relay uses the store's own default policy

	return relay.New(store, pub, rc)
}
