package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/stdlib"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/pgxtrace"
	"github.com/gorm-outbox/outbox/internal/walenv"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// The wal scenario compares WAL mode (outbox.ModeWAL read by package
// pgwal) with table mode on one PostgreSQL server with wal_level =
// logical (-wal-dsn), in the same run, over cfg.Rounds interleaved
// rounds, reporting medians. Its parts (-wal-parts):
//
//   - write: the cost of a rule's message on the write (GORM's Create in
//     its own transaction) against no plugin, in both modes, with the
//     round trips per write counted at the driver and the time of a bare
//     SELECT 1 round trip;
//   - latency: commit → consumer receipt at -rate, table mode's notify
//     mode beside a WAL reader;
//   - rr: the same after a -rr-backlog backlog was written and relayed
//     while a REPEATABLE READ transaction, begun before the relay ran,
//     stays open;
//   - drain: a -n backlog drained through a publisher that acknowledges
//     at once and through the Kafka publisher (kfake, or -brokers), in
//     both modes, beside a bare reader of the same slot that only decodes
//     (the decoding ceiling), with the messages table's
//     pg_stat_user_tables counters after each drain.
var allWALParts = []string{"write", "latency", "rr", "drain"}

// walLatencyModes are the latency modes of the wal scenario's latency and
// rr parts.
var walLatencyModes = []latencyMode{
	{name: "table", hints: true},
	{name: "wal", wal: true},
}

func walScenario(ctx context.Context, cfg config, r *result) error {
	if cfg.Driver != "postgres" {
		return errors.New("the wal scenario needs PostgreSQL (-driver postgres)")
	}
	cfg.DSN = cfg.WALDSN
	r.Params["rounds"] = cfg.Rounds
	r.Params["parts"] = strings.Join(cfg.WALParts, ",")
	if la, err := os.ReadFile("/proc/loadavg"); err == nil {
		r.Notes = append(r.Notes, "load average at the start: "+strings.TrimSpace(string(la)))
	}
	defer func() {
		if la, err := os.ReadFile("/proc/loadavg"); err == nil {
			r.Notes = append(r.Notes, "load average at the end: "+strings.TrimSpace(string(la)))
		}
	}()
	for _, part := range cfg.WALParts {
		if la, err := os.ReadFile("/proc/loadavg"); err == nil {
			r.Notes = append(r.Notes, "load average before "+part+": "+strings.TrimSpace(string(la)))
		}
		var err error
		switch part {
		case "write":
			err = walWrite(ctx, cfg, r)
		case "latency":
			err = walLatency(ctx, cfg, r, 0)
		case "rr":
			err = walLatency(ctx, cfg, r, cfg.RRBacklog)
		case "drain":
			err = walDrain(ctx, cfg, r)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", part, err)
		}
	}
	return nil
}

