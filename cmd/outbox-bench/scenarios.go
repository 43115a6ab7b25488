package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kgo"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/gormrelay"
	"github.com/gorm-outbox/outbox/pgnotify"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// benchTopic is the topic the scenarios publish to; on a real cluster it
// gets a suffix unique to the run (useExternalBrokers).
var benchTopic = "bench"

// env is one scenario run's database with the outbox on it.
type env struct {
	cfg    config
	dbx    *database
	db     *gorm.DB
	plugin *outbox.Plugin
	// tl, if set, times the steps of the relays startRelay starts.
	tl *timeline
	// observer, if set, is the Observer of the relays startRelay starts.
	observer relay.Observer
}

func newEnv(ctx context.Context, cfg config, rules ...outbox.Rule) (*env, error) {
	dbx, err := newDatabase(cfg.Driver, cfg.DSN, cfg.TmpDir)
	if err != nil {
		return nil, err
	}
	db, err := openGorm(cfg.Driver, dbx.dsn, cfg.MaxIdleConns)
	if err != nil {
		dbx.drop()
		return nil, err
	}
	oc := outbox.Config{BucketCount: cfg.Buckets, Rules: rules, Logger: quiet}
	if cfg.walMode {
		oc.Mode = outbox.ModeWAL
	}
	p, err := outbox.NewPlugin(oc)
	if err == nil {
		err = db.Use(p)
	}
	if err == nil {
		err = p.AutoMigrate(ctx, db)
	}
	if err != nil {
		closeGorm(db)
		dbx.drop()
		return nil, err
	}
	return &env{cfg: cfg, dbx: dbx, db: db, plugin: p}, nil
}

func (e *env) close() {
	closeGorm(e.db)
	e.dbx.drop()
}

func (e *env) table() string { return e.db.Statement.Quote(e.plugin.Config().Tables.MessagesTable()) }

// prefill enqueues n messages over cfg.Keys keys with cfg.ValueSize-byte
// values, in transactions of 5000.
func (e *env) prefill(ctx context.Context, n int) error {
	for done := 0; done < n; done += prefillChunk {
		err := e.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return e.enqueueN(tx, done, min(prefillChunk, n-done)) })
		if err != nil {
			return fmt.Errorf("prefill: %w", err)
		}
	}
	return e.analyze(ctx)
}

// prefillChunk is how many messages one Enqueue call of prefill writes.
const prefillChunk = 5000

// enqueueN enqueues in tx the messages from..from+n of prefill's sequence.
func (e *env) enqueueN(tx *gorm.DB, from, n int) error {
	value := make([]byte, e.cfg.ValueSize)
	for i := range value {
		value[i] = byte('a' + i%26)
	}
	msgs := make([]*outbox.Message, n)
	for i := range msgs {
		msgs[i] = &outbox.Message{Topic: benchTopic, Key: []byte("key-" + strconv.Itoa((from+i)%e.cfg.Keys)), Value: value}
	}
	return e.plugin.Enqueue(tx, msgs...)
}

// prefillAtOnce enqueues prefill's n messages in one transaction and
// returns when its commit began: running relays see the whole backlog
// at once.
func (e *env) prefillAtOnce(ctx context.Context, n int) (time.Time, error) {
	tx := e.db.WithContext(ctx).Begin()
	if tx.Error != nil {
		return time.Time{}, tx.Error
	}
	for done := 0; done < n; done += prefillChunk {
		if err := e.enqueueN(tx, done, min(prefillChunk, n-done)); err != nil {
			tx.Rollback()
			return time.Time{}, fmt.Errorf("prefill: %w", err)
		}
	}
	start := time.Now()
	if err := tx.Commit().Error; err != nil {
		return time.Time{}, fmt.Errorf("prefill: commit: %w", err)
	}
	return start, nil
}

// analyze gathers the messages table's statistics.
func (e *env) analyze(ctx context.Context) error {
	// Gather the table's statistics, as autovacuum would on a table in
	// use: on a table never analyzed PostgreSQL's first plans guess a
	// bucket's size and read whole buckets, which measures the planner's
	// cold start rather than the drain.
	analyze := "ANALYZE " + e.table()
	if e.cfg.Driver == "mysql" {
		analyze = "ANALYZE TABLE " + e.table()
	}
	if err := e.db.WithContext(ctx).Exec(analyze).Error; err != nil {
		return fmt.Errorf("prefill: analyze: %w", err)
	}
	return nil
}

// waitEmpty polls until the messages table is empty.
func (e *env) waitEmpty(ctx context.Context, timeout time.Duration) error {
	// Through the (bucket, id) index, which learns to skip the entries of
	// deleted rows; a table scan would step over every row deleted so far.
	q := "SELECT id FROM " + e.table() + " ORDER BY bucket, id LIMIT 1"
	err := poll(ctx, timeout, 5*time.Millisecond, func() (bool, error) {
		var ids []int64
		err := e.db.WithContext(ctx).Raw(q).Scan(&ids).Error
		return len(ids) == 0, err
	})
	if errors.Is(err, errPollTimeout) {
		var n int64
		e.db.Raw("SELECT COUNT(*) FROM " + e.table()).Scan(&n)
		return fmt.Errorf("%d messages still pending after %s", n, timeout)
	}
	return err
}

