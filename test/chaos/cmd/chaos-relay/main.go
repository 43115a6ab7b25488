// Command chaos-relay is the relay process of the chaos test
// (test/chaos): one outbox relay on PostgreSQL publishing to a
// Kafka-protocol cluster, configured by flags and the environment, that
// the test kills (SIGKILL), stops (SIGTERM), pauses (SIGSTOP/SIGCONT) and
// restarts.
//
//	CHAOS_DSN='host=127.0.0.1 user=postgres dbname=test search_path=s application_name=chaos-relay-0' \
//	  chaos-relay -brokers 127.0.0.1:9092 -buckets 16 -lease 2s -renew 500ms
//
// The DSN comes from the environment, not a flag, so that a password in it
// never shows in a process listing. Set application_name in the DSN: the
// test finds the relay's database backends by it to terminate them.
//
// With -source wal it reads an outbox in outbox.ModeWAL from its logical
// replication slot (package pgwal) instead of the outbox tables.
//
// SIGTERM or SIGINT stops the relay gracefully (relay.Stop, then the
// publisher's Close) and exits 0. A relay that stops on its own, with a
// misconfiguration, exits 2. Logs are JSON lines on stderr.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// Exit codes.
const (
	exitOK         = 0
	exitSetup      = 1
	exitRelayError = 2
)

type options struct {
	brokers     string
	relayID     string
	buckets     int
	batch       int
	lease       time.Duration
	renew       time.Duration
	poll        time.Duration
	backMin     time.Duration
	backMax     time.Duration
	stall       time.Duration
	maxAttempts int
	mode        string
	txnPrefix   string
	txnTimeout  time.Duration
	markerBytes int
	stopAfter   time.Duration
	logLevel    string
	maxConns    int
	source      string
	maxPending  int
}

func main() {
	var o options
	flag.StringVar(&o.brokers, "brokers", "", "comma-separated Kafka bootstrap brokers (required)")
	flag.StringVar(&o.relayID, "id", "", "relay id (default: generated, unique per process)")
	flag.IntVar(&o.buckets, "buckets", outbox.BucketCountDefault, "bucket count, as the writers'")
	flag.IntVar(&o.batch, "batch", 200, "batch size")
	flag.DurationVar(&o.lease, "lease", 2*time.Second, "lease duration")
	flag.DurationVar(&o.renew, "renew", 500*time.Millisecond, "lease renew interval")
	flag.DurationVar(&o.poll, "poll", 200*time.Millisecond, "poll interval")
	flag.DurationVar(&o.backMin, "backoff-min", 50*time.Millisecond, "minimum backoff")
	flag.DurationVar(&o.backMax, "backoff-max", time.Second, "maximum backoff")
	flag.DurationVar(&o.stall, "stall-timeout", time.Second, "default and franz modes: publisher.KafkaConfig.StallTimeout and FranzConfig.StallTimeout, compressed about 30 times against their defaults as the backoff is")
	flag.IntVar(&o.maxAttempts, "max-attempts", 300, "failed attempts before a message is dead-lettered (scaled to the compressed backoff)")
	flag.StringVar(&o.mode, "mode", "default", "publisher: default (idempotent sarama producer), franz (publisher.Franz: a bucket's batches overlapping in flight) or strict (one Kafka transaction per batch)")
	flag.StringVar(&o.txnPrefix, "txn-prefix", "chaos-", "strict mode: transactional id prefix, shared by all relays")
	flag.DurationVar(&o.txnTimeout, "txn-timeout", 10*time.Second, "strict mode: the brokers abort a transaction open longer than this")
	flag.IntVar(&o.markerBytes, "marker-max-bytes", 0, "strict mode: TransactionalConfig.MarkerMaxBytes (0: the default); a small bound records most batches as their span")
	flag.DurationVar(&o.stopAfter, "stop-timeout", 10*time.Second, "graceful stop budget")
	flag.StringVar(&o.logLevel, "log", "info", "log level: debug, info, warn, error")
	flag.IntVar(&o.maxConns, "max-conns", 4, "database connections")
	flag.StringVar(&o.source, "source", "table", "what the relay reads: table (the outbox tables, relay.Relay) or wal (the outbox in outbox.ModeWAL, a pgwal.Reader of its logical replication slot; CHAOS_DSN is also the replication DSN)")
	flag.IntVar(&o.maxPending, "max-pending", 0, "wal: pgwal.Config.MaxPending (0: the default)")
	flag.Parse()
	os.Exit(run(o))
}