// median returns the median of vs (the mean of the middle two for an
// even count).
func median(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// addMedians adds the median of each series of rounds, in names' order,
// and the rounds' values to the parameters (JSON output).
func addMedians(r *result, prefix string, names []string, series map[string][]float64, unit string) {
	for _, n := range names {
		if vs, ok := series[n]; ok {
			addMedian(r, prefix+n, vs, unit)
		}
	}
}

// addMedian adds the median of the rounds' values vs as figure name, and
// vs to the parameters as name's rounds.
func addMedian(r *result, name string, vs []float64, unit string) {
	r.add(name, median(vs), unit)
	r.Params["rounds:"+name] = vs
}

// openCounted opens dsn with GORM's PostgreSQL dialector over a pgx pool
// whose round trips rt counts.
func openCounted(dsn string, maxIdle int, rt *pgxtrace.RoundTrips) (*gorm.DB, error) {
	cc, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cc.Tracer = rt
	sqlDB := stdlib.OpenDB(*cc)
	if maxIdle > 0 {
		sqlDB.SetMaxOpenConns(maxIdle)
		sqlDB.SetMaxIdleConns(maxIdle)
	}
	db, err := gorm.Open(postgres.New(postgres.Config{Conn: sqlDB}), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		sqlDB.Close()
		return nil, err
	}
	return db, nil
}

// writeSide is one side of the wal scenario's write part.
type writeSide struct {
	name string
	dbx  *database
	db   *gorm.DB
	rt   pgxtrace.RoundTrips
	slot func()
}

func walWrite(ctx context.Context, cfg config, r *result) error {
	rule := outbox.On(outbox.Insert, func(c outbox.Change[*BenchOrder]) (*outbox.Message, error) {
		return &outbox.Message{Topic: benchTopic, Key: []byte(fmt.Sprint(c.Entity.ID)), Value: make([]byte, cfg.ValueSize)}, nil
	})
	sides := []*writeSide{{name: "none"}, {name: "table"}, {name: "wal"}}
	defer func() {
		for _, s := range sides {
			if s.slot != nil {
				s.slot()
			}
			if s.db != nil {
				closeGorm(s.db)
			}
			if s.dbx != nil {
				s.dbx.drop()
			}
		}
	}()
	for _, s := range sides {
		var err error
		if s.dbx, err = newDatabase(cfg.Driver, cfg.DSN, cfg.TmpDir); err != nil {
			return err
		}
		if s.db, err = openCounted(s.dbx.dsn, cfg.MaxIdleConns, &s.rt); err != nil {
			return err
		}
		if err := s.db.AutoMigrate(&BenchOrder{}); err != nil {
			return err
		}
		if s.name == "none" {
			continue
		}
		oc := outbox.Config{BucketCount: cfg.Buckets, Rules: []outbox.Rule{rule}, Logger: quiet}
		if s.name == "wal" {
			oc.Mode = outbox.ModeWAL
		}
		p, err := outbox.NewPlugin(oc)
		if err == nil {
			err = s.db.Use(p)
		}
		if err == nil {
			err = p.AutoMigrate(ctx, s.db)
		}
		if err != nil {
			return err
		}
		if s.name == "wal" {
			// A slot exists, as in production: the messages are kept for it.
			rd, drop, err := newWALReader(s.db, s.dbx.dsn, p, relay.PublisherFunc(ackAll), cfg.BatchSize)
			if err != nil {
				return err
			}
			s.slot = drop
			if err := rd.EnsureSlot(ctx); err != nil {
				return err
			}
		}
	}
	per := cfg.WriteOps
	r.Params["write_transactions_per_side_and_round"] = per
	usPerTx := map[string][]float64{}
	rtPerTx := map[string][]float64{}
	ratios := map[string][]float64{}
	var select1 []float64
	for round := 0; round < cfg.Rounds; round++ {
		// The sides take turns every writeChunk transactions, so that a
		// change in the machine's load falls on all three alike.
		took := map[string]float64{}
		trips := map[string]int64{}
		for _, s := range sides {
			// Warm the statement caches, so prepares are not counted.
			for i := 0; i < 10; i++ {
				if err := s.db.WithContext(ctx).Create(&BenchOrder{Status: "new"}).Error; err != nil {
					return err
				}
			}
		}
		for done := 0; done < per; done += writeChunk {
			for _, s := range sides {
				before := s.rt.Load()
				start := time.Now()
				for i := done; i < min(done+writeChunk, per); i++ {
					if err := s.db.WithContext(ctx).Create(&BenchOrder{Status: "new", Total: int64(i)}).Error; err != nil {
						return err
					}
				}
				took[s.name] += time.Since(start).Seconds()
				trips[s.name] += s.rt.Load() - before
			}
		}
		for _, s := range sides {
			usPerTx[s.name] = append(usPerTx[s.name], took[s.name]/float64(per)*1e6)
			rtPerTx[s.name] = append(rtPerTx[s.name], float64(trips[s.name])/float64(per))
		}
		// A bare round trip on the same pool, in the same round.
		sqlDB, err := sides[0].db.DB()
		if err != nil {
			return err
		}
		start := time.Now()
		for i := 0; i < per; i++ {
			if _, err := sqlDB.ExecContext(ctx, "SELECT 1"); err != nil {
				return err
			}
		}
		select1 = append(select1, time.Since(start).Seconds()/float64(per)*1e6)
		ratios["table/none"] = append(ratios["table/none"], took["table"]/took["none"])
		ratios["wal/none"] = append(ratios["wal/none"], took["wal"]/took["none"])
		ratios["wal/table"] = append(ratios["wal/table"], took["wal"]/took["table"])
		n := len(select1) - 1
		ratios["floor"] = append(ratios["floor"], (usPerTx["none"][n]+select1[n])/usPerTx["none"][n])
	}
	names := []string{"none", "table", "wal"}
	addMedians(r, "write_us_per_tx_", names, usPerTx, "µs")
	addMedians(r, "write_round_trips_per_tx_", names, rtPerTx, "round trips")
	addMedian(r, "write_select1_us", select1, "µs")
	addMedians(r, "write_", []string{"table/none", "wal/none", "wal/table"}, ratios, "ratio")
	addMedian(r, "write_floor_one_round_trip", ratios["floor"], "ratio")
	var msgs int64
	if err := sides[1].db.Raw("SELECT count(*) FROM " + sides[1].db.Statement.Quote(outbox.Config{}.WithDefaults().Tables.MessagesTable())).Scan(&msgs).Error; err != nil {
		return err
	}
	if want := int64(cfg.Rounds * (per + 10)); msgs != want {
		return fmt.Errorf("table mode wrote %d messages, not %d", msgs, want)
	}
	return nil
}

// writeChunk is how many transactions one side of the write part runs
// before the next side's turn.
const writeChunk = 100

func ackAll(_ context.Context, msgs []relay.Message) (int, error) { return len(msgs), nil }

// newWALReader returns a reader of plugin's outbox (in WAL mode) on db,
// on a slot of its own, and the function that drops that slot and its
// publication once no reader holds it.
func newWALReader(db *gorm.DB, dsn string, plugin *outbox.Plugin, pub relay.Publisher, batch int) (*pgwal.Reader, func(), error) {
	slot := "bench_" + randomSuffix()
	rd, err := pgwal.New(db, plugin, pub, pgwal.Config{ReplicationDSN: dsn, Slot: slot, BatchSize: batch, Logger: quiet})
	if err != nil {
		return nil, nil, err
	}
	drop := func() {
		_ = poll(context.Background(), 30*time.Second, 20*time.Millisecond, func() (bool, error) {
			var n int64
			db.Raw("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&n)
			if n == 0 {
				return true, nil
			}
			db.Exec("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ? AND NOT active", slot)
			return false, nil
		})
		db.Exec("DROP PUBLICATION IF EXISTS " + slot)
	}
	return rd, drop, nil
}

// walRun is a running WAL reader.
type walRun struct {
	rd     *pgwal.Reader
	cancel context.CancelFunc
	done   chan error
	drop   func()
}

// runWALReader runs rd until stop, and returns once it streams the slot.
func (e *env) runWALReader(ctx context.Context, rd *pgwal.Reader, drop func()) (*walRun, error) {
	rctx, cancel := context.WithCancel(ctx)
	w := &walRun{rd: rd, cancel: cancel, done: make(chan error, 1), drop: drop}
	go func() { w.done <- rd.Run(rctx) }()
	err := poll(ctx, setupTimeout, 5*time.Millisecond, func() (bool, error) {
		var active []bool
		err := e.db.WithContext(ctx).Raw("SELECT active FROM pg_replication_slots WHERE slot_name = ?", rd.Config().Slot).Scan(&active).Error
		return len(active) == 1 && active[0], err
	})
	if err != nil {
		w.stop()
		return nil, fmt.Errorf("WAL reader not streaming: %w", err)
	}
	return w, nil
}

func (w *walRun) stop() {
	w.cancel()
	<-w.done
	w.drop()
}

// walLatency measures the latency modes table and wal over cfg.Rounds
// interleaved rounds; with backlog > 0, each after a backlog of that many
// messages was written and relayed while a REPEATABLE READ transaction
// begun before it stays open (the rr part).
func walLatency(ctx context.Context, cfg config, r *result, backlog int) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, false)
	if err != nil {
		return err
	}
	defer broker.stop()
	part := "latency_"
	if backlog > 0 {
		part = "rr_"
		r.Params["rr_backlog"] = backlog
	}
	r.Params["rate_tx_s"], r.Params["duration_s"], r.Params["warmup_s"] = cfg.Rate, cfg.Duration.Seconds(), cfg.Warmup.Seconds()
	p50, p99, p999 := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	var names []string
	for round := 0; round < cfg.Rounds; round++ {
		for _, mode := range walLatencyModes {
			if round == 0 {
				names = append(names, mode.name)
			}
			mode.rrBacklog = backlog
			var idleClosed int64
			lat, err := measureAll(ctx, cfg, brokers, mode, &r.Notes, &idleClosed, nil)
			if err != nil {
				return err
			}
			p50[mode.name] = append(p50[mode.name], ms(percentile(lat, 0.50)))
			p99[mode.name] = append(p99[mode.name], ms(percentile(lat, 0.99)))
			p999[mode.name] = append(p999[mode.name], ms(percentile(lat, 0.999)))
		}
	}
	for _, n := range names {
		addMedian(r, part+n+"_p50", p50[n], "ms")
		addMedian(r, part+n+"_p99", p99[n], "ms")
		addMedian(r, part+n+"_p99.9", p999[n], "ms")
	}
	var ratio []float64
	for i := range p99["wal"] {
		ratio = append(ratio, p99["wal"][i]/p99["table"][i])
	}
	addMedian(r, part+"wal_p99/table_p99", ratio, "ratio")
	return nil
}