// errPollTimeout is poll's error when its timeout passed first.
var errPollTimeout = errors.New("timed out")

// poll calls done every interval until it reports true or an error, ctx
// ends, or timeout passes (errPollTimeout).
func poll(ctx context.Context, timeout, every time.Duration, done func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := done()
		if ok || err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return errPollTimeout
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(every):
		}
	}
}

// kafkaProducers is the publishers' KafkaConfig.Producers (-producers; 0:
// the default).
var kafkaProducers int

// kafkaFlushFrequency is the publishers' sarama Producer.Flush.Frequency
// (-flush-frequency; 0: sarama's default, a request as soon as the
// connection is free).
var kafkaFlushFrequency time.Duration

// kafkaLingerBatch is the publishers' KafkaConfig.LingerBatch
// (-linger-batch; 0: the default, negative: no routing by size).
var kafkaLingerBatch int

// The -publisher choices.
const (
	publisherSarama = "sarama"
	publisherFranz  = "franz"
)

// kafkaPublisher is the relays' publisher (-publisher): publisherSarama
// (also when empty) or publisherFranz.
var kafkaPublisher string

// publishersStarted counts the publishers newPublisher started, by kind.
var publishersStarted = map[string]*atomic.Int64{publisherSarama: new(atomic.Int64), publisherFranz: new(atomic.Int64)}

// benchPublisher is a started Kafka publisher of either kind.
type benchPublisher interface {
	relay.Publisher
	Close() error
}

// newPublisher builds and starts the Kafka publisher -publisher names;
// ctx's end closes it. franzOpts are added to the Franz publisher's
// options.
func newPublisher(ctx context.Context, brokers []string, franzOpts ...kgo.Opt) (benchPublisher, error) {
	var (
		p interface {
			benchPublisher
			Start(context.Context) error
		}
		err  error
		kind = publisherSarama
	)
	if kafkaPublisher == publisherFranz {
		kind = publisherFranz
		p, err = publisher.NewFranz(publisher.FranzConfig{Brokers: brokers, Logger: warnings, Options: append([]kgo.Opt{kgo.ClientID("outbox-bench")}, franzOpts...)})
	} else {
		p, err = publisher.NewKafka(publisher.KafkaConfig{Brokers: brokers, Logger: quiet, Producers: kafkaProducers, LingerBatch: kafkaLingerBatch, Configure: func(c *sarama.Config) error {
			c.ClientID = "outbox-bench"
			c.Producer.Flush.Frequency = kafkaFlushFrequency
			return nil
		}})
	}
	if err != nil {
		return nil, err
	}
	if err := p.Start(ctx); err != nil {
		_ = p.Close()
		return nil, err
	}
	publishersStarted[kind].Add(1)
	return p, nil
}

// startRelay starts a relay on the env's outbox, with the plugin's local
// hints if hints is set and poll as its PollInterval (0: the default).
func (e *env) startRelay(ctx context.Context, pub relay.Publisher, hints bool, poll time.Duration) (*relay.Relay, error) {
	store, err := gormrelay.NewStore(e.db, e.plugin.Config())
	if err != nil {
		return nil, err
	}
	rc := relay.Config{BatchSize: e.cfg.BatchSize, Parallelism: e.cfg.Parallelism, PipelineDepth: e.cfg.PipelineDepth, PollInterval: poll, Logger: quiet, Observer: e.observer}
	if hints {
		rc.Hints = e.plugin.Notifier()
	}
	var st relay.Store = store
	if e.tl != nil {
		st, pub = timedStore{store, e.tl}, timed(pub, e.tl)
	}
	r, err := relay.New(st, pub, rc)
	if err != nil {
		return nil, err
	}
	return r, r.Start(ctx)
}

func stopRelay(r *relay.Relay) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = r.Stop(ctx)
}

// relayDrain prefills n messages and times one relay draining them
// through the default Kafka publisher.
func relayDrain(ctx context.Context, cfg config, brokers []string, n int, rss bool) (rate float64, peakRSS int64, err error) {
	return drainWith(ctx, cfg, n, rss, func() (relay.Publisher, func(), error) {
		p, err := newPublisher(ctx, brokers)
		if err != nil {
			return nil, nil, err
		}
		return p, func() { p.Close() }, nil
	})
}

// drainWith prefills n messages and times one relay draining them through
// the publisher newPub builds; with rss it also returns the peak resident
// set size of the drain.
func drainWith(ctx context.Context, cfg config, n int, rss bool, newPub func() (relay.Publisher, func(), error)) (rate float64, peakRSS int64, err error) {
	d, err := drainTimed(ctx, cfg, n, rss, newPub)
	return d.rate, d.peakRSS, err
}

// drain is what drainTimed measured.
type drain struct {
	// rate is n over the time from the relay's start (leases, producers)
	// to the table found empty.
	rate float64
	// streaming is the messages acknowledged after the first
	// acknowledgement over the time from it to the last: the steady rate,
	// without the relay's start.
	streaming float64
	peakRSS   int64
}

