package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/glebarez/sqlite"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/twmb/franz-go/pkg/kfake"
	"golang.org/x/sync/errgroup"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/metrics"
	"github.com/gorm-outbox/outbox/ops"
	"github.com/gorm-outbox/outbox/ops/opshttp"
	"github.com/gorm-outbox/outbox/ops/opsui"
	"github.com/gorm-outbox/outbox/pgwal"
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
	// HealthMaxAge is the oldest-pending age above which /healthz (the
	// outbox's delivery check, not the API's readiness) fails.
	HealthMaxAge time.Duration
	// Consume runs the demo consumer that logs every event once.
	Consume bool
	// Mode is the outbox mode: "table" (default) writes messages to the
	// messages table, relayed by the table relay; "wal" (PostgreSQL 14+
	// with wal_level=logical, DatabaseURL's role with the REPLICATION
	// attribute) writes them to the WAL, relayed by a pgwal.Reader from a
	// replication slot created at start.
	Mode string
	// WALSlot names the replication slot in WAL mode. Default: pgwal's,
	// "outbox_" followed by the outbox name.
	WALSlot string
	// OutboxName is outbox.Config.Name: the metrics label and, in WAL
	// mode, the prefix of the WAL messages. A slot decodes the messages
	// of its whole database, so services sharing a database in WAL mode
	// need distinct names. Default: the messages table name.
	OutboxName string
	// ShutdownTimeout bounds each step of the shutdown: the relay's
	// graceful stop, the producer's flush, the HTTP server's. Default
	// relay.ShutdownTimeoutDefault (10s).
	ShutdownTimeout time.Duration
	Logger          *slog.Logger
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
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = relay.ShutdownTimeoutDefault
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// App is the service: HTTP, relay (which owns its Kafka producer),
// optional embedded broker and demo consumer.
type App struct {
	cfg      Config
	log      *slog.Logger
	db       *gorm.DB
	plugin   *outbox.Plugin
	relay    *relay.Relay
	reader   *pgwal.Reader // WAL mode, instead of relay; it owns its producer
	metrics  *metrics.Collector
	broker   *kfake.Cluster
	consumer *Consumer
	server   *http.Server
	listener net.Listener
	brokers  []string
}

// Serve runs the service until ctx ends or one of its parts fails, then
// shuts it down in order. It returns nil after a clean shutdown at the end
// of ctx, and otherwise the error that ended it: a start that failed, or
// the relay or HTTP server stopping on an error (a relay that meets a
// misconfiguration, such as a writer with a larger BucketCount, ends the
// service instead of stopping unnoticed). started, if not nil, is called
// once the service is up.
func Serve(ctx context.Context, cfg Config, started func(*App)) error {
	a, err := Start(ctx, cfg)
	if err != nil {
		return err
	}
	if started != nil {
		started(a)
	}
	err = a.Run(ctx)
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.cfg.ShutdownTimeout)
	defer cancel()
	a.Close(shutdown)
	return err
}

