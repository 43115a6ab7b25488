package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/pgnotify"
	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

// latencyMode is one way the latency scenario writes and wakes the relay.
type latencyMode struct {
	name string
	// rules8: eight independent writers creating rows through a publish
	// rule; otherwise one paced writer enqueueing.
	rules8 bool
	// hints: the relay takes the plugin's local hints.
	hints bool
	// poll is the relay's PollInterval; 0 is the relay's default (1s).
	poll time.Duration
	// listen: the relay runs in another process and takes its hints from
	// PostgreSQL LISTEN/NOTIFY (package pgnotify); the writer's process
	// sends a NOTIFY after its commits. PostgreSQL only.
	listen bool
	// direct: no relay. Each writer commits the same transaction and then
	// publishes its message itself through the same publisher, the dual
	// write an outbox replaces: the floor of commit → receipt on this
	// machine, the same run's baseline for the relay's figures.
	direct bool
	// wal: the outbox writes in WAL mode and a pgwal reader relays
	// (PostgreSQL with wal_level = logical; the wal scenario).
	wal bool
	// rrBacklog: before the writes, a backlog of this many messages is
	// written and relayed while a REPEATABLE READ transaction, begun
	// before the relay starts, stays open until the mode ends.
	rrBacklog int
	// run numbers the runs of a mode run more than once (1, 2, ...); 0
	// for a mode run once.
	run int
}

// label names one run of the mode: its name, with the run's number for a
// mode run more than once.
func (m latencyMode) label() string {
	if m.run == 0 {
		return m.name
	}
	return m.name + "." + strconv.Itoa(m.run)
}

// latencyModes are the latency scenario's modes.
var latencyModes = []latencyMode{
	{name: "notify", hints: true},
	{name: "rules8", rules8: true, hints: true},
	{name: "poll"},
	{name: "poll10", poll: 10 * time.Millisecond},
	{name: "listen", listen: true},
	{name: "direct", direct: true},
}

// defaultLatencyOrder is the order the latency modes run in without
// -latency-modes. The floor, direct, runs first and last, so that the
// relay's modes are measured between two runs of their baseline rather
// than all before it.
var defaultLatencyOrder = []string{"direct", "notify", "rules8", "poll", "poll10", "listen", "direct"}

// latencyModeNames are the names of latencyModes.
func latencyModeNames() []string {
	var out []string
	for _, m := range latencyModes {
		out = append(out, m.name)
	}
	return out
}

// parseLatencyModes reads -latency-modes: mode names, comma-separated,
// in the order they run; a name may repeat.
func parseLatencyModes(s string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		if !slices.Contains(latencyModeNames(), f) {
			return nil, fmt.Errorf("unknown mode %q (known: %s)", f, strings.Join(latencyModeNames(), ", "))
		}
		out = append(out, f)
	}
	if len(out) == 0 {
		return nil, errors.New("no mode named")
	}
	return out, nil
}

// latencyModeNamed returns the mode of that name.
func latencyModeNamed(name string) latencyMode {
	i := slices.IndexFunc(latencyModes, func(m latencyMode) bool { return m.name == name })
	return latencyModes[i]
}

// latencyTopics are the topics of the latency scenario's modes.
func latencyTopics() []string {
	var out []string
	for _, m := range append(slices.Clone(latencyModes), walLatencyModes...) {
		out = append(out, benchTopic+"-latency-"+m.name)
	}
	return out
}