// drainTimed is drainWith, also timing the drain from its first
// acknowledgement.
func drainTimed(ctx context.Context, cfg config, n int, rss bool, newPub func() (relay.Publisher, func(), error)) (d drain, err error) {
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return d, err
	}
	defer e.close()
	if err := e.prefill(ctx, n); err != nil {
		return d, err
	}
	pub, closePub, err := newPub()
	if err != nil {
		return d, err
	}
	defer closePub()
	if rss {
		runtime.GC()
		debug.FreeOSMemory()
		resetPeakRSS()
	}
	// The drain ends when the relay has acknowledged n messages (then the
	// table is checked empty): polling the table all along would compete
	// with the relay for the database, each probe stepping over the rows
	// deleted so far.
	acks := newAckCounter(n)
	e.observer = acks
	if cfg.profile != "" {
		stop, err := startCPUProfile(cfg.profile)
		if err != nil {
			return d, err
		}
		defer stop()
	}
	start := time.Now()
	r, err := e.startRelay(ctx, pub, true, 0)
	if err != nil {
		return d, err
	}
	select {
	case <-acks.done:
	case <-time.After(10 * time.Minute):
	case <-ctx.Done():
	}
	err = e.waitEmpty(ctx, 10*time.Minute)
	elapsed := time.Since(start)
	if rss {
		d.peakRSS = readPeakRSS()
	}
	stopRelay(r)
	if err != nil {
		return d, err
	}
	d.rate = float64(n) / elapsed.Seconds()
	if first, last, firstN := acks.span(); last.After(first) {
		d.streaming = float64(int64(n)-firstN) / last.Sub(first).Seconds()
	}
	return d, nil
}

// ackCounter is a relay Observer that closes done once the relay has
// acknowledged n messages.
type ackCounter struct {
	relay.NopObserver
	n    int64
	got  atomic.Int64
	once sync.Once
	done chan struct{}

	mu          sync.Mutex
	first, last time.Time
	firstAcked  int64
}

func newAckCounter(n int) *ackCounter {
	return &ackCounter{n: int64(n), done: make(chan struct{})}
}

func (a *ackCounter) Published(ev relay.PublishEvent) {
	if ev.Acked > 0 {
		now := time.Now()
		a.mu.Lock()
		if a.first.IsZero() {
			a.first, a.firstAcked = now, int64(ev.Acked)
		}
		if now.After(a.last) {
			a.last = now
		}
		a.mu.Unlock()
	}
	if a.got.Add(int64(ev.Acked)) >= a.n {
		a.once.Do(func() { close(a.done) })
	}
}

// span returns when the first and the last acknowledgement arrived and
// how many messages the first acknowledged.
func (a *ackCounter) span() (first, last time.Time, firstAcked int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.first, a.last, a.firstAcked
}

