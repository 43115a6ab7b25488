package pgnotify

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/backoff"
	"github.com/gorm-outbox/outbox/internal/startstop"
	"github.com/gorm-outbox/outbox/relay"
)

// Defaults applied by Config.WithDefaults.
const (
	// ApplicationNameDefault is the application_name of the listener
	// connection when neither Config.ApplicationName nor the DSN sets one.
	// The NOTIFY connection gets the same name with PublishSuffix appended.
	ApplicationNameDefault = "gorm-outbox-pgnotify"
	// PublishSuffix is appended to the application name of the
	// transport's own NOTIFY connection, so operators can tell it from the
	// listener in pg_stat_activity.
	PublishSuffix = "-notify"
	// PingIntervalDefault is how long the listener waits for a
	// notification before it checks that its connection is alive.
	PingIntervalDefault = 10 * time.Second
	// TimeoutDefault bounds every database operation: connecting, LISTEN,
	// a ping, a NOTIFY.
	TimeoutDefault = 5 * time.Second
	// ReconnectBackoffMinDefault is the first pause before the listener
	// reconnects after losing its connection.
	ReconnectBackoffMinDefault = 100 * time.Millisecond
	// ReconnectBackoffMaxDefault caps the reconnect pause, which doubles
	// with every consecutive failure.
	ReconnectBackoffMaxDefault = 10 * time.Second
	// ChannelSuffix ends the channel name DefaultChannel derives.
	ChannelSuffix = "_hints"
)

// closeTimeout bounds closing the listener connection, which runs under
// context.WithoutCancel so that a cancelled Listen still says goodbye.
const closeTimeout = time.Second