func latencyScenario(ctx context.Context, cfg config, r *result) error {
	broker, brokers, err := startBroker(ctx, cfg.Partitions, false)
	if err != nil {
		return err
	}
	defer broker.stop()
	r.Params["rate_tx_s"], r.Params["duration_s"] = cfg.Rate, cfg.Duration.Seconds()
	r.Params["warmup_s"] = cfg.Warmup.Seconds()
	r.Params["consumer"] = cfg.Consumer
	r.Params["parallelism"] = cfg.Parallelism
	r.Params["max_idle_conns"] = cfg.MaxIdleConns
	cfg.latencyProfile = cfg.CPUProfile
	runs := map[string]int{}
	for _, name := range cfg.LatencyModes {
		runs[name]++
	}
	pooled := map[string][]time.Duration{}
	lags := map[string][]time.Duration{} // the writers' lag behind their schedule
	closed := map[string]int64{}         // summed over a mode's runs
	var order []string                   // the modes' first runs, in order
	seen := map[string]int{}
	for _, name := range cfg.LatencyModes {
		mode := latencyModeNamed(name)
		if mode.listen && cfg.Driver != "postgres" {
			if _, ok := r.Params[mode.name]; !ok {
				r.Params[mode.name] = "skipped: LISTEN/NOTIFY needs PostgreSQL"
				r.Notes = append(r.Notes, mode.name+": skipped, LISTEN/NOTIFY needs PostgreSQL")
			}
			continue
		}
		seen[name]++
		if seen[name] == 1 {
			order = append(order, name)
		}
		if runs[name] > 1 {
			mode.run = seen[name]
		}
		var (
			idleClosed int64
			lag        []time.Duration
		)
		lat, err := measureAll(ctx, cfg, brokers, mode, &r.Notes, &idleClosed, &lag)
		if err != nil {
			return err
		}
		pooled[name] = append(pooled[name], lat...)
		lags[name] = append(lags[name], lag...)
		if runs[name] > 1 {
			// Each run of a repeated mode on its own; the mode's figures
			// below pool them.
			k := mode.label()
			r.add(k+"_p50", ms(percentile(lat, 0.50)), "ms")
			r.add(k+"_p99", ms(percentile(lat, 0.99)), "ms")
		}
		closed[name] += idleClosed
	}
	p99 := map[string]float64{}
	for _, name := range order {
		lat := pooled[name]
		sortDurations(lat)
		p99[name] = ms(percentile(lat, 0.99))
		r.add(name+"_p50", ms(percentile(lat, 0.50)), "ms")
		r.add(name+"_p99", p99[name], "ms")
		r.add(name+"_p99.9", ms(percentile(lat, 0.999)), "ms")
		r.add(name+"_max", ms(lat[len(lat)-1]), "ms")
		r.add(name+"_messages", float64(len(lat)), "msgs")
		r.add(name+"_max_idle_closed", float64(closed[name]), "conns")
		lag := lags[name]
		sortDurations(lag)
		r.add(name+"_write_lag_p50", ms(percentile(lag, 0.50)), "ms")
		r.add(name+"_write_lag_p99", ms(percentile(lag, 0.99)), "ms")
	}
	r.Params["latency_modes"] = strings.Join(cfg.LatencyModes, ",")
	// A hint-driven relay should have no worse a tail than a relay polling
	// every 10 ms, measured in the same run, and can have no better one
	// than the writer publishing for itself.
	if base := p99["poll10"]; base > 0 {
		for _, m := range []string{"notify", "rules8", "listen"} {
			if v, ok := p99[m]; ok {
				r.add(m+"_p99/poll10_p99", v/base, "ratio")
			}
		}
	}
	if base := p99["direct"]; base > 0 {
		for _, m := range []string{"notify", "rules8", "listen", "poll10"} {
			if v, ok := p99[m]; ok {
				r.add(m+"_p99/direct_p99", v/base, "ratio")
			}
		}
	}
	return nil
}

// arrivalStall is how long the latency scenario waits, after the writers
// finished, for a next message to arrive before it counts the missing
// ones as never arrived.
const arrivalStall = 60 * time.Second