// dbCeiling prefills n messages and drains them with plain SQL: the
// oldest rows of each bucket in batches, deleted by id, with the store's
// statement shapes. No Kafka, no leases: the database's own limit for
// this access pattern.
func dbCeiling(ctx context.Context, cfg config, n int) (float64, error) {
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer e.close()
	if err := e.prefill(ctx, n); err != nil {
		return 0, err
	}
	sqlDB, err := e.db.DB()
	if err != nil {
		return 0, err
	}
	ph := func(i int) string {
		if cfg.Driver == "postgres" {
			return "$" + strconv.Itoa(i)
		}
		return "?"
	}
	// The statements have the store's shapes (gormrelay.Store.NextBatch and
	// MarkPublished): one bucket in id order through the (bucket, id)
	// index, the limit a parameter as well; the deletes as ceilingDelete
	// makes them. With the limit in the text PostgreSQL's generic plan
	// for the prepared read estimates 500 rows in a bucket (its default
	// for a range of parameters) and, for a limit above that, reads the
	// whole bucket and sorts it: 6.3 ms against 0.6 ms for 2,000 of a
	// 12,500-row bucket (EXPLAIN ANALYZE EXECUTE after six executions).
	// With the limit a parameter it keeps walking the index.
	sel := "SELECT id, message_id, topic, msg_key, msg_value, headers, msg_partition, created_at_ms FROM " + e.table() +
		" WHERE bucket >= " + ph(1) + " AND bucket <= " + ph(2) + " ORDER BY bucket, id LIMIT " + ph(3)
	start := time.Now()
	deleted := 0
	for deleted < n {
		progress := false
		for b := 0; b < cfg.Buckets; b++ {
			rows, err := sqlDB.QueryContext(ctx, sel, b, b, cfg.BatchSize)
			if err != nil {
				return 0, err
			}
			var ids []any
			for rows.Next() {
				var (
					id            int64
					mid, topic    string
					key, val, hdr []byte
					part          sql.NullInt32
					created       int64
				)
				if err := rows.Scan(&id, &mid, &topic, &key, &val, &hdr, &part, &created); err != nil {
					rows.Close()
					return 0, err
				}
				ids = append(ids, id)
			}
			rows.Close()
			if len(ids) == 0 {
				continue
			}
			if err := ceilingDelete(ctx, sqlDB, cfg.Driver, e.table(), b, ids); err != nil {
				return 0, err
			}
			deleted += len(ids)
			progress = true
		}
		if !progress {
			return 0, fmt.Errorf("db ceiling: %d of %d rows found", deleted, n)
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// Deletes of the database ceiling take the ids in the shapes of the
// GORM store's MarkPublished (gormrelay/store.go), without its lease
// guard: at most ceilingChunk ids per statement, and on PostgreSQL from
// ceilingLiteralMin ids on a literal array within the (bucket, id) bounds
// of the ids, below it one array parameter; so a ceiling measured at
// another batch size moves as the store's statements do.
const (
	ceilingChunk      = 1000 // gormrelay's storeChunk
	ceilingLiteralMin = 128  // gormrelay's literalIDsMin
)

// ceilingDelete deletes ids, all of bucket, as the store does.
func ceilingDelete(ctx context.Context, db *sql.DB, driver, table string, bucket int, ids []any) error {
	for chunk := range slices.Chunk(ids, ceilingChunk) {
		var (
			q    string
			args []any
		)
		switch {
		case driver == "postgres" && len(chunk) < ceilingLiteralMin:
			list := make([]string, len(chunk))
			for i, id := range chunk {
				list[i] = strconv.FormatInt(id.(int64), 10)
			}
			q = "DELETE FROM " + table + " WHERE bucket = $1 AND id = ANY(CAST($2 AS bigint[]))"
			args = []any{bucket, "{" + strings.Join(list, ",") + "}"}
		case driver == "postgres":
			list := make([]string, len(chunk))
			lo, hi := chunk[0].(int64), chunk[0].(int64)
			for i, id := range chunk {
				v := id.(int64)
				list[i] = strconv.FormatInt(v, 10)
				lo, hi = min(lo, v), max(hi, v)
			}
			q = "DELETE FROM " + table + " WHERE bucket = $1 AND (bucket, id) >= ($2, $3) AND (bucket, id) <= ($4, $5) AND id + 0 = ANY('{" +
				strings.Join(list, ",") + "}'::bigint[])"
			args = []any{bucket, bucket, lo, bucket, hi}
		default:
			q = "DELETE FROM " + table + " WHERE bucket = ? AND id IN (?" + strings.Repeat(",?", len(chunk)-1) + ")"
			args = append([]any{bucket}, chunk...)
		}
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			return err
		}
	}
	return nil
}

// kafkaCeiling produces n messages like the relay's with a bare sarama
// producer under the same guarantees (idempotent, acks=all, one request
// in flight): Kafka's own limit, no database.
func kafkaCeiling(ctx context.Context, cfg config, brokers []string, n int) (float64, error) {
	sc := sarama.NewConfig()
	sc.ClientID = "outbox-bench-ceiling"
	sc.Version = sarama.V2_1_0_0
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Return.Successes = true
	sc.Producer.Partitioner = sarama.NewMurmur2Partitioner
	p, err := sarama.NewAsyncProducer(brokers, sc)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	value := make([]byte, cfg.ValueSize)
	keys := make([][]byte, cfg.Keys)
	for i := range keys {
		keys[i] = []byte("key-" + strconv.Itoa(i))
	}
	id := []byte("0190c3b2-0000-7000-8000-000000000000")
	var failed atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for got := 0; got < n; got++ {
			select {
			case <-p.Successes():
			case <-p.Errors():
				failed.Add(1)
			}
		}
	}()
	start := time.Now()
	for i := 0; i < n; i++ {
		p.Input() <- &sarama.ProducerMessage{Topic: benchTopic, Key: sarama.ByteEncoder(keys[i%len(keys)]), Value: sarama.ByteEncoder(value),
			Headers: []sarama.RecordHeader{{Key: []byte("x-outbox-message-id"), Value: id}}}
	}
	select {
	case <-done:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	if f := failed.Load(); f > 0 {
		return 0, fmt.Errorf("kafka ceiling: %d of %d failed", f, n)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

func drainScenario(ctx context.Context, cfg config, r *result) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, true)
	if err != nil {
		return err
	}
	defer broker.stop()
	r.Params["messages"], r.Params["keys"], r.Params["value_bytes"] = cfg.N, cfg.Keys, cfg.ValueSize
	r.Params["buckets"], r.Params["partitions"], r.Params["batch"] = cfg.Buckets, cfg.Partitions, cfg.BatchSize
	r.Params["parallelism"] = cfg.Parallelism
	r.Params["pipeline_depth"] = cfg.PipelineDepth
	r.Params["max_idle_conns"] = cfg.MaxIdleConns
	r.Params["wide_buckets"] = cfg.WideBuckets
	dbRate, err := dbCeiling(ctx, cfg, cfg.N)
	if err != nil {
		return err
	}
	kRate, err := kafkaCeiling(ctx, cfg, brokers, cfg.N)
	if err != nil {
		return err
	}
	profiled := cfg
	profiled.profile = cfg.CPUProfile
	relayRate, _, err := relayDrain(ctx, profiled, brokers, cfg.N, false)
	if err != nil {
		return err
	}
	// The same drain one bucket after another (Parallelism 1): the
	// engine's serial baseline, measured in the same run.
	serialCfg := cfg
	serialCfg.Parallelism = 1
	serialRate, _, err := relayDrain(ctx, serialCfg, brokers, cfg.N, false)
	if err != nil {
		return fmt.Errorf("parallelism 1: %w", err)
	}
	// The same drain over many more buckets.
	wideCfg := cfg
	wideCfg.Buckets = cfg.WideBuckets
	wideRate, _, err := relayDrain(ctx, wideCfg, brokers, cfg.N, false)
	if err != nil {
		return fmt.Errorf("%d buckets: %w", cfg.WideBuckets, err)
	}
	// The database's own limit over as many buckets: a bucket's rows are
	// then spread over more pages, which no relay can do anything about.
	wideDB, err := dbCeiling(ctx, wideCfg, cfg.N)
	if err != nil {
		return fmt.Errorf("%d buckets db ceiling: %w", cfg.WideBuckets, err)
	}
	// The serial limit: a relay doing the database's work and Kafka's work
	// back to back on the shared CPU, with no waiting.
	serialLimit := 1 / (1/dbRate + 1/kRate)
	r.add("relay", relayRate, "msg/s")
	r.add("db_ceiling", dbRate, "msg/s")
	r.add("kafka_ceiling", kRate, "msg/s")
	r.add("serial_limit", serialLimit, "msg/s")
	r.add("relay/serial_limit", relayRate/serialLimit, "ratio")
	r.add("relay/db_ceiling", relayRate/dbRate, "ratio")
	r.add("relay/kafka_ceiling", relayRate/kRate, "ratio")
	r.add("relay_parallelism_1", serialRate, "msg/s")
	r.add("relay/relay_parallelism_1", relayRate/serialRate, "ratio")
	r.add(fmt.Sprintf("relay_%d_buckets", cfg.WideBuckets), wideRate, "msg/s")
	r.add(fmt.Sprintf("relay_%d_buckets/relay", cfg.WideBuckets), wideRate/relayRate, "ratio")
	r.add(fmt.Sprintf("db_ceiling_%d_buckets", cfg.WideBuckets), wideDB, "msg/s")
	r.add(fmt.Sprintf("relay_%d_buckets/db_ceiling_%d_buckets", cfg.WideBuckets, cfg.WideBuckets), wideRate/wideDB, "ratio")
	return nil
}

func growthScenario(ctx context.Context, cfg config, r *result) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, true)
	if err != nil {
		return err
	}
	defer broker.stop()
	r.Params["backlogs"] = cfg.Growth
	var first, last float64
	for i, n := range cfg.Growth {
		largest := i == len(cfg.Growth)-1
		rate, rss, err := relayDrain(ctx, cfg, brokers, n, largest)
		if err != nil {
			return fmt.Errorf("backlog %d: %w", n, err)
		}
		r.add(fmt.Sprintf("relay@%d", n), rate, "msg/s")
		if i == 0 {
			first = rate
		}
		last = rate
		if largest && rss > 0 {
			r.add(fmt.Sprintf("peak_rss@%d", n), float64(rss)/(1<<20), "MiB")
		}
	}
	if len(cfg.Growth) > 1 {
		r.add("cost_per_msg_largest/smallest", first/last, "ratio")
	}
	return nil
}