// Start builds every part of the service and starts the in-process broker
// and the demo consumer, and listens on Addr; Run serves. ctx bounds the
// start (cancelling it abandons a start in progress), not the service's
// life. Close releases what Start opened.
func Start(ctx context.Context, cfg Config) (_ *App, err error) {
	cfg = cfg.withDefaults()
	a := &App{cfg: cfg, log: cfg.Logger}
	defer func() {
		if err != nil {
			a.Close(context.Background())
		}
	}()

	mode, err := cfg.outboxMode()
	if err != nil {
		return nil, err
	}
	if a.db, err = openDatabase(cfg.DatabaseURL); err != nil {
		return nil, err
	}
	if a.plugin, err = outbox.NewPlugin(outbox.Config{Name: cfg.OutboxName, Mode: mode, Rules: orderRules(cfg.Topic), Logger: a.log}); err != nil {
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

	if a.metrics, err = metrics.New(metrics.Config{Outbox: a.plugin.Config().Name}); err != nil {
		return nil, err
	}
	if mode == outbox.ModeWAL {
		if err = a.startWAL(ctx, a.kafkaConfig()); err != nil {
			return nil, err
		}
	} else if a.relay, err = gormrelay.NewKafka(a.db, a.plugin, a.kafkaConfig(),
		gormrelay.WithRelayConfig(relay.Config{Observer: a.metrics, Logger: a.log, ShutdownTimeout: cfg.ShutdownTimeout})); err != nil {
		// NewKafka wires the store, the plugin's hints and bucket count,
		// the store's default failure policy (it dead-letters a message
		// that keeps failing and parks the later events of its order) and
		// a Kafka producer that the relay owns: Run starts it before the
		// relay and stops it after.
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
	handler, err := a.routes()
	if err != nil {
		return nil, err
	}
	a.server = &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	return a, nil
}

// Run runs the relay and the HTTP server in one errgroup until ctx ends or
// either fails; the first failure ends the other. At the end of ctx the
// relay stops gracefully (its in-flight batch finishes, its leases are
// released so a peer takes over at once, then the producer flushes) while
// the HTTP server finishes its requests, each within
// Config.ShutdownTimeout. Run returns nil after a clean stop at the end of
// ctx, the failing part's error otherwise; a relay that cannot start (no
// broker answers, tables missing) fails it at once.
func (a *App) Run(ctx context.Context) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if a.reader != nil {
			return a.runWAL(ctx)
		}
		if err := a.relay.Run(ctx); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		if ctx.Err() == nil {
			return errors.New("relay: stopped before the service")
		}
		return nil
	})
	g.Go(func() error {
		served := make(chan error, 1)
		go func() { served <- a.server.Serve(a.listener) }()
		a.log.Info("gin-orders listening", slog.String("addr", a.listener.Addr().String()))
		select {
		case err := <-served:
			return fmt.Errorf("http server: %w", err)
		case <-ctx.Done():
		}
		shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.cfg.ShutdownTimeout)
		defer cancel()
		if err := a.server.Shutdown(shutdown); err != nil {
			a.log.Warn("http shutdown", slog.Any("error", err))
		}
		<-served
		return nil
	})
	return g.Wait()
}

// Addr is the address the HTTP server listens on.
func (a *App) Addr() string { return a.listener.Addr().String() }

// Brokers are the Kafka brokers the service publishes to.
func (a *App) Brokers() []string { return a.brokers }

func (a *App) routes() (http.Handler, error) {
	gin.SetMode(gin.ReleaseMode)
	r := gin.New()
	r.Use(gin.Recovery())
	orderHandlers{db: a.db}.routes(r)

	// Prometheus: the outbox collector (relay or reader events and
	// backlog samples) on the service's own registry, with the Go runtime.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), a.metrics)

	// The outbox's operator: table mode's Admin, or in WAL mode the
	// slot's (its reader, lag, retained WAL and dead letters); and the
	// relay or WAL reader whose end the probes report.
	var (
		admin ops.Operator = gormrelay.PluginAdmin(a.db, a.plugin)
		runs  opshttp.Stopper
	)
	if a.relay != nil {
		runs = a.relay
	}
	if a.reader != nil {
		wal, err := a.reader.Admin(a.plugin)
		if err != nil {
			return nil, err
		}
		admin, runs = wal, a.reader
		// The reader's series (retained WAL, lost slot, reading) and the
		// Admin's, read from the slot and its lease at each scrape
		// (whether any reader holds the lease, the lag in time). A process
		// that serves the admin API without a reader registers the
		// collector of pgwal.NewAdmin, which exports the slot's gauges too.
		reg.MustRegister(a.reader.Collector(), wal.Collector())
	}
	r.GET("/metrics", gin.WrapH(promhttp.HandlerFor(reg, promhttp.HandlerOpts{})))
	// Kubernetes probes. Liveness (/livez): 503 once the relay (or WAL
	// reader) stopped on an error or could not start. Readiness (/readyz)
	// is the API's: 503 while the database does not answer. It leaves out
	// the outbox's delivery on purpose: during a Kafka outage the API keeps
	// taking orders, their events wait in the outbox, and a readiness that
	// failed on the backlog's age would take every pod out of the load
	// balancer, turning a delivery delay into an outage of the API.
	// The outbox's delivery check (/healthz), for monitoring and alerts:
	// 503 when the relay stopped, while the oldest pending event is older
	// than HealthMaxAge or the database does not answer; in WAL mode also
	// while the slot is lost, missing, has no reader or retains too much
	// WAL.
	health := opshttp.Health{Operator: admin, Relay: runs, MaxAge: a.cfg.HealthMaxAge, Logger: a.log}
	r.GET("/livez", gin.WrapH(health.Liveness()))
	r.GET("/readyz", a.ready)
	r.GET("/healthz", gin.WrapH(health.Readiness()))
	// The operational API, read-only: it must sit behind the service's own
	// authentication before AllowMutations is ever turned on.
	adminAPI := http.StripPrefix("/admin/outbox", opshttp.NewHandler(admin, opshttp.Options{Logger: a.log}))
	r.Any("/admin/outbox/*path", gin.WrapH(adminAPI))
	// The operator web UI on the same Admin, read-only like the API, with
	// the relay's acknowledged count for its throughput figure.
	ui := http.StripPrefix("/admin/outbox-ui", opsui.New(admin, opsui.Options{
		Logger: a.log, Published: a.metrics.Acknowledged}))
	r.Any("/admin/outbox-ui/*path", gin.WrapH(ui))
	return r, nil
}