// measureAll is measureLatency on mode's topic, failing unless every
// message arrived.
func measureAll(ctx context.Context, cfg config, brokers []string, mode latencyMode, notes *[]string, idleClosed *int64, lag *[]time.Duration) ([]time.Duration, error) {
	lat, lost, err := measureLatency(ctx, cfg, brokers, mode, benchTopic+"-latency-"+mode.name, notes, idleClosed, lag)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", mode.name, err)
	}
	if lost > 0 {
		return nil, fmt.Errorf("%s: %d messages never arrived", mode.name, lost)
	}
	return lat, nil
}

// ms is d in milliseconds.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// LatencyOrder is the business row of the latency scenario's rules8
// mode; its publish rule sends Token as the message value.
type LatencyOrder struct {
	ID    uint64 `gorm:"primaryKey"`
	Token string `gorm:"size:32"`
}

// latencyRelay is the relay of one latency run: in this process, or in a
// child process for the listen mode.
type latencyRelay struct {
	local *relay.Relay
	pub   *publisher.Kafka
	child *child
	// channel is the NOTIFY channel of the child's relay.
	channel string
	// wal is the WAL reader of the wal mode.
	wal *walRun
	// acked counts the messages its publisher acknowledged.
	acked *countingPub
}

func (l latencyRelay) stop() {
	if l.wal != nil {
		l.wal.stop()
		l.pub.Close()
	}
	if l.local != nil {
		stopRelay(l.local)
		l.pub.Close()
	}
	if l.child != nil {
		l.child.stop()
	}
}

// startLatencyRelay starts mode's relay and returns once it owns every
// bucket (and, for listen, listens; for wal, streams the slot), so that
// the first measured commit does not wait for the relay's start. A
// non-nil before runs just before the relay starts (for wal, once its
// slot exists).
func startLatencyRelay(ctx context.Context, e *env, cfg config, brokers []string, mode latencyMode, before func() error) (latencyRelay, error) {
	if before == nil {
		before = func() error { return nil }
	}
	if mode.wal {
		pub, err := newPublisher(ctx, brokers)
		if err != nil {
			return latencyRelay{}, err
		}
		counted := &countingPub{Publisher: pub}
		rd, drop, err := newWALReader(e.db, e.dbx.dsn, e.plugin, counted, cfg.BatchSize)
		if err == nil {
			if err = rd.EnsureSlot(ctx); err != nil {
				drop()
			}
		}
		if err == nil {
			if err = before(); err != nil {
				drop()
			}
		}
		var w *walRun
		if err == nil {
			w, err = e.runWALReader(ctx, rd, drop)
		}
		if err != nil {
			pub.Close()
			return latencyRelay{}, err
		}
		return latencyRelay{wal: w, pub: pub, acked: counted}, nil
	}
	if err := before(); err != nil {
		return latencyRelay{}, err
	}
	if mode.listen {
		channel := "outbox_bench_" + randomSuffix()
		c, err := startChild(ctx, "relay", append(relayEnv(cfg, e, brokers), "OUTBOX_BENCH_LISTEN_CHANNEL="+channel), "READY")
		return latencyRelay{child: c, channel: channel}, err
	}
	pub, err := newPublisher(ctx, brokers)
	if err != nil {
		return latencyRelay{}, err
	}
	// The relay's publisher is wrapped only to count a backlog.
	counted := &countingPub{Publisher: pub}
	var relayPub relay.Publisher = pub
	if mode.rrBacklog > 0 {
		relayPub = counted
	}
	rl, err := e.startRelay(ctx, relayPub, mode.hints, mode.poll)
	if err != nil {
		pub.Close()
		return latencyRelay{}, err
	}
	if err := waitOwnsAll(ctx, rl, cfg.Buckets); err != nil {
		stopRelay(rl)
		pub.Close()
		return latencyRelay{}, err
	}
	return latencyRelay{local: rl, pub: pub, acked: counted}, nil
}