// resetPeakRSS clears the kernel's peak-RSS mark of this process.
func resetPeakRSS() { _ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) }

// readPeakRSS returns VmHWM, the peak resident set size, in bytes.
func readPeakRSS() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// BenchOrder is the business row of the write scenario.
type BenchOrder struct {
	ID     uint64 `gorm:"primaryKey"`
	Status string `gorm:"size:32"`
	Total  int64
}

// byConditionRows is how many rows each by-condition update of the write
// scenario changes.
const byConditionRows = 100

func writeScenario(ctx context.Context, cfg config, r *result) error {
	rule := outbox.On(outbox.Insert|outbox.Update, func(c outbox.Change[*BenchOrder]) (*outbox.Message, error) {
		return &outbox.Message{Topic: benchTopic, Key: []byte(strconv.FormatUint(c.Entity.ID, 10)), Value: make([]byte, cfg.ValueSize)}, nil
	})
	e, err := newEnv(ctx, cfg, rule)
	if err != nil {
		return err
	}
	defer e.close()
	plain, err := openGorm(cfg.Driver, e.dbx.dsn, cfg.MaxIdleConns)
	if err != nil {
		return err
	}
	defer closeGorm(plain)
	if err := plain.AutoMigrate(&BenchOrder{}); err != nil {
		return err
	}
	r.Params["transactions_per_side"] = cfg.WriteOps
	const rounds = 10
	per := max(cfg.WriteOps/rounds, 1)
	var with, without time.Duration
	for round := 0; round < rounds; round++ {
		for _, side := range []struct {
			db  *gorm.DB
			acc *time.Duration
		}{{plain, &without}, {e.db, &with}} {
			start := time.Now()
			for i := 0; i < per; i++ {
				if err := side.db.WithContext(ctx).Create(&BenchOrder{Status: "new", Total: int64(i)}).Error; err != nil {
					return err
				}
			}
			*side.acc += time.Since(start)
		}
	}
	n := float64(per * rounds)
	r.add("with_outbox", n/with.Seconds(), "tx/s")
	r.add("without_plugin", n/without.Seconds(), "tx/s")
	r.add("overhead", with.Seconds()/without.Seconds(), "ratio")
	updates, err := byConditionUpdates(ctx, e.db, plain, rounds, max(per/10, 1), r)
	if err != nil {
		return err
	}
	var msgs int64
	e.db.Raw("SELECT COUNT(*) FROM " + e.table()).Scan(&msgs)
	if want := int64(per*rounds + updates*byConditionRows); msgs != want {
		return fmt.Errorf("write: %d messages where %d inserts and %d updates of %d rows each publish %d", msgs, per*rounds, updates, byConditionRows, want)
	}
	return nil
}