// startRR begins a REPEATABLE READ transaction on its own connection and
// takes its snapshot: until it ends, no row deleted after now can be
// vacuumed away. The returned function ends it.
func (e *env) startRR(ctx context.Context) (end func(), err error) {
	sqlDB, err := sql.Open("pgx", e.dbx.dsn)
	if err != nil {
		return nil, err
	}
	tx, err := sqlDB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		sqlDB.Close()
		return nil, err
	}
	var n int64
	if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM "+e.table()).Scan(&n); err != nil {
		_ = tx.Rollback()
		sqlDB.Close()
		return nil, err
	}
	return func() {
		_ = tx.Rollback()
		sqlDB.Close()
	}, nil
}

// countingPub counts what pub acknowledges.
type countingPub struct {
	relay.Publisher
	acked atomic.Int64

	mu sync.Mutex
	// first is when the first acknowledgement came back, and firstN how
	// many messages it acknowledged.
	first  time.Time
	firstN int64
}

func (c *countingPub) Publish(ctx context.Context, msgs []relay.Message) (int, error) {
	n, err := c.Publisher.Publish(ctx, msgs)
	if n > 0 {
		c.mu.Lock()
		if c.first.IsZero() {
			c.first, c.firstN = time.Now(), int64(n)
		}
		c.mu.Unlock()
	}
	c.acked.Add(int64(n))
	return n, err
}