// waitOwnsAll polls until rl trusts leases on all n buckets.
func waitOwnsAll(ctx context.Context, rl *relay.Relay, n int) error {
	err := poll(ctx, 30*time.Second, 5*time.Millisecond, func() (bool, error) { return len(rl.Leases()) >= n, nil })
	if errors.Is(err, errPollTimeout) {
		return fmt.Errorf("relay owns %d of %d buckets after 30s", len(rl.Leases()), n)
	}
	return err
}

// startNotifySender sends the env's commits to other processes as NOTIFYs
// (pgnotify through a send-only HintBridge), with its NOTIFY connection
// opened before it returns. The returned function stops it.
func startNotifySender(ctx context.Context, e *env, channel string) (stop func(), err error) {
	transport, err := pgnotify.New(pgnotify.Config{DSN: e.dbx.dsn, Channel: channel, Logger: quiet})
	if err != nil {
		return nil, err
	}
	// Open the NOTIFY connection now, so the first measured commit does
	// not pay for it; the relay reads an unknown-bucket hint as a prompt
	// to look for work, of which there is none yet.
	if err := transport.Publish(ctx, []int{outbox.UnknownBucket}); err != nil {
		transport.Close()
		return nil, fmt.Errorf("first NOTIFY: %w", err)
	}
	bridge, err := outbox.StartHintBridge(ctx, e.plugin.Notifier(), transport, outbox.HintBridgeConfig{SendOnly: true, Logger: quiet})
	if err != nil {
		transport.Close()
		return nil, err
	}
	return func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = bridge.Stop(sctx)
		transport.Close()
	}, nil
}