// byConditionUpdates measures an update by condition of byConditionRows
// rows (UPDATE … SET total = total + 1 WHERE id BETWEEN …), one per
// transaction, through the plugin (one message per row: the rows are read
// and locked first, the statement is restricted to their keys and the
// rows are read again after it) against the plugin off, in alternating
// rounds over the rows the inserts left. It returns how many updates ran
// through the plugin.
func byConditionUpdates(ctx context.Context, with, without *gorm.DB, rounds, per int, r *result) (int, error) {
	var lo uint64
	if err := without.WithContext(ctx).Model(&BenchOrder{}).Select("MIN(id)").Scan(&lo).Error; err != nil {
		return 0, err
	}
	var count int64
	if err := without.WithContext(ctx).Model(&BenchOrder{}).Count(&count).Error; err != nil {
		return 0, err
	}
	windows := max(int(count)/byConditionRows, 1)
	var withT, withoutT time.Duration
	k := 0
	for round := 0; round < rounds; round++ {
		for _, side := range []struct {
			db  *gorm.DB
			acc *time.Duration
		}{{without, &withoutT}, {with, &withT}} {
			start := time.Now()
			for i := 0; i < per; i++ {
				from := lo + uint64(((k+i)%windows)*byConditionRows)
				res := side.db.WithContext(ctx).Model(&BenchOrder{}).Where("id BETWEEN ? AND ?", from, from+byConditionRows-1).
					Update("total", gorm.Expr("total + 1"))
				if res.Error != nil {
					return 0, res.Error
				}
				if res.RowsAffected != byConditionRows {
					return 0, fmt.Errorf("write: update by condition changed %d rows, not %d", res.RowsAffected, byConditionRows)
				}
			}
			*side.acc += time.Since(start)
		}
		k += per
	}
	n := float64(per * rounds)
	r.add("update_100_rows_with_outbox", n/withT.Seconds(), "tx/s")
	r.add("update_100_rows_without_plugin", n/withoutT.Seconds(), "tx/s")
	r.add("update_100_rows_overhead", withT.Seconds()/withoutT.Seconds(), "ratio")
	return per * rounds, nil
}

// startCPUProfile profiles this process's CPU into a new file at path
// until stop is called.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

func relaysScenario(ctx context.Context, cfg config, r *result) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, true)
	if err != nil {
		return err
	}
	defer broker.stop()
	r.Params["messages"], r.Params["relay_processes"] = cfg.N, cfg.Relays
	var base float64
	for i, count := range cfg.Relays {
		rate, err := multiRelayDrain(ctx, cfg, brokers, count)
		if err != nil {
			return fmt.Errorf("%d relays: %w", count, err)
		}
		r.add(fmt.Sprintf("relays=%d", count), rate, "msg/s")
		if i == 0 {
			base = rate
		} else {
			r.add(fmt.Sprintf("relays=%d/relays=%d", count, cfg.Relays[0]), rate/base, "ratio")
		}
	}
	return nil
}

func multiRelayDrain(ctx context.Context, cfg config, brokers []string, count int) (float64, error) {
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return 0, err
	}
	defer e.close()
	if err := e.prefill(ctx, cfg.N); err != nil {
		return 0, err
	}
	env := relayEnv(cfg, e, brokers)
	if cfg.RelayProfiles != "" {
		env = append(env, "OUTBOX_BENCH_RELAY_PROFILE="+filepath.Join(cfg.RelayProfiles, fmt.Sprintf("relays-%d", count)))
	}
	var children []*child
	defer func() {
		for _, c := range children {
			c.stop()
		}
	}()
	for i := 0; i < count; i++ {
		c, err := startChild(ctx, "relay", env, "READY")
		if err != nil {
			return 0, err
		}
		children = append(children, c)
	}
	// The relays drain the first backlog (a warm-up on an analyzed table)
	// and share the buckets; then the measured backlog is committed at
	// once: the figure is their draining, not their start.
	if err := e.waitEmpty(ctx, 10*time.Minute); err != nil {
		return 0, err
	}
	if err := e.waitShared(ctx, count); err != nil {
		return 0, err
	}
	start, err := e.prefillAtOnce(ctx, cfg.N)
	if err != nil {
		return 0, err
	}
	if err := e.waitEmpty(ctx, 10*time.Minute); err != nil {
		return 0, err
	}
	return float64(cfg.N) / time.Since(start).Seconds(), nil
}

