package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/gin-gonic/gin"
	"github.com/glebarez/sqlite"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/twmb/franz-go/pkg/kfake"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Config is the service's configuration; flags and environment variables
// fill it in main.
type Config struct {
	// Addr is the HTTP listen address. Default ":8080".
	Addr string
	// DatabaseURL is postgres://..., mysql://... or a SQLite file path
	// (sqlite://path or a bare path). Default: the SQLite file
	// gin-orders.db in the working directory.
	DatabaseURL string
	// KafkaBrokers are comma-separated broker addresses. Empty: start an
	// in-process Kafka-protocol broker on a loopback port.
	KafkaBrokers string
	// Topic receives the order events. Default "orders".
	Topic string
	// HealthMaxAge is the oldest-pending age above which /healthz fails.
	HealthMaxAge time.Duration
	// Consume runs the demo consumer that logs every event once.
	Consume bool
	Logger  *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.Addr == "" {
		c.Addr = ":8080"
	}
	if c.DatabaseURL == "" {
		c.DatabaseURL = "gin-orders.db"
	}
	if c.Topic == "" {
		c.Topic = "orders"
	}
	if c.HealthMaxAge == 0 {
		c.HealthMaxAge = time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// App is a running service: HTTP, relay, publisher, optional embedded
// broker and demo consumer.
type App struct {
	cfg      Config
	log      *slog.Logger
	db       *gorm.DB
	plugin   *outbox.Plugin
	relay    *relay.Relay
	metrics  *metrics.Collector
	pub      *publisher.Kafka
	broker   *kfake.Cluster
	consumer *Consumer
	server   *http.Server
	listener net.Listener
	brokers  []string
}

// Start builds and starts every part of the service; ctx bounds the start
// (cancelling it abandons a start in progress), not the service's life.
// Close stops the service.
func Start(ctx context.Context, cfg Config) (_ *App, err error) {
	cfg = cfg.withDefaults()
	a := &App{cfg: cfg, log: cfg.Logger}
	defer func() {
		if err != nil {
			a.Close(context.Background())
		}
	}()

	if a.db, err = openDatabase(cfg.DatabaseURL); err != nil {
		return nil, err
	}
	if a.plugin, err = outbox.NewPlugin(outbox.Config{Rules: orderRules(cfg.Topic), Logger: a.log}); err != nil {
		return nil, err
	}
	if err = a.db.Use(a.plugin); err != nil {
		return nil, err
	}
	if err = a.plugin.AutoMigrate(ctx, a.db); err != nil {
		return nil, err
	}
	if err = a.db.WithContext(ctx).AutoMigrate(&Order{}); err != nil {
		return nil, fmt.Errorf("migrate orders: %w", err)
	}

	if cfg.KafkaBrokers == "" {
		// The zero-setup default: a Kafka-protocol broker in this process.
		if a.broker, err = kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(8, cfg.Topic)); err != nil {
			return nil, fmt.Errorf("start in-process Kafka broker: %w", err)
		}
		a.brokers = a.broker.ListenAddrs()
		a.log.Info("started in-process Kafka-protocol broker", slog.Any("brokers", a.brokers))
	} else {
		a.brokers = strings.Split(cfg.KafkaBrokers, ",")
	}

	if a.pub, err = publisher.NewKafka(publisher.KafkaConfig{
		Brokers: a.brokers,
		Configure: func(c *sarama.Config) error {
			c.ClientID = "gin-orders"
			return nil
		},
		Logger: a.log,
	}); err != nil {
		return nil, err
	}
	// Start connects and initialises the producer. Like the relay, the
	// publisher runs until Close stops it: the end of a Start context
	// would close it. The connect is bounded by sarama's dial and
	// metadata timeouts.
	if err = a.pub.Start(context.WithoutCancel(ctx)); err != nil {
		return nil, err
	}
	if a.metrics, err = metrics.New(metrics.Config{Outbox: a.plugin.Config().Name}); err != nil {
		return nil, err
	}
	// The relay dead-letters a message that keeps failing (the store's
	// default failure policy) and parks the later events of its order.
	// gormrelay.New wires the store, the plugin's hints and bucket count.
	if a.relay, err = gormrelay.New(a.db, a.plugin, publisher.TracingPublisher(a.pub, nil),
		gormrelay.WithRelayConfig(relay.Config{Observer: a.metrics, Logger: a.log})); err != nil {
		return nil, err
	}
	// The relay runs until Close stops it gracefully; a cancelled Start
	// context would stop it abruptly instead.
	if err = a.relay.Start(context.WithoutCancel(ctx)); err != nil {
		return nil, err
	}

	if cfg.Consume {
		if a.consumer, err = StartConsumer(a.brokers, cfg.Topic, a.log); err != nil {
			return nil, err
		}
	}

	if a.listener, err = net.Listen("tcp", cfg.Addr); err != nil {
		return nil, err
	}
	a.server = &http.Server{Handler: a.routes(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := a.server.Serve(a.listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("http server stopped", slog.Any("error", err))
		}
	}()
	a.log.Info("gin-orders listening", slog.String("addr", a.listener.Addr().String()))
	return a, nil
}

// Addr is the address the HTTP server listens on.
func (a *App) Addr() string { return a.listener.Addr().String() }

// Brokers are the Kafka brokers the service publishes to.
func (a *App) Brokers() []string { return a.brokers }

func (a *App) routes() http.Handler {
	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	r.Use(gin.Recovery())
	orderHandlers{db: a.db}.routes(r)

	// Prometheus: the outbox collector (relay events and backlog samples)
	// on the service's own registry, with the Go runtime.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), a.metrics)
	r.GET("/metrics", gin.WrapH(promhttp.HandlerFor(reg, promhttp.HandlerOpts{})))

	admin := gormrelay.PluginAdmin(a.db, a.plugin)
	// 503 while the oldest pending event is older than HealthMaxAge.
	r.GET("/healthz", gin.WrapH(gormrelay.HealthHandler(admin, a.cfg.HealthMaxAge)))
	// The operational API, read-only: it must sit behind the service's own
	// authentication before AllowMutations is ever turned on.
	adminAPI := http.StripPrefix("/admin/outbox", gormrelay.NewAdminHandler(admin, gormrelay.AdminHandlerOptions{Logger: a.log}))
	r.Any("/admin/outbox/*path", gin.WrapH(adminAPI))
	// The operator web UI on the same Admin, read-only like the API, with
	// the relay's acknowledged count for its throughput figure.
	ui := http.StripPrefix("/admin/outbox-ui", gormrelay.NewUI(admin, gormrelay.UIOptions{
		Logger: a.log, Published: a.metrics.Acknowledged}))
	r.Any("/admin/outbox-ui/*path", gin.WrapH(ui))
	return r
}

// Close shuts the service down in dependency order: stop taking requests,
// stop the relay (it finishes its batch and releases its leases so a peer
// takes over at once), close the producer (flushes), then the consumer,
// the broker and the database.
func (a *App) Close(ctx context.Context) {
	if a.server != nil {
		if err := a.server.Shutdown(ctx); err != nil {
			a.log.Warn("http shutdown", slog.Any("error", err))
		}
	}
	if a.relay != nil {
		if err := a.relay.Stop(ctx); err != nil {
			a.log.Warn("relay stop", slog.Any("error", err))
		}
	}
	if a.pub != nil {
		if err := a.pub.Stop(ctx); err != nil {
			a.log.Warn("publisher stop", slog.Any("error", err))
		}
	}
	if a.consumer != nil {
		a.consumer.Close()
	}
	if a.broker != nil {
		a.broker.Close()
	}
	if a.db != nil {
		if sqlDB, err := a.db.DB(); err == nil {
			sqlDB.Close()
		}
	}
}

// openDatabase opens the database named by a URL: postgres://,
// postgresql://, mysql:// or a SQLite file path.
func openDatabase(raw string) (*gorm.DB, error) {
	cfg := &gorm.Config{Logger: logger.Discard}
	switch {
	case strings.HasPrefix(raw, "postgres://"), strings.HasPrefix(raw, "postgresql://"):
		db, err := gorm.Open(postgres.Open(raw), cfg)
		return withPool(db, err, keepIdle)
	case strings.HasPrefix(raw, "mysql://"):
		dsn, err := outbox.MySQLDSN(raw)
		if err != nil {
			return nil, err
		}
		db, err := gorm.Open(mysql.Open(dsn), cfg)
		return withPool(db, err, keepIdle)
	default:
		// github.com/glebarez/sqlite is GORM's dialector over the pure-Go
		// modernc.org/sqlite: the example builds without cgo or a C
		// compiler. (The library's own tests use gorm.io/driver/sqlite.)
		path := strings.TrimPrefix(raw, "sqlite://")
		db, err := gorm.Open(sqlite.Open("file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate"), cfg)
		// SQLite has one writer at a time; one connection avoids
		// SQLITE_BUSY between pooled connections.
		return withPool(db, err, func(p *sql.DB) { p.SetMaxOpenConns(1) })
	}
}

// keepIdle lets a server database's pool keep 16 idle connections.
// database/sql keeps 2 unless told otherwise and closes every connection
// returned beyond them, so the relay's 8 drainers and the request
// handlers would open a new database session for most statements.
func keepIdle(p *sql.DB) { p.SetMaxIdleConns(16) }

// withPool applies set to the connection pool of a database gorm.Open
// returned, passing its error on.
func withPool(db *gorm.DB, err error, set func(*sql.DB)) (*gorm.DB, error) {
	if err != nil {
		return nil, err
	}
	p, err := db.DB()
	if err != nil {
		return nil, err
	}
	set(p)
	return db, nil
}