// streamed returns the rate of the acknowledgements after the first one,
// up to n at end.
func (c *countingPub) streamed(n int, end time.Time) float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return float64(int64(n)-c.firstN) / end.Sub(c.first).Seconds()
}

// LeasesAcquired and LeasesReleased pass the leases on to a publisher
// that takes them (the Kafka publisher's strict mode).
func (c *countingPub) LeasesAcquired(ctx context.Context, ls []relay.Lease) error {
	if la, ok := c.Publisher.(relay.LeaseAware); ok {
		return la.LeasesAcquired(ctx, ls)
	}
	return nil
}

// CheckReady passes the relay's start check on to a publisher that has
// one (the Kafka publishers).
func (c *countingPub) CheckReady(ctx context.Context) error {
	if rc, ok := c.Publisher.(relay.ReadyChecker); ok {
		return rc.CheckReady(ctx)
	}
	return nil
}

func (c *countingPub) LeasesReleased(ctx context.Context, ls []relay.Lease) {
	if la, ok := c.Publisher.(relay.LeaseAware); ok {
		la.LeasesReleased(ctx, ls)
	}
}

// tableStats is a table's pg_stat_user_tables counters.
type tableStats struct {
	Ins, Del, Dead, Live int64
}

// readTableStats reads the messages table's counters once they count at
// least minDel deletions (the backends report theirs when idle, within
// about ten seconds).
func (e *env) readTableStats(ctx context.Context, minDel int64) (tableStats, error) {
	var st tableStats
	q := "SELECT n_tup_ins AS ins, n_tup_del AS del, n_dead_tup AS dead, n_live_tup AS live FROM pg_stat_user_tables WHERE schemaname = current_schema() AND relname = ?"
	name := e.plugin.Config().Tables.MessagesTable()
	err := poll(ctx, setupTimeout, 100*time.Millisecond, func() (bool, error) {
		var rows []tableStats
		if err := e.db.WithContext(ctx).Raw(q, name).Scan(&rows).Error; err != nil {
			return false, err
		}
		if len(rows) == 1 {
			st = rows[0]
		}
		return len(rows) == 1 && st.Del >= minDel, nil
	})
	if errors.Is(err, errPollTimeout) {
		err = fmt.Errorf("pg_stat_user_tables of %s counts %d deletions after %s, not %d", name, st.Del, setupTimeout, minDel)
	}
	return st, err
}