// ready answers /readyz: 200 while the database answers a ping within
// opshttp.HealthTimeoutDefault, else 503.
func (a *App) ready(c *gin.Context) {
	ctx, cancel := context.WithTimeout(c.Request.Context(), opshttp.HealthTimeoutDefault)
	defer cancel()
	sqlDB, err := a.db.DB()
	if err == nil {
		err = sqlDB.PingContext(ctx)
	}
	if err != nil {
		a.log.WarnContext(ctx, "readiness: the database does not answer", "err", err)
		c.JSON(http.StatusServiceUnavailable, gin.H{"status": "error"})
		return
	}
	c.JSON(http.StatusOK, gin.H{"status": "ok"})
}

// Close releases what Start opened, once Run returned (or if it never
// ran): the listener, the demo consumer, the broker and the database. The
// relay and its producer have stopped when Run returned; a relay that
// never ran is stopped here (a no-op).
func (a *App) Close(ctx context.Context) {
	if a.server != nil {
		if err := a.server.Shutdown(ctx); err != nil {
			a.log.Warn("http shutdown", slog.Any("error", err))
		}
	}
	if a.listener != nil {
		_ = a.listener.Close() // already closed if Run served
	}
	if a.relay != nil {
		if err := a.relay.Stop(ctx); err != nil {
			a.log.Warn("relay stop", slog.Any("error", err))
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
		// The pool keeps database/sql's defaults: the relay's store
		// raises an idle limit nobody set to what its drainers need.
		return gorm.Open(postgres.Open(raw), cfg)
	case strings.HasPrefix(raw, "mysql://"):
		dsn, err := outbox.MySQLDSN(raw)
		if err != nil {
			return nil, err
		}
		return gorm.Open(mysql.Open(dsn), cfg)
	default:
		// github.com/glebarez/sqlite is GORM's dialector over the pure-Go
		// modernc.org/sqlite: the example builds without cgo or a C
		// compiler. (The library's own tests use gorm.io/driver/sqlite.)
		path := strings.TrimPrefix(raw, "sqlite://")
		db, err := gorm.Open(sqlite.Open("file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate"), cfg)
		if err != nil {
			return nil, err
		}
		p, err := db.DB()
		if err != nil {
			return nil, err
		}
		// SQLite has one writer at a time; one connection avoids
		// SQLITE_BUSY between pooled connections.
		p.SetMaxOpenConns(1)
		return db, nil
	}
}