// measureLatency writes cfg.Rate one-message transactions per second for
// cfg.Warmup + cfg.Duration while mode's relay runs, and measures commit
// return → consumer receipt for each message written after the warm-up.
//
// With cfg.Timeline it also records each message's path through the
// relay (not for listen, whose relay runs elsewhere; for direct, the
// writer's publish), writes it there and appends a summary of the slowest
// messages to notes.
//
// A non-nil lag receives, sorted, how far behind its schedule each counted
// message's commit returned: the time a message waited to be written
// because the writers were busy, which commit → receipt does not count.
//
// idleClosed receives how many connections the bench process's pool (the
// writer's and, but for listen, the relay's) closed at its idle limit
// while the messages were written and delivered (sql.DBStats.MaxIdleClosed).
func measureLatency(ctx context.Context, cfg config, brokers []string, mode latencyMode, topic string, notes *[]string, idleClosed *int64, lag *[]time.Duration) ([]time.Duration, int, error) {
	var rules []outbox.Rule
	if mode.rules8 {
		rules = append(rules, outbox.OnCreate(func(c outbox.Change[*LatencyOrder]) (*outbox.Message, error) {
			return &outbox.Message{Topic: topic, Key: []byte("k" + strings.SplitN(c.Entity.Token[1:], "-", 2)[0]), Value: []byte(c.Entity.Token)}, nil
		}))
	}
	ecfg := cfg
	ecfg.walMode = mode.wal
	e, err := newEnv(ctx, ecfg, rules...)
	if err != nil {
		return nil, 0, err
	}
	defer e.close()
	if mode.rules8 {
		if err := e.db.WithContext(ctx).AutoMigrate(&LatencyOrder{}); err != nil {
			return nil, 0, err
		}
	}
	var mu sync.Mutex
	recv := map[string]time.Time{}
	got := func(key string, at time.Time) {
		mu.Lock()
		recv[key] = at
		mu.Unlock()
	}
	stopConsumer, err := startConsumer(ctx, cfg, brokers, topic, mode.rules8, got)
	if err != nil {
		return nil, 0, err
	}
	defer stopConsumer()
	if cfg.Timeline != "" && !mode.listen {
		e.tl = newTimeline(func(m relay.Message) string {
			if mode.rules8 {
				return string(m.Value)
			}
			return m.MessageID
		})
		stopProbe := make(chan struct{})
		go e.tl.probe(stopProbe)
		defer close(stopProbe)
	}
	var (
		after func(m *outbox.Message) error
		rl    latencyRelay
	)
	if mode.direct {
		pub, err := newPublisher(ctx, brokers)
		if err != nil {
			return nil, 0, err
		}
		defer pub.Close()
		var dpub relay.Publisher = pub
		if e.tl != nil {
			// The writer's publishes, timed as the relay's are: the same
			// produce → acknowledgement step without a relay.
			dpub = timedPub{pub, e.tl}
		}
		after = func(m *outbox.Message) error {
			_, err := dpub.Publish(ctx, []relay.Message{{
				MessageID: m.ID, Topic: m.Topic, Key: m.Key, Value: m.Value, CreatedAt: time.Now(),
			}})
			return err
		}
	} else {
		var before func() error
		endRR := func() {}
		if mode.rrBacklog > 0 {
			before = func() error {
				if err := e.prefill(ctx, mode.rrBacklog); err != nil {
					return err
				}
				end, err := e.startRR(ctx)
				if err == nil {
					endRR = end
				}
				return err
			}
		}
		rl, err = startLatencyRelay(ctx, e, cfg, brokers, mode, before)
		defer endRR() // after the relay stops
		if err != nil {
			return nil, 0, err
		}
		defer rl.stop()
		if mode.rrBacklog > 0 {
			err := poll(ctx, 10*time.Minute, 20*time.Millisecond, func() (bool, error) { return rl.acked.acked.Load() >= int64(mode.rrBacklog), nil })
			if err != nil {
				return nil, 0, fmt.Errorf("backlog of %d not relayed: %w", mode.rrBacklog, err)
			}
		}
	}
	if mode.listen {
		stopSender, err := startNotifySender(ctx, e, rl.channel)
		if err != nil {
			return nil, 0, err
		}
		defer stopSender()
	}

	// A checkpoint before the writes puts the next one checkpoint_timeout
	// (5 minutes by default) away, after the mode ends: the data files
	// dirtied by earlier scenarios and runs are not flushed, competing for
	// the disk with the commits, while the latency is measured.
	if cfg.Driver == "postgres" {
		if err := e.db.WithContext(ctx).Exec("CHECKPOINT").Error; err != nil {
			*notes = append(*notes, mode.name+": no checkpoint before the writes: "+err.Error())
		}
	}
	warm := int(float64(cfg.Rate) * cfg.Warmup.Seconds())
	total := warm + int(float64(cfg.Rate)*cfg.Duration.Seconds())
	committed := make([]time.Time, total)
	scheduled := make([]time.Time, total)
	ids := make([]string, total)
	var werr atomic.Value
	closedAtStart := maxIdleClosed(e.db)
	if cfg.latencyProfile != "" {
		stop, err := startCPUProfile(cfg.latencyProfile + "." + mode.label())
		if err != nil {
			return nil, 0, err
		}
		defer stop()
	}
	if mode.rules8 {
		writeRules8(ctx, e, cfg, total, scheduled, committed, ids, &werr)
	} else {
		writePaced(ctx, e, cfg, topic, total, scheduled, committed, ids, after, &werr)
	}
	if err, _ := werr.Load().(error); err != nil {
		return nil, 0, err
	}
	// Wait for every message while they keep arriving: a relay that
	// delivers nothing for arrivalStall has lost them (or is stuck).
	// Progress, not a total deadline, so a busy machine's slow relay is
	// measured rather than reported as losing messages.
	last, stalled := -1, time.Now()
	for {
		mu.Lock()
		n := len(recv)
		mu.Unlock()
		if n >= total || ctx.Err() != nil {
			break
		}
		if n != last {
			last, stalled = n, time.Now()
		} else if time.Since(stalled) > arrivalStall {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	*idleClosed = maxIdleClosed(e.db) - closedAtStart
	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, total-warm)
	lost := 0
	for i, id := range ids {
		at, ok := recv[id]
		if !ok {
			lost++
			continue
		}
		if i < warm {
			continue // written during the warm-up: delivered, not counted
		}
		d := at.Sub(committed[i])
		if d < 0 {
			d = 0 // received before the writer's goroutine read the clock
		}
		lat = append(lat, d)
	}
	sortDurations(lat)
	if len(lat) == 0 {
		return nil, lost, errors.New("no message arrived")
	}
	if lag != nil {
		for i := warm; i < total; i++ {
			if committed[i].IsZero() {
				continue // its transaction failed: werr
			}
			*lag = append(*lag, max(0, committed[i].Sub(scheduled[i])))
		}
		sortDurations(*lag)
	}
	if e.tl != nil {
		msgs := e.tl.trace(ids[warm:], committed[warm:], recv)
		*notes = append(*notes, mode.label()+" timeline: "+e.tl.summary(msgs, percentile(lat, 0.99)))
		if err := e.tl.write(cfg.Timeline, mode.label(), msgs); err != nil {
			return nil, 0, fmt.Errorf("timeline: %w", err)
		}
	}
	return lat, lost, nil
}

// writePaced enqueues total one-message transactions at cfg.Rate from
// one schedule, handed to a pool of 8 connections so that a slow commit
// does not delay the next one, recording each transaction's time in the
// schedule and its commit's return. A non-nil after runs with each
// message once its transaction committed, on the same connection's
// goroutine: a slow after holds the next transactions back.
func writePaced(ctx context.Context, e *env, cfg config, topic string, total int, scheduled, committed []time.Time, ids []string, after func(*outbox.Message) error, werr *atomic.Value) {
	jobs := make(chan int, total)
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				m := &outbox.Message{Topic: topic, Key: []byte("k" + strconv.Itoa(i%cfg.Keys)), Value: []byte("v")}
				err := e.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return e.plugin.Enqueue(tx, m) })
				if err != nil {
					werr.Store(err)
					continue
				}
				committed[i], ids[i] = time.Now(), m.ID
				if after != nil {
					if err := after(m); err != nil {
						werr.Store(err)
					}
				}
			}
		}()
	}
	interval := time.Second / time.Duration(cfg.Rate)
	start := time.Now()
	for i := 0; i < total; i++ {
		scheduled[i] = start.Add(time.Duration(i) * interval)
		if d := time.Until(scheduled[i]); d > 0 {
			time.Sleep(d) // pacing the writer, not synchronization
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
}

// writeRules8 runs 8 independent writers, each on its own schedule at an
// eighth of cfg.Rate from a random phase, each creating one LatencyOrder
// per transaction whose publish rule emits the message: what a service
// with concurrent requests does.
func writeRules8(ctx context.Context, e *env, cfg config, total int, scheduled, committed []time.Time, ids []string, werr *atomic.Value) {
	const writers = 8
	interval := writers * time.Second / time.Duration(cfg.Rate)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		phase := time.Duration(rand.Int64N(int64(interval)))
		wg.Go(func() {
			for n, i := 0, w; i < total; n, i = n+1, i+writers {
				scheduled[i] = start.Add(phase + time.Duration(n)*interval)
				if d := time.Until(scheduled[i]); d > 0 {
					time.Sleep(d) // pacing the writer, not synchronization
				}
				token := "t" + strconv.Itoa(i%cfg.Keys) + "-" + strconv.Itoa(i)
				err := e.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
					return tx.Create(&LatencyOrder{Token: token}).Error
				})
				if err != nil {
					werr.Store(err)
					continue
				}
				committed[i], ids[i] = time.Now(), token
			}
		})
	}
	wg.Wait()
}