// drainRates are the rates of one drain: from the relay's start to the
// last acknowledgement, and from the first acknowledgement to the last
// (the relay streaming, its start-up left out).
type drainRates struct{ total, streaming float64 }

// walDrain drains cfg.N messages cfg.Rounds times in each of: table mode
// and WAL mode through a publisher that acknowledges at once and through
// the Kafka publisher, and a bare decoding reader of each WAL mode slot
// before the reader drains it.
func walDrain(ctx context.Context, cfg config, r *result) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, true)
	if err != nil {
		return err
	}
	defer broker.stop()
	n := cfg.N
	r.Params["drain_messages"], r.Params["keys"], r.Params["value_bytes"], r.Params["batch"] = n, cfg.Keys, cfg.ValueSize, cfg.BatchSize
	r.Params["buckets"], r.Params["partitions"] = cfg.Buckets, cfg.Partitions
	total, streaming := map[string][]float64{}, map[string][]float64{}
	stats := map[string]tableStats{}
	sides := []struct {
		name  string
		wal   bool
		kafka bool
	}{{"table_ack", false, false}, {"wal_ack", true, false}, {"table_kafka", false, true}, {"wal_kafka", true, true}}
	for round := 0; round < cfg.Rounds; round++ {
		for _, side := range sides {
			var pub relay.Publisher = relay.PublisherFunc(ackAll)
			var kp benchPublisher
			if side.kafka {
				if kp, err = newPublisher(ctx, brokers); err != nil {
					return err
				}
				pub = kp
			}
			c := cfg
			c.walMode = side.wal
			if round == 0 && side.name == "wal_ack" {
				c.profile = cfg.CPUProfile
			}
			rates, ceiling, st, err := drainMode(ctx, c, n, pub)
			if kp != nil {
				kp.Close()
			}
			if err != nil {
				return fmt.Errorf("%s: %w", side.name, err)
			}
			total[side.name] = append(total[side.name], rates.total)
			streaming[side.name] = append(streaming[side.name], rates.streaming)
			if side.wal {
				// The ceiling of this drain's own slot.
				c := "decode_ceiling_" + strings.TrimPrefix(side.name, "wal_")
				total[c] = append(total[c], ceiling.total)
				streaming[c] = append(streaming[c], ceiling.streaming)
			}
			stats[side.name] = st
		}
	}
	names := []string{"table_ack", "wal_ack", "decode_ceiling_ack", "table_kafka", "wal_kafka", "decode_ceiling_kafka"}
	addMedians(r, "drain_", names, total, "msg/s")
	addMedians(r, "drain_streaming_", names, streaming, "msg/s")
	ratio := func(name string, series map[string][]float64, a, b string) {
		var vs []float64
		for i := range series[a] {
			vs = append(vs, series[a][i]/series[b][i])
		}
		addMedian(r, name, vs, "ratio")
	}
	for _, kind := range []string{"ack", "kafka"} {
		ratio("drain_wal_"+kind+"/table_"+kind, total, "wal_"+kind, "table_"+kind)
		ratio("drain_wal_"+kind+"/decode_ceiling_"+kind, total, "wal_"+kind, "decode_ceiling_"+kind)
		ratio("drain_streaming_wal_"+kind+"/table_"+kind, streaming, "wal_"+kind, "table_"+kind)
		ratio("drain_streaming_wal_"+kind+"/decode_ceiling_"+kind, streaming, "wal_"+kind, "decode_ceiling_"+kind)
	}
	for _, side := range sides {
		st := stats[side.name]
		// The messages table's counters after the last round's drain.
		r.add("rows_inserted_"+side.name, float64(st.Ins), "rows")
		r.add("rows_deleted_"+side.name, float64(st.Del), "rows")
		r.add("dead_tuples_"+side.name, float64(st.Dead), "tuples")
	}
	return nil
}