// waitShared polls the lease table until count relays hold unexpired
// leases on every bucket, none more than one bucket above another.
func (e *env) waitShared(ctx context.Context, count int) error {
	q := "SELECT COUNT(*) AS n FROM " + e.db.Statement.Quote(e.plugin.Config().Tables.LeasesTable()) +
		" WHERE owner IS NOT NULL AND expires_at_ms > ? GROUP BY owner"
	var held []int
	err := poll(ctx, setupTimeout, 20*time.Millisecond, func() (bool, error) {
		held = held[:0]
		if err := e.db.WithContext(ctx).Raw(q, time.Now().UnixMilli()).Scan(&held).Error; err != nil {
			return false, err
		}
		sum := 0
		for _, n := range held {
			sum += n
		}
		return len(held) == count && slices.Max(held)-slices.Min(held) <= 1 && sum == e.cfg.Buckets, nil
	})
	if errors.Is(err, errPollTimeout) {
		return fmt.Errorf("%d relays: leases held %v after %s, want %d buckets shared", count, held, setupTimeout, e.cfg.Buckets)
	}
	return err
}

// relayEnv is the environment of a relay process (runRelayRole) draining
// e's outbox.
func relayEnv(cfg config, e *env, brokers []string) []string {
	return []string{
		"OUTBOX_BENCH_DRIVER=" + cfg.Driver, "OUTBOX_BENCH_DSN=" + e.dbx.dsn,
		"OUTBOX_BENCH_BROKERS=" + strings.Join(brokers, ","),
		"OUTBOX_BENCH_BUCKETS=" + strconv.Itoa(cfg.Buckets), "OUTBOX_BENCH_BATCH=" + strconv.Itoa(cfg.BatchSize),
		"OUTBOX_BENCH_PARALLELISM=" + strconv.Itoa(cfg.Parallelism),
		"OUTBOX_BENCH_PIPELINE_DEPTH=" + strconv.Itoa(cfg.PipelineDepth),
		"OUTBOX_BENCH_MAX_IDLE_CONNS=" + strconv.Itoa(cfg.MaxIdleConns),
		"OUTBOX_BENCH_PRODUCERS=" + strconv.Itoa(cfg.Producers),
		"OUTBOX_BENCH_PUBLISHER=" + cfg.Publisher,
		"OUTBOX_BENCH_FLUSH_FREQUENCY=" + cfg.FlushFrequency.String(),
		"OUTBOX_BENCH_LINGER_BATCH=" + strconv.Itoa(cfg.LingerBatch),
	}
}