// startConsumer consumes topic from its end, in a process of its own
// (cfg.Consumer "process") or in this one ("inline"), and calls got with
// each message's key (its message id, or with byValue its value) and the
// time it was received. The returned function stops it.
func startConsumer(ctx context.Context, cfg config, brokers []string, topic string, byValue bool, got func(key string, at time.Time)) (stop func(), err error) {
	if cfg.Consumer == "inline" {
		return consume(ctx, brokers, topic, byValue, got)
	}
	env := []string{"OUTBOX_BENCH_BROKERS=" + strings.Join(brokers, ","), "OUTBOX_BENCH_TOPIC=" + topic}
	if byValue {
		env = append(env, "OUTBOX_BENCH_BY_VALUE=1")
	}
	c, err := startChildLines(ctx, "consumer", env, "READY", func(l string) {
		// "R <key> <unix nanoseconds>": this host's wall clock, the one
		// the writer's commit times are read from.
		f := strings.Fields(l)
		if len(f) != 3 || f[0] != "R" {
			return
		}
		if ns, err := strconv.ParseInt(f[2], 10, 64); err == nil {
			got(f[1], time.Unix(0, ns))
		}
	})
	if err != nil {
		return nil, err
	}
	return c.stop, nil
}

// consume is the latency scenario's consumer: every partition of topic
// from its end.
func consume(ctx context.Context, brokers []string, topic string, byValue bool, got func(key string, at time.Time)) (stop func(), err error) {
	sc := sarama.NewConfig()
	sc.ClientID = "outbox-bench-consumer"
	sc.Version = sarama.V2_1_0_0
	sc.Consumer.MaxWaitTime = 50 * time.Millisecond
	sc.Metadata.AllowAutoTopicCreation = true
	client, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return nil, err
	}
	parts, err := client.Partitions(topic)
	if err != nil {
		client.Close()
		return nil, err
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		client.Close()
		return nil, err
	}
	var (
		wg  sync.WaitGroup
		pcs []sarama.PartitionConsumer
	)
	stop = func() {
		for _, pc := range pcs {
			pc.AsyncClose() // ends its Messages channel, and so its loop
		}
		wg.Wait()
		consumer.Close()
		client.Close()
	}
	for _, p := range parts {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetNewest)
		if err != nil {
			stop()
			return nil, err
		}
		pcs = append(pcs, pc)
		wg.Go(func() {
			for m := range pc.Messages() {
				now := time.Now()
				if byValue {
					got(string(m.Value), now) // the row's token
					continue
				}
				for _, h := range m.Headers {
					if string(h.Key) == publisher.MessageIDHeaderDefault {
						got(string(h.Value), now)
					}
				}
			}
		})
	}
	return stop, nil
}