func run(o options) int {
	// Before anything else: a SIGTERM that arrives during setup must stop
	// the relay gracefully too, not kill the process.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)

	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		fmt.Fprintln(os.Stderr, "chaos-relay: -log:", err)
		return exitSetup
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("pid", os.Getpid())

	dsn := os.Getenv("CHAOS_DSN")
	if dsn == "" || o.brokers == "" {
		log.Error("chaos-relay: CHAOS_DSN and -brokers are required")
		return exitSetup
	}
	brokers := strings.Split(o.brokers, ",")

	// The injector terminates database backends at random, also the one a
	// relay that is just starting opened; retry the open as a supervisor
	// restarting the process would.
	var db *gorm.DB
	if code, ok := retryStart(log, sig, "open database", 200*time.Millisecond, func() (err error) {
		db, err = gorm.Open(postgres.Open(dsn), &gorm.Config{Logger: logger.Discard})
		return err
	}); !ok {
		return code
	}
	sqlDB, err := db.DB()
	if err != nil {
		log.Error("chaos-relay: database", "err", err)
		return exitSetup
	}
	defer sqlDB.Close()
	sqlDB.SetMaxOpenConns(o.maxConns)

	if o.source != "table" && o.source != "wal" {
		log.Error("chaos-relay: -source must be table or wal", "source", o.source)
		return exitSetup
	}
	ocfg := outbox.Config{BucketCount: o.buckets, Logger: log}
	if o.source == "wal" {
		ocfg.Mode = outbox.ModeWAL
	}
	store, err := gormrelay.NewStore(db, ocfg)
	if err != nil {
		log.Error("chaos-relay: store", "err", err)
		return exitSetup
	}

	configure := func(c *sarama.Config) error {
		c.ClientID = "chaos-relay"
		c.Net.DialTimeout = 2 * time.Second
		c.Net.ReadTimeout = 5 * time.Second
		c.Net.WriteTimeout = 5 * time.Second
		c.Metadata.Retry.Backoff = 100 * time.Millisecond
		c.Metadata.RefreshFrequency = 5 * time.Second
		c.Producer.Retry.Backoff = 100 * time.Millisecond
		c.Producer.Retry.Max = 5
		c.Producer.Timeout = 5 * time.Second
		c.Producer.Transaction.Timeout = o.txnTimeout
		c.Producer.Transaction.Retry.Backoff = 100 * time.Millisecond
		return nil
	}
	if o.mode != "default" && o.mode != "franz" && o.mode != "strict" {
		log.Error("chaos-relay: -mode must be default, franz or strict", "mode", o.mode)
		return exitSetup
	}
	var pub interface {
		relay.Publisher
		Start(context.Context) error
		Close() error
	}
	switch o.mode {
	case "default":
		pub, err = publisher.NewKafka(publisher.KafkaConfig{Brokers: brokers, Configure: configure, Logger: log, StallTimeout: o.stall})
	case "franz":
		// The sarama settings above, as kgo options.
		pub, err = publisher.NewFranz(publisher.FranzConfig{Brokers: brokers, Logger: log, StallTimeout: o.stall, Options: []kgo.Opt{
			kgo.ClientID("chaos-relay"),
			kgo.DialTimeout(2 * time.Second),
			kgo.RetryBackoffFn(func(int) time.Duration { return 100 * time.Millisecond }),
			kgo.MetadataMinAge(100 * time.Millisecond),
			kgo.MetadataMaxAge(5 * time.Second),
			kgo.ProduceRequestTimeout(5 * time.Second),
			// franz-go's own account of retries, moves and producer id
			// resets, to stderr (the log directory): what a stuck
			// publish is waiting for.
			kgo.WithLogger(kgo.BasicLogger(os.Stderr, kgo.LogLevelInfo, func() string {
				return time.Now().UTC().Format(time.RFC3339Nano) + " kgo "
			})),
		}})
	default:
		pub, err = publisher.NewTransactional(publisher.TransactionalConfig{
			Brokers: brokers, TransactionalIDPrefix: o.txnPrefix, Configure: configure, Logger: log,
			MarkerMaxBytes: o.markerBytes,
		})
	}
	if err != nil {
		log.Error("chaos-relay: publisher", "err", err)
		return exitSetup
	}
	// Start checks that the cluster answers (the default publisher also
	// initialises its idempotent producer id). A relay restarted while a
	// broker is down can fail that check, so retry for a while, as a
	// service supervisor restarting the process would: a failed Start
	// leaves the publisher ready to start again.
	if code, ok := retryStart(log, sig, "start publisher", 500*time.Millisecond, func() error {
		return pub.Start(context.Background())
	}); !ok {
		_ = pub.Close()
		return code
	}
	defer func() {
		start := time.Now()
		if err := pub.Close(); err != nil {
			log.Warn("chaos-relay: close publisher", "err", err)
		}
		log.Info("chaos-relay: publisher closed", "took", time.Since(start).String())
	}()

	// The backoff is compressed about 30 times against the defaults
	// (1 s instead of 30 s at most), so the attempts a message may fail
	// before it is dead-lettered are scaled up as much: a broker outage of
	// a few seconds must not dead-letter messages here when the defaults
	// (10 attempts, up to 30 s apart) would ride it out for minutes.
	if o.source == "wal" {
		return runWAL(o, log, sig, db, dsn, ocfg, pub)
	}
	policy, err := gormrelay.NewFailurePolicy(store, gormrelay.FailurePolicyConfig{MaxAttempts: o.maxAttempts, Logger: log})
	if err != nil {
		log.Error("chaos-relay: failure policy", "err", err)
		return exitSetup
	}
	r, err := relay.New(store, pub, relay.Config{
		FailureHandler:     policy,
		RelayID:            o.relayID,
		BucketCount:        o.buckets,
		BatchSize:          o.batch,
		PollInterval:       o.poll,
		LeaseDuration:      o.lease,
		LeaseRenewInterval: o.renew,
		BackoffMin:         o.backMin,
		BackoffMax:         o.backMax,
		Logger:             log,
	})
	if err != nil {
		log.Error("chaos-relay: relay", "err", err)
		return exitSetup
	}

	if err := r.Start(context.Background()); err != nil {
		log.Error("chaos-relay: start", "err", err)
		return exitSetup
	}
	log.Info("chaos-relay: started", "mode", o.mode)

	select {
	case s := <-sig:
		log.Info("chaos-relay: stopping", "signal", s.String())
		ctx, cancel := context.WithTimeout(context.Background(), o.stopAfter)
		err := r.Stop(ctx)
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			log.Error("chaos-relay: stop", "err", err)
		}
		log.Info("chaos-relay: stopped", "abandoned_batch", err != nil)
		return exitOK
	case <-r.Stopped():
		err := r.Err()
		log.Error("chaos-relay: relay stopped by itself", "err", err, "misconfiguration", relay.IsMisconfiguration(err))
		return exitRelayError
	}
}