// Config configures a Transport. DSN is required; every other field has a
// default.
type Config struct {
	// DSN is the connection string of the listener connection, in any form
	// pgx accepts (URL or key=value). Required. LISTEN needs a session of
	// its own for as long as it listens: point DSN at the database directly
	// or at a PgBouncer pool in session mode, never at a pool in
	// transaction or statement mode, where notifications are lost.
	DSN string
	// PublishDSN is the connection string of the connection that sends
	// NOTIFY. NOTIFY is an ordinary statement, so it may go through
	// PgBouncer in transaction mode. Default: DSN. Ignored when PublishDB
	// is set.
	PublishDSN string
	// PublishDB, if set, sends NOTIFY through this pool, for example the
	// application's own (gormDB.DB()), instead of a connection of the
	// transport's own; the transport then costs one connection per process
	// instead of two. It must reach the same database as DSN. Close does
	// not close it. Default nil.
	PublishDB *sql.DB
	// Channel is the notification channel: a lowercase identifier,
	// [a-z_][a-z0-9_]*, at most 63 characters. Every process sharing one
	// outbox table must use the same channel, and different outboxes (or
	// environments sharing a database) different ones. Default:
	// DefaultChannel(Tables).
	Channel string
	// Tables are the outbox's tables; only used to derive the default
	// Channel. Zero fields mean the outbox defaults.
	Tables outbox.Tables
	// ApplicationName is the listener connection's application_name, the
	// name to look for in pg_stat_activity. The NOTIFY connection uses it
	// with PublishSuffix appended. Default: the DSN's application_name,
	// else ApplicationNameDefault.
	ApplicationName string
	// PingInterval is how long the listener waits without a notification
	// before it pings its connection, so a dead connection is noticed and
	// replaced even when nothing is being committed. Default 10s.
	PingInterval time.Duration
	// Timeout bounds each database operation (connect, LISTEN, ping,
	// NOTIFY) on top of the caller's context. Default 5s.
	Timeout time.Duration
	// ReconnectBackoffMin is the first pause before the listener
	// reconnects; it doubles per consecutive failure up to
	// ReconnectBackoffMax, with jitter, and resets once LISTEN succeeds.
	// Default 100ms.
	ReconnectBackoffMin time.Duration
	// ReconnectBackoffMax caps the reconnect pause. Default 10s.
	ReconnectBackoffMax time.Duration
	// Logger receives the transport's logs. Default: slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns a copy of c with every zero field set to its
// default. ApplicationName is resolved by New, which parses the DSN.
func (c Config) WithDefaults() Config {
	if c.Channel == "" {
		c.Channel = DefaultChannel(c.Tables)
	}
	if c.PublishDSN == "" {
		c.PublishDSN = c.DSN
	}
	if c.PingInterval == 0 {
		c.PingInterval = PingIntervalDefault
	}
	if c.Timeout == 0 {
		c.Timeout = TimeoutDefault
	}
	if c.ReconnectBackoffMin == 0 {
		c.ReconnectBackoffMin = ReconnectBackoffMinDefault
	}
	if c.ReconnectBackoffMax == 0 {
		c.ReconnectBackoffMax = max(ReconnectBackoffMaxDefault, c.ReconnectBackoffMin)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

var channelRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// ValidateChannel reports whether name can be a channel: a lowercase
// identifier, [a-z_][a-z0-9_]*, at most 63 characters.
func ValidateChannel(name string) error {
	if !channelRE.MatchString(name) {
		return &relay.ConfigError{Package: "pgnotify", Field: "Channel", Value: fmt.Sprintf("%q", name), Reason: "must match [a-z_][a-z0-9_]* and be at most 63 characters"}
	}
	return nil
}

// validate checks a configuration that WithDefaults has filled in.
func (c Config) validate() error {
	if c.DSN == "" {
		return &relay.ConfigError{Package: "pgnotify", Field: "DSN", Value: `""`, Reason: "the listener's connection string is required"}
	}
	if err := ValidateChannel(c.Channel); err != nil {
		return err
	}
	for _, d := range []struct {
		field string
		v     time.Duration
	}{
		{"PingInterval", c.PingInterval},
		{"Timeout", c.Timeout},
		{"ReconnectBackoffMin", c.ReconnectBackoffMin},
	} {
		if d.v <= 0 {
			return &relay.ConfigError{Package: "pgnotify", Field: d.field, Value: d.v, Reason: "must be positive"}
		}
	}
	if c.ReconnectBackoffMax < c.ReconnectBackoffMin {
		return &relay.ConfigError{Package: "pgnotify", Field: "ReconnectBackoffMax", Value: c.ReconnectBackoffMax, Reason: fmt.Sprintf("must be at least ReconnectBackoffMin (%s)", c.ReconnectBackoffMin)}
	}
	return nil
}

// DefaultChannel derives a channel from an outbox's tables: the schema
// (if any), two underscores and the messages table, lowercased, followed by
// ChannelSuffix, e.g. "outbox_messages_hints" or
// "billing__outbox_messages_hints". A name longer than 63 characters is
// cut and ends in a hash of the full name. Outboxes that differ only by
// search_path (same table name, no Tables.Schema) get the same channel:
// give them distinct Config.Channel values.
func DefaultChannel(t outbox.Tables) string {
	table := t.Messages
	if table == "" {
		table = outbox.MessagesTableDefault
	}
	name := strings.ToLower(table)
	if t.Schema != "" {
		name = strings.ToLower(t.Schema) + "__" + name
	}
	name += ChannelSuffix
	if len(name) <= 63 {
		return name
	}
	var h uint32 = 2166136261 // FNV-1a
	for i := 0; i < len(name); i++ {
		h ^= uint32(name[i])
		h *= 16777619
	}
	return fmt.Sprintf("%s_%08x", name[:63-9], h)
}

// Transport is an outbox.Transport over PostgreSQL LISTEN/NOTIFY. Publish
// sends one NOTIFY per call; Listen holds one dedicated connection that
// LISTENs on the channel, reconnecting with backoff when it is lost.
//
// Each Transport has a random sender id that it writes into its payloads;
// Listen skips notifications carrying its own id. Use one Transport per
// HintBridge.
type Transport struct {
	cfg       Config
	channel   string
	sender    string
	listenCfg *pgx.ConnConfig
	pool      *pgxpool.Pool // nil when cfg.PublishDB is set
	log       *slog.Logger
	life      startstop.Service
	closeOnce sync.Once

	published, publishFailures, received, echoes, malformed, subscriptions atomic.Uint64
}

var _ outbox.Transport = (*Transport)(nil)

// Stats counts what a Transport did since New.
type Stats struct {
	// Published counts NOTIFYs sent, PublishFailures those that failed.
	Published, PublishFailures uint64
	// Received counts notifications from other senders that Listen decoded
	// and delivered.
	Received uint64
	// EchoesDropped counts this transport's own notifications that Listen
	// skipped.
	EchoesDropped uint64
	// Malformed counts notifications Listen could not parse; each was
	// delivered as outbox.UnknownBucket.
	Malformed uint64
	// Subscriptions counts LISTEN sessions established: 1 per Listen call,
	// plus one per reconnection.
	Subscriptions uint64
}

// New validates cfg and returns a transport. It opens no connection: the
// listener connects when Listen is called, the NOTIFY connection on the
// first Publish. Call Close when done.
func New(cfg Config) (*Transport, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	listenCfg, err := pgx.ParseConfig(cfg.DSN)
	if err != nil {
		return nil, &relay.ConfigError{Package: "pgnotify", Field: "DSN", Value: "(not shown)", Reason: err.Error()}
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = listenCfg.RuntimeParams["application_name"]
	}
	if cfg.ApplicationName == "" {
		cfg.ApplicationName = ApplicationNameDefault
	}
	listenCfg.RuntimeParams["application_name"] = cfg.ApplicationName

	var id [senderLen / 2]byte
	_, _ = rand.Read(id[:])
	t := &Transport{
		cfg:       cfg,
		channel:   cfg.Channel,
		sender:    hex.EncodeToString(id[:]),
		listenCfg: listenCfg,
		log:       cfg.Logger.With("channel", cfg.Channel),
	}
	if cfg.PublishDB == nil {
		poolCfg, err := pgxpool.ParseConfig(cfg.PublishDSN)
		if err != nil {
			return nil, &relay.ConfigError{Package: "pgnotify", Field: "PublishDSN", Value: "(not shown)", Reason: err.Error()}
		}
		// One sender goroutine per bridge: one connection is enough.
		poolCfg.MaxConns = 1
		poolCfg.MinConns = 0
		poolCfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName + PublishSuffix
		// NewWithConfig does not connect: MinConns is 0.
		if t.pool, err = pgxpool.NewWithConfig(context.Background(), poolCfg); err != nil {
			return nil, fmt.Errorf("pgnotify: publish pool: %w", err)
		}
	}
	return t, nil
}

// Channel returns the notification channel.
func (t *Transport) Channel() string { return t.channel }

// ApplicationName returns the listener connection's application_name.
func (t *Transport) ApplicationName() string { return t.cfg.ApplicationName }

// Start marks the transport running until Stop or the end of ctx, when it
// closes its own NOTIFY connection. It opens nothing itself: the hint
// bridge drives Listen and Publish. It gives the transport the lifecycle
// of the module's other services (New starts nothing; Start, Stop,
// Stopped, Err); Start on a running transport does nothing.
func (t *Transport) Start(ctx context.Context) error {
	if err := t.life.Start(ctx, func(ctx context.Context) error {
		<-ctx.Done()
		t.Close()
		return nil
	}); err != nil {
		return fmt.Errorf("pgnotify: start: %w", err)
	}
	return nil
}

// Stop closes the transport's own NOTIFY connection and, if it was
// started, waits until it has stopped, bounded by ctx. Stop before Start
// and a second Stop are harmless. Like Close, it does not stop a running
// Listen (cancel its context; the hint bridge does) and does not close
// Config.PublishDB.
func (t *Transport) Stop(ctx context.Context) error {
	t.Close()
	if err := t.life.Stop(ctx); err != nil {
		return fmt.Errorf("pgnotify: stop: %w", err)
	}
	return nil
}

// Stopped returns a channel closed when a started transport has stopped.
func (t *Transport) Stopped() <-chan struct{} { return t.life.Stopped() }

// Err is nil: the transport has no failure that ends it (Listen and
// Publish report theirs to the bridge, which retries).
func (t *Transport) Err() error { return t.life.Err() }

// Close closes the transport's own NOTIFY connection, once. It does not
// stop a running Listen (cancel its context) and does not close
// Config.PublishDB. Publish fails after Close.
func (t *Transport) Close() {
	t.closeOnce.Do(func() {
		if t.pool != nil {
			t.pool.Close()
		}
	})
}

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	return Stats{
		Published:       t.published.Load(),
		PublishFailures: t.publishFailures.Load(),
		Received:        t.received.Load(),
		EchoesDropped:   t.echoes.Load(),
		Malformed:       t.malformed.Load(),
		Subscriptions:   t.subscriptions.Load(),
	}
}

// Publish sends buckets as one NOTIFY on the channel, with
// pg_notify(channel, payload), in a transaction of its own that commits
// asynchronously (synchronous_commit off for that transaction only). Ids
// outside 0..outbox.BucketCountMax-1 are sent as outbox.UnknownBucket. An
// empty list sends nothing. Publish does not keep buckets.
func (t *Transport) Publish(ctx context.Context, buckets []int) error {
	if len(buckets) == 0 {
		return nil
	}
	payload := encodePayload(t.sender, buckets)
	if len(payload) > MaxPayloadBytes { // cannot happen with BucketCountMax 4096
		payload = encodePayload(t.sender, []int{outbox.UnknownBucket})
	}
	err := withTimeout(ctx, t.cfg.Timeout, "notify", func(ctx context.Context) error {
		// The NOTIFY's own transaction commits without waiting for its
		// WAL flush: a hint lost in a crash costs a poll (listeners
		// rediscover after reconnecting), and the setting is local to
		// this one-statement transaction, so the pool's sessions and
		// the business commits keep theirs.
		const q = "SELECT set_config('synchronous_commit', 'off', true), pg_notify($1, $2)"
		if t.cfg.PublishDB != nil {
			_, err := t.cfg.PublishDB.ExecContext(ctx, q, t.channel, payload)
			return err
		}
		// QueryExecModeExec: no named prepared statement, so the NOTIFY
		// connection may go through PgBouncer in transaction mode.
		_, err := t.pool.Exec(ctx, q, pgx.QueryExecModeExec, t.channel, payload)
		return err
	})
	if err != nil {
		t.publishFailures.Add(1)
		return err
	}
	t.published.Add(1)
	return nil
}

// Listen LISTENs on the channel on a dedicated connection and calls fn for
// every bucket id other transports publish, until ctx is done; it then
// returns ctx's error. It calls fn from its own goroutine, one call at a
// time, and returns only after the last call returned; a slow fn delays
// the notifications behind it (PostgreSQL queues them for the session).
//
// Each time LISTEN succeeds, at the first connection and after every
// reconnection, Listen calls fn(outbox.UnknownBucket): hints sent while it
// was not listening are lost, and this makes the relay look for their
// messages at once. A lost connection (an error, or a failed ping after
// PingInterval without notifications) is closed and replaced after a
// backoff. Notifications this transport published itself are skipped;
// ones it cannot parse are delivered as outbox.UnknownBucket.
//
// Listen may run more than once at a time; each call uses a connection of
// its own.
func (t *Transport) Listen(ctx context.Context, fn func(bucket int)) error {
	if fn == nil {
		return errors.New("pgnotify: Listen: nil callback")
	}
	t.log.Debug("pgnotify: listener started")
	defer t.log.Debug("pgnotify: listener stopped")
	failures, sessions := 0, 0
	for {
		err := t.session(ctx, fn, func() {
			if sessions++; sessions > 1 {
				t.log.Info("pgnotify: listener reconnected", "attempts", failures)
			}
			failures = 0
		})
		if ctx.Err() != nil {
			return ctx.Err()
		}
		failures++
		d := backoff.Exponential(t.cfg.ReconnectBackoffMin, t.cfg.ReconnectBackoffMax, failures)
		t.log.Warn("pgnotify: listener connection lost, reconnecting", "err", err, "attempt", failures, "retry_in", d)
		timer := time.NewTimer(d)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		}
	}
}

// session runs one listener connection: connect, LISTEN, deliver until an
// error or ctx ends. listening is called once LISTEN succeeded.
func (t *Transport) session(ctx context.Context, fn func(int), listening func()) error {
	var conn *pgx.Conn
	err := withTimeout(ctx, t.cfg.Timeout, "connect listener", func(ctx context.Context) error {
		var err error
		conn, err = pgx.ConnectConfig(ctx, t.listenCfg)
		return err
	})
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	err = withTimeout(ctx, t.cfg.Timeout, "listen", func(ctx context.Context) error {
		_, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{t.channel}.Sanitize(), pgx.QueryExecModeSimpleProtocol)
		return err
	})
	if err != nil {
		return err
	}
	t.subscriptions.Add(1)
	listening()
	t.log.Debug("pgnotify: listening", "pid", conn.PgConn().PID())
	fn(outbox.UnknownBucket)

	for {
		wctx, cancel := context.WithTimeout(ctx, t.cfg.PingInterval)
		n, err := conn.WaitForNotification(wctx)
		idle := errors.Is(wctx.Err(), context.DeadlineExceeded)
		cancel()
		if n != nil {
			t.deliver(n.Payload, fn)
		}
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !idle || conn.IsClosed() {
			return fmt.Errorf("pgnotify: wait for notification: %w", err)
		}
		// Nothing arrived for PingInterval: make sure the connection is
		// still there, so a silently dropped one is replaced.
		if err := withTimeout(ctx, t.cfg.Timeout, "ping listener", conn.Ping); err != nil {
			return err
		}
	}
}

// deliver decodes one notification and calls fn per bucket, skipping our
// own echoes. The counters move before fn is called.
func (t *Transport) deliver(payload string, fn func(int)) {
	sender, body, ok := splitPayload(payload)
	if ok && sender == t.sender {
		t.echoes.Add(1)
		return
	}
	if !ok || !validBody(body) {
		t.malformed.Add(1)
		t.log.Debug("pgnotify: malformed notification, treated as unknown bucket", "bytes", len(payload))
		fn(outbox.UnknownBucket)
		return
	}
	t.received.Add(1)
	eachBucket(body, fn)
}

// withTimeout runs fn under a timeout and names the operation in its
// error.
func withTimeout(ctx context.Context, d time.Duration, op string, fn func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if err := fn(ctx); err != nil {
		return fmt.Errorf("pgnotify: %s: %w", op, err)
	}
	return nil
}