// runConsumerRole is the latency scenario's consumer process: it prints
// READY once it consumes every partition, then "R <key> <unix ns>" per
// message received, until interrupted.
func runConsumerRole() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var mu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	stopConsume, err := consume(ctx, strings.Split(os.Getenv("OUTBOX_BENCH_BROKERS"), ","), os.Getenv("OUTBOX_BENCH_TOPIC"),
		os.Getenv("OUTBOX_BENCH_BY_VALUE") == "1", func(key string, at time.Time) {
			mu.Lock()
			fmt.Fprintf(out, "R %s %d\n", key, at.UnixNano())
			mu.Unlock()
		})
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench consumer:", err)
		return 1
	}
	fmt.Println("READY")
	// Receipt times are taken before the write, so flushing in batches
	// delays only the report, not the figure.
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			stopConsume()
			mu.Lock()
			_ = out.Flush()
			mu.Unlock()
			return 0
		case <-tick.C:
			mu.Lock()
			err := out.Flush()
			mu.Unlock()
			if err != nil {
				return 1
			}
		}
	}
}

// maxIdleClosed returns how many connections db's pool has closed at its
// idle limit so far; 0 if it has no *sql.DB.
func maxIdleClosed(db *gorm.DB) int64 {
	sqlDB, err := db.DB()
	if err != nil {
		return 0
	}
	return sqlDB.Stats().MaxIdleClosed
}
