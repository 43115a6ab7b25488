package gormrelay

import (
	"log/slog"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/publisher"
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

// NewKafka wires a relay for the outbox of plugin on db that publishes to
// Kafka through a publisher.Kafka built from kcfg, and owns it
// (relay.Config.OwnPublisher): Run (or Start) starts the publisher after
// the store's start check and fails if no broker answers; the publisher is
// stopped, bounded by relay.Config.ShutdownTimeout, once the relay has
// stopped. Everything else is New's. The whole wiring, from gorm.Open:
//
//	db, err := gorm.Open(postgres.Open(dsn), &gorm.Config{})
//	if err != nil { return err }
//	p, err := outbox.NewPlugin(outbox.Config{Rules: rules})
//	if err != nil { return err }
//	if err := db.Use(p); err != nil { return err }
//	if err := p.AutoMigrate(ctx, db); err != nil { return err }
//	r, err := gormrelay.NewKafka(db, p, publisher.KafkaConfig{Brokers: brokers})
//	if err != nil { return err }
//	return r.Run(ctx) // nil once ctx ended and the relay stopped cleanly
//
// kcfg.Logger defaults to WithLogger's logger. An invalid kcfg is refused
// with the *relay.ConfigError of publisher.NewKafka. To share one
// publisher between relays, or wrap it (publisher.TracingPublisher), build
// it with publisher.NewKafka, start and stop it yourself, and use New.
func NewKafka(db *gorm.DB, plugin *outbox.Plugin, kcfg publisher.KafkaConfig, opts ...Option) (*relay.Relay, error) {
	o := collect(opts)
	if kcfg.Logger == nil {
		kcfg.Logger = o.logger
	}
	k, err := publisher.NewKafka(kcfg)
	if err != nil {
		return nil, err
	}
	return assemble(db, plugin, k, true, o)
}

// NewKafkaTransactional is NewKafka with the strict-mode publisher,
// publisher.Transactional built from tcfg (Kafka transactions, one
// transactional id per bucket; see package publisher), owned by the relay
// the same way.
func NewKafkaTransactional(db *gorm.DB, plugin *outbox.Plugin, tcfg publisher.TransactionalConfig, opts ...Option) (*relay.Relay, error) {
	o := collect(opts)
	if tcfg.Logger == nil {
		tcfg.Logger = o.logger
	}
	t, err := publisher.NewTransactional(tcfg)
	if err != nil {
		return nil, err
	}
	return assemble(db, plugin, t, true, o)
}

// New wires a relay for the outbox of plugin on db, publishing to pub: the
// GORM store of the plugin's tables, the failure policy, the plugin's
// Notifier as hints (a local commit wakes the relay at once) and the
// plugin's BucketCount. It starts nothing: run the returned relay with
// Run, which fails at once on missing tables, a BucketCount mismatch or a
// publisher that was never started, and returns when its context ends or
// the relay stops on an error. pub is the caller's: start it before the
// relay and stop it after (NewKafka builds and owns one instead).
//
//	pub, err := publisher.NewKafka(publisher.KafkaConfig{Brokers: brokers})
//	if err != nil { ... }
//	if err := pub.Start(ctx); err != nil { ... }
//	defer pub.Stop(context.Background())
//	r, err := gormrelay.New(db, plugin, pub)
//	if err != nil { ... }
//	return r.Run(ctx)
//
// A relay.Config passed with WithRelayConfig whose BucketCount differs
// from the plugin's is refused by relay.New with a *relay.ConfigError
// (Field "BucketCount") wrapping relay.CheckBucketCount's error.
func New(db *gorm.DB, plugin *outbox.Plugin, pub relay.Publisher, opts ...Option) (*relay.Relay, error) {
	return assemble(db, plugin, pub, false, collect(opts))
}

func collect(opts []Option) options {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// assemble is New; own hands pub's lifecycle to the relay.
func assemble(db *gorm.DB, plugin *outbox.Plugin, pub relay.Publisher, own bool, o options) (*relay.Relay, error) {
	if plugin == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "plugin", Value: nil, Reason: "an *outbox.Plugin is required"}
	}
	if pub == nil {
		return nil, &relay.ConfigError{Package: "gormrelay", Field: "publisher", Value: nil, Reason: "a relay.Publisher is required"}
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
	if own {
		rc.OwnPublisher = true
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