// retryStart calls start until it succeeds, every pause, for up to two
// minutes, as a supervisor restarting the process would. It returns false
// with the exit code when it gave up (exitSetup) or a signal came first
// (exitOK).
func retryStart(log *slog.Logger, sig <-chan os.Signal, what string, pause time.Duration, start func() error) (int, bool) {
	deadline := time.Now().Add(2 * time.Minute)
	for attempt := 1; ; attempt++ {
		err := start()
		if err == nil {
			return 0, true
		}
		if time.Now().After(deadline) {
			log.Error("chaos-relay: "+what, "err", err, "attempts", attempt)
			return exitSetup, false
		}
		log.Warn("chaos-relay: "+what+" failed; retrying", "err", err, "attempt", attempt)
		select {
		case s := <-sig:
			log.Info("chaos-relay: stopped before it started", "signal", s.String(), "step", what)
			return exitOK, false
		case <-time.After(pause):
		}
	}
}

// runWAL reads the outbox's logical replication slot with a pgwal.Reader
// until a signal stops it (exit 0) or Run returns by itself (exit 2: a
// lost slot, a misconfiguration).
func runWAL(o options, log *slog.Logger, sig <-chan os.Signal, db *gorm.DB, dsn string, ocfg outbox.Config, pub relay.Publisher) int {
	plugin, err := outbox.NewPlugin(ocfg)
	if err != nil {
		log.Error("chaos-relay: plugin", "err", err)
		return exitSetup
	}
	r, err := pgwal.New(db, plugin, pub, pgwal.Config{
		ReplicationDSN:  dsn,
		RelayID:         o.relayID,
		LeaseDuration:   o.lease,
		StandbyInterval: o.renew,
		BatchSize:       o.batch,
		MaxPending:      o.maxPending,
		MaxAttempts:     o.maxAttempts,
		BackoffMin:      o.backMin,
		BackoffMax:      o.backMax,
		Logger:          log,
	})
	if err != nil {
		log.Error("chaos-relay: wal reader", "err", err)
		return exitSetup
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	log.Info("chaos-relay: started", "mode", o.mode, "source", o.source)
	select {
	case s := <-sig:
		log.Info("chaos-relay: stopping", "signal", s.String())
		cancel()
		<-done
		log.Info("chaos-relay: stopped", "published", r.Stats().Published)
		return exitOK
	case err := <-done:
		var lost *pgwal.SlotLostError
		log.Error("chaos-relay: relay stopped by itself", "err", err, "slot_lost", errors.As(err, &lost), "misconfiguration", relay.IsMisconfiguration(err))
		return exitRelayError
	}
}