// drainMode writes n messages in cfg's mode and times their drain through
// pub: a table mode relay, or a WAL reader after the bare decoding reader
// of the same slot (whose rates it also returns). It returns the messages
// table's counters after the drain.
func drainMode(ctx context.Context, cfg config, n int, pub relay.Publisher) (rates, ceiling drainRates, st tableStats, err error) {
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return rates, ceiling, st, err
	}
	defer e.close()
	counted := &countingPub{Publisher: pub}
	var rd *pgwal.Reader
	drop := func() {}
	if cfg.walMode {
		if rd, drop, err = newWALReader(e.db, e.dbx.dsn, e.plugin, counted, cfg.BatchSize); err != nil {
			return rates, ceiling, st, err
		}
		if err := rd.EnsureSlot(ctx); err != nil {
			drop()
			return rates, ceiling, st, err
		}
	}
	if err := e.prefill(ctx, n); err != nil {
		drop()
		return rates, ceiling, st, err
	}
	if cfg.walMode {
		if ceiling, err = decodeSlot(ctx, e.dbx.dsn, rd.Config().Slot, e.plugin.Config().WALPrefix(), n); err != nil {
			drop()
			return rates, ceiling, st, fmt.Errorf("decoding ceiling: %w", err)
		}
	}
	if cfg.profile != "" {
		stop, err := startCPUProfile(cfg.profile)
		if err != nil {
			drop()
			return rates, ceiling, st, err
		}
		defer stop()
	}
	start := time.Now()
	var halt func()
	if cfg.walMode {
		w, err := e.runWALReader(ctx, rd, drop)
		if err != nil {
			return rates, ceiling, st, err
		}
		halt = w.stop
	} else {
		rl, err := e.startRelay(ctx, counted, true, 0)
		if err != nil {
			return rates, ceiling, st, err
		}
		halt = func() { stopRelay(rl) }
	}
	err = poll(ctx, 10*time.Minute, time.Millisecond, func() (bool, error) { return counted.acked.Load() >= int64(n), nil })
	end := time.Now()
	halt()
	if err != nil {
		return rates, ceiling, st, err
	}
	rates = drainRates{total: float64(n) / end.Sub(start).Seconds(), streaming: counted.streamed(n, end)}
	minDel := int64(0)
	if !cfg.walMode {
		if err := e.waitEmpty(ctx, time.Minute); err != nil {
			return rates, ceiling, st, err
		}
		minDel = int64(n)
	}
	st, err = e.readTableStats(ctx, minDel)
	return rates, ceiling, st, err
}

// decodeSlot reads slot from its confirmed position, as pg_recvlogical
// does, parsing every pgoutput message and decoding the envelope of each
// outbox message, until n are decoded; it confirms nothing, so a reader
// started afterwards reads the same messages. It returns the time taken
// from the connection to the nth message, and from the first message to
// the nth: the decoding ceiling of a reader of this slot on this machine.
func decodeSlot(ctx context.Context, dsn, slot, prefix string, n int) (drainRates, error) {
	var rates drainRates
	pc, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return rates, err
	}
	if pc.RuntimeParams == nil {
		pc.RuntimeParams = map[string]string{}
	}
	pc.RuntimeParams["replication"] = "database"
	start := time.Now()
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		return rates, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + slot + "'", "messages 'true'"},
	})
	if err != nil {
		return rates, err
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	got := 0
	var first time.Time
	for got < n {
		raw, err := conn.ReceiveMessage(rctx)
		if err != nil {
			return rates, fmt.Errorf("after %d of %d messages: %w", got, n, err)
		}
		cd, ok := raw.(*pgproto3.CopyData)
		if !ok {
			if er, ok := raw.(*pgproto3.ErrorResponse); ok {
				return rates, pgconn.ErrorResponseToPgError(er)
			}
			continue
		}
		if len(cd.Data) == 0 || cd.Data[0] != pglogrepl.XLogDataByteID {
			continue
		}
		x, err := pglogrepl.ParseXLogData(cd.Data[1:])
		if err != nil {
			return rates, err
		}
		msg, err := pglogrepl.Parse(x.WALData)
		if err != nil {
			return rates, err
		}
		if m, ok := msg.(*pglogrepl.LogicalDecodingMessage); ok && m.Prefix == prefix {
			env, err := walenv.Decode(m.Content)
			if err != nil {
				return rates, err
			}
			if _, err := outbox.DecodeHeaders(env.Headers); err != nil {
				return rates, err
			}
			if got == 0 {
				first = time.Now()
			}
			got++
		}
	}
	end := time.Now()
	rates.total = float64(n) / end.Sub(start).Seconds()
	if n > 1 {
		rates.streaming = float64(n-1) / end.Sub(first).Seconds()
	}
	return rates, nil
}