// runRelayRole is a relay process of the relays scenario, or with
// OUTBOX_BENCH_LISTEN_CHANNEL the relay of the latency scenario's listen
// mode: it drains the outbox named by its environment until interrupted.
func runRelayRole() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "outbox-bench relay:", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if prefix := os.Getenv("OUTBOX_BENCH_RELAY_PROFILE"); prefix != "" {
		stopProfile, err := startCPUProfile(fmt.Sprintf("%s-%d.pprof", prefix, os.Getpid()))
		if err != nil {
			return fail(err)
		}
		defer stopProfile()
	}
	buckets, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_BUCKETS"))
	batch, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_BATCH"))
	parallelism, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_PARALLELISM"))
	depth, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_PIPELINE_DEPTH"))
	maxIdle, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_MAX_IDLE_CONNS"))
	// The relay process's publisher is the parent's: -publisher,
	// -producers, -linger-batch and -flush-frequency.
	kafkaPublisher = os.Getenv("OUTBOX_BENCH_PUBLISHER")
	kafkaProducers, _ = strconv.Atoi(os.Getenv("OUTBOX_BENCH_PRODUCERS"))
	kafkaLingerBatch, _ = strconv.Atoi(os.Getenv("OUTBOX_BENCH_LINGER_BATCH"))
	flush, err := time.ParseDuration(os.Getenv("OUTBOX_BENCH_FLUSH_FREQUENCY"))
	if err != nil {
		return fail(fmt.Errorf("OUTBOX_BENCH_FLUSH_FREQUENCY: %w", err))
	}
	kafkaFlushFrequency = flush
	db, err := openGorm(os.Getenv("OUTBOX_BENCH_DRIVER"), os.Getenv("OUTBOX_BENCH_DSN"), maxIdle)
	if err != nil {
		return fail(err)
	}
	defer closeGorm(db)
	store, err := gormrelay.NewStore(db, outbox.Config{BucketCount: buckets})
	if err != nil {
		return fail(err)
	}
	pub, err := newPublisher(ctx, strings.Split(os.Getenv("OUTBOX_BENCH_BROKERS"), ","))
	if err != nil {
		return fail(err)
	}
	defer pub.Close()
	// Short renewals so the relays rebalance quickly as peers start.
	rc := relay.Config{BucketCount: buckets, BatchSize: batch, Parallelism: parallelism, PipelineDepth: depth, Logger: quiet,
		LeaseDuration: 3 * time.Second, LeaseRenewInterval: 500 * time.Millisecond, PollInterval: 50 * time.Millisecond}
	channel := os.Getenv("OUTBOX_BENCH_LISTEN_CHANNEL")
	var transport *pgnotify.Transport
	if channel != "" {
		// The listen mode: the relay's default intervals, like the
		// in-process modes, and hints from the other process's NOTIFYs.
		rc = relay.Config{BucketCount: buckets, BatchSize: batch, Parallelism: parallelism, PipelineDepth: depth, Logger: quiet}
		notifier := outbox.NewNotifier(buckets)
		if transport, err = pgnotify.New(pgnotify.Config{DSN: os.Getenv("OUTBOX_BENCH_DSN"), Channel: channel, Logger: quiet}); err != nil {
			return fail(err)
		}
		defer transport.Close()
		bridge, err := outbox.StartHintBridge(ctx, notifier, transport, outbox.HintBridgeConfig{Logger: quiet})
		if err != nil {
			return fail(err)
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = bridge.Stop(sctx)
		}()
		rc.Hints = notifier
	}
	rl, err := relay.New(store, pub, rc)
	if err != nil {
		return fail(err)
	}
	if err := rl.Start(ctx); err != nil {
		return fail(err)
	}
	defer stopRelay(rl)
	if transport != nil {
		// Ready once it owns every bucket and listens: the first measured
		// commit must not wait for the relay's start.
		if err := waitOwnsAll(ctx, rl, buckets); err != nil {
			return fail(err)
		}
		for transport.Stats().Subscriptions == 0 {
			select {
			case <-ctx.Done():
				return 0
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	fmt.Println("READY")
	<-ctx.Done()
	return 0
}

func strictScenario(ctx context.Context, cfg config, r *result) error {
	// Kafka transactions need a broker that keeps the records.
	broker, brokers, err := startBroker(ctx, cfg.Partitions, false)
	if err != nil {
		return err
	}
	defer broker.stop()
	r.Params["messages"] = cfg.N
	r.Params["rounds"] = cfg.Rounds
	r.Params["strict_batch"] = cmp.Or(cfg.StrictBatch, relay.BatchSizeReconcilerDefault)
	newStrict := func() (relay.Publisher, func(), error) {
		p, err := publisher.NewTransactional(publisher.TransactionalConfig{
			Brokers: brokers, TransactionalIDPrefix: "outbox-bench-" + randomSuffix() + ".", Logger: quiet,
		})
		if err != nil {
			return nil, nil, err
		}
		if err := p.Start(ctx); err != nil {
			_ = p.Close()
			return nil, nil, err
		}
		return p, func() { p.Close() }, nil
	}
	newDefault := func() (relay.Publisher, func(), error) {
		p, err := newPublisher(ctx, brokers)
		if err != nil {
			return nil, nil, err
		}
		return p, func() { p.Close() }, nil
	}
	// Rounds alternate the modes, so that a broker warming up (its first
	// transactions create the transaction state topic) or a machine
	// growing busy weighs on both. A strict relay starts each bucket's
	// transactional producer when it takes the bucket's lease, inside the
	// timed drain, while the default publisher's producers start before
	// it: the streaming figures, from the first acknowledgement to the
	// last, compare the modes without their starts.
	series := map[string][]float64{}
	for round := range cfg.Rounds {
		defCfg, strictCfg := cfg, cfg
		strictCfg.BatchSize = cfg.StrictBatch // 0: the relay's default for a strict-mode publisher
		if cfg.CPUProfile != "" {
			defCfg.profile = fmt.Sprintf("%s.default.%d", cfg.CPUProfile, round+1)
			strictCfg.profile = fmt.Sprintf("%s.strict.%d", cfg.CPUProfile, round+1)
		}
		def, err := drainTimed(ctx, defCfg, cfg.N, false, newDefault)
		if err != nil {
			return fmt.Errorf("default mode, round %d: %w", round+1, err)
		}
		strict, err := drainTimed(ctx, strictCfg, cfg.N, false, newStrict)
		if err != nil {
			return fmt.Errorf("strict mode, round %d: %w", round+1, err)
		}
		series["default"] = append(series["default"], def.rate)
		series["strict"] = append(series["strict"], strict.rate)
		series["default_streaming"] = append(series["default_streaming"], def.streaming)
		series["strict_streaming"] = append(series["strict_streaming"], strict.streaming)
		series["strict/default"] = append(series["strict/default"], strict.rate/def.rate)
		if def.streaming > 0 {
			series["strict/default_streaming"] = append(series["strict/default_streaming"], strict.streaming/def.streaming)
		}
	}
	addMedians(r, "", []string{"default", "strict", "default_streaming", "strict_streaming"}, series, "msg/s")
	addMedians(r, "", []string{"strict/default", "strict/default_streaming"}, series, "ratio")
	return nil
}
