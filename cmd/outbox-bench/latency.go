package main

import (
	"bufio"
	"context"
	"database/sql"
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
	// machine, the same run's baseline for the relay's figures. With
	// rules8 (the direct8 mode) the eight writers of rules8 do so, on
	// rules8's schedule: the baseline with rules8's arrivals.
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
	{name: "direct8", rules8: true, direct: true},
}

// defaultLatencyOrder is the order the latency modes run in without
// -latency-modes. The floor, direct, runs first and last, so that the
// relay's modes are measured between two runs of their baseline rather
// than all before it.
var defaultLatencyOrder = []string{"direct", "notify", "rules8", "direct8", "poll", "poll10", "listen", "direct"}

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
	r.Params["pipeline_depth"] = cfg.PipelineDepth
	r.Params["max_idle_conns"] = cfg.MaxIdleConns
	cfg.latencyProfile = cfg.CPUProfile
	r.Params["latency_slice_s"] = cfg.LatencySlice.Seconds()
	var names []string // the modes this driver runs, in -latency-modes order
	for _, name := range cfg.LatencyModes {
		mode := latencyModeNamed(name)
		if mode.listen && cfg.Driver != "postgres" {
			if _, ok := r.Params[mode.name]; !ok {
				r.Params[mode.name] = "skipped: LISTEN/NOTIFY needs PostgreSQL"
				r.Notes = append(r.Notes, mode.name+": skipped, LISTEN/NOTIFY needs PostgreSQL")
			}
			continue
		}
		names = append(names, name)
	}
	pooled := map[string][]time.Duration{}
	lags := map[string][]time.Duration{}   // the writers' lag behind their schedule
	scheds := map[string][]time.Duration{} // schedule → receipt
	poolWaits, poolWaited := map[string]int64{}, map[string]time.Duration{}
	closed := map[string]int64{} // summed over a mode's runs
	var order []string           // the modes' first runs, in order
	if cfg.LatencySlice > 0 {
		seen := map[string]bool{}
		for _, name := range names {
			if !seen[name] {
				seen[name] = true
				order = append(order, name)
			}
		}
		turns, err := measureSliced(ctx, cfg, brokers, order, &r.Notes, pooled, lags, scheds, closed, poolWaits, poolWaited)
		if err != nil {
			return err
		}
		r.Params["latency_turns"] = len(turns)
		// The same comparison turn by turn: each rotation's turn of the
		// mode against direct's turn of the same rotation, the median over
		// the rotations. An event of a few hundred milliseconds (a stall
		// of the machine or the broker) sets a 10 s run's p99 by itself,
		// in whichever mode it falls; it moves one rotation's ratio here.
		for _, m := range []string{"notify", "rules8", "listen", "poll10"} {
			if v, ok := turnRatio(turns, m, "direct"); ok {
				r.add(m+"_turn_p99/direct_turn_p99", v, "ratio")
			}
		}
		if v, ok := turnRatio(turns, "rules8", "direct8"); ok {
			r.add("rules8_turn_p99/direct8_turn_p99", v, "ratio")
		}
	} else {
		runs := map[string]int{}
		for _, name := range names {
			runs[name]++
		}
		seen := map[string]int{}
		for _, name := range names {
			mode := latencyModeNamed(name)
			seen[name]++
			if seen[name] == 1 {
				order = append(order, name)
			}
			if runs[name] > 1 {
				mode.run = seen[name]
			}
			var (
				idleClosed int64
				w          latencyWaits
			)
			lat, err := measureAll(ctx, cfg, brokers, mode, &r.Notes, &idleClosed, &w)
			if err != nil {
				return err
			}
			pooled[name] = append(pooled[name], lat...)
			lags[name] = append(lags[name], w.lag...)
			scheds[name] = append(scheds[name], w.fromSchedule...)
			poolWaits[name] += w.poolWaits
			poolWaited[name] += w.poolWaited
			if runs[name] > 1 {
				// Each run of a repeated mode on its own; the mode's figures
				// below pool them.
				k := mode.label()
				r.add(k+"_p50", ms(percentile(lat, 0.50)), "ms")
				r.add(k+"_p99", ms(percentile(lat, 0.99)), "ms")
			}
			closed[name] += idleClosed
		}
	}
	p99, sp99 := map[string]float64{}, map[string]float64{}
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
		sched := scheds[name]
		sortDurations(sched)
		sp99[name] = ms(percentile(sched, 0.99))
		r.add(name+"_sched_p50", ms(percentile(sched, 0.50)), "ms")
		r.add(name+"_sched_p99", sp99[name], "ms")
		r.add(name+"_pool_waits", float64(poolWaits[name]), "waits")
		r.add(name+"_pool_wait_ms", ms(poolWaited[name]), "ms")
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
	// rules8 against the direct writers with its own arrivals: eight
	// writers on independent schedules, whose commits bunch, where direct's
	// one paced schedule spaces them evenly.
	if v, base := p99["rules8"], p99["direct8"]; v > 0 && base > 0 {
		r.add("rules8_p99/direct8_p99", v/base, "ratio")
	}
	// The same from each message's place in the writers' schedule: a
	// writer that falls behind (direct's publishes hold its next
	// transactions back) counts its wait here too.
	if base := sp99["direct"]; base > 0 {
		for _, m := range []string{"notify", "rules8", "listen", "poll10"} {
			if v, ok := sp99[m]; ok {
				r.add(m+"_sched_p99/direct_sched_p99", v/base, "ratio")
			}
		}
	}
	if v, base := sp99["rules8"], sp99["direct8"]; v > 0 && base > 0 {
		r.add("rules8_sched_p99/direct8_sched_p99", v/base, "ratio")
	}
	return nil
}

// measureSliced runs the modes named in order side by side: it sets up
// every mode's run (openLatencyRun: its own database, topic, consumer and
// relay or publisher), then writes them in turns of cfg.LatencySlice
// each, the order of the turns reversed every rotation, until every mode
// wrote its cfg.Warmup + cfg.Duration; each turn's messages are
// delivered before the next turn starts. A mode's figures then come from
// slices spread over the whole run rather than from one stretch of it:
// what the machine, PostgreSQL and the broker do over the run (another
// process's burst, a checkpoint, a log segment rolled) falls on every
// mode alike, and so does the run's start on fresh topics. The relays
// of the modes not writing stay up, idle but for their polls and lease
// renewals, as they would between bursts.
// With cfg.CPUProfile, one profile covers all the turns:
// CPUProfile.sliced. It returns the turns in the order they ran.
func measureSliced(ctx context.Context, cfg config, brokers []string, order []string, notes *[]string, pooled, lags, scheds map[string][]time.Duration, closed, poolWaits map[string]int64, poolWaited map[string]time.Duration) ([]latencyTurn, error) {
	runs := make([]*latencyRun, 0, len(order))
	defer func() {
		for i := len(runs) - 1; i >= 0; i-- {
			runs[i].close()
		}
	}()
	for _, name := range order {
		mode := latencyModeNamed(name)
		lr, err := openLatencyRun(ctx, cfg, brokers, mode, benchTopic+"-latency-"+mode.name, notes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		runs = append(runs, lr)
	}
	if cfg.latencyProfile != "" {
		stop, err := startCPUProfile(cfg.latencyProfile + ".sliced")
		if err != nil {
			return nil, err
		}
		defer stop()
	}
	per := sliceMessages(cfg)
	var turns []latencyTurn
	for turn := 0; ; turn++ {
		rotation := slices.Clone(runs)
		if turn%2 == 1 {
			slices.Reverse(rotation)
		}
		wrote := false
		for _, lr := range rotation {
			if lr.remaining() == 0 {
				continue
			}
			wrote = true
			t := latencyTurn{mode: lr.mode.name, from: lr.written, start: time.Now()}
			if err := lr.slice(ctx, per); err != nil {
				return nil, err
			}
			t.to, t.end = lr.written, time.Now()
			lr.mu.Lock()
			t.arrived = len(lr.recv)
			lr.mu.Unlock()
			turns = append(turns, t)
		}
		if !wrote {
			break
		}
	}
	for _, lr := range runs {
		var (
			idleClosed int64
			w          latencyWaits
		)
		lat, lost, err := lr.result(notes, &idleClosed, &w)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", lr.mode.name, err)
		}
		if lost > 0 {
			return nil, fmt.Errorf("%s: %d messages never arrived", lr.mode.name, lost)
		}
		pooled[lr.mode.name], closed[lr.mode.name] = lat, idleClosed
		lags[lr.mode.name], scheds[lr.mode.name] = w.lag, w.fromSchedule
		poolWaits[lr.mode.name], poolWaited[lr.mode.name] = w.poolWaits, w.poolWaited
		for i := range turns {
			if turns[i].mode == lr.mode.name {
				turns[i].p99 = lr.p99(turns[i].from, turns[i].to)
			}
		}
	}
	return turns, nil
}

// latencyTurn is one turn of measureSliced: mode wrote its messages
// from..to-1 between start and end; arrived is how many of the mode's
// messages had arrived by end (all of them, to, unless the delivery
// stalled). p99 is commit → receipt of its counted messages (0 for a
// turn of the warm-up).
type latencyTurn struct {
	mode       string
	from, to   int
	start, end time.Time
	arrived    int
	p99        time.Duration
}

// p99 is commit → receipt p99 of the counted messages from..to-1 that
// arrived; 0 if there are none.
func (lr *latencyRun) p99(from, to int) time.Duration {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	var lat []time.Duration
	for i := max(from, lr.warm); i < to; i++ {
		if at, ok := lr.recv[lr.ids[i]]; ok && !lr.committed[i].IsZero() {
			lat = append(lat, max(0, at.Sub(lr.committed[i])))
		}
	}
	if len(lat) == 0 {
		return 0
	}
	sortDurations(lat)
	return percentile(lat, 0.99)
}

// turnRatio pairs mode's counted turns with base's, the k-th with the
// k-th (the same rotation), and returns the median of mode's turn p99 ÷
// base's; false if the two have no pair of counted turns.
func turnRatio(turns []latencyTurn, mode, base string) (float64, bool) {
	var a, b []time.Duration
	for _, t := range turns {
		switch {
		case t.p99 <= 0:
		case t.mode == mode:
			a = append(a, t.p99)
		case t.mode == base:
			b = append(b, t.p99)
		}
	}
	n := min(len(a), len(b))
	if n == 0 {
		return 0, false
	}
	ratios := make([]float64, n)
	for k := range n {
		ratios[k] = float64(a[k]) / float64(b[k])
	}
	slices.Sort(ratios)
	if n%2 == 1 {
		return ratios[n/2], true
	}
	return (ratios[n/2-1] + ratios[n/2]) / 2, true
}

// sliceMessages is how many messages one turn of measureSliced writes:
// cfg.LatencySlice at cfg.Rate, at least one.
func sliceMessages(cfg config) int {
	return max(1, int(float64(cfg.Rate)*cfg.LatencySlice.Seconds()))
}

// arrivalStall is how long the latency scenario waits, after the writers
// finished, for a next message to arrive before it counts the missing
// ones as never arrived. It is longer than the Franz publisher takes to
// give up a client stuck on records without a result and republish them
// (FranzConfig.StallTimeout, 45 s, and a watchdog tick), so that a
// recovery on a busy machine is not counted as a loss.
const arrivalStall = 2 * time.Minute

// measureAll is measureLatency on mode's topic, failing unless every
// message arrived.
func measureAll(ctx context.Context, cfg config, brokers []string, mode latencyMode, notes *[]string, idleClosed *int64, waits *latencyWaits) ([]time.Duration, error) {
	lat, lost, err := measureLatency(ctx, cfg, brokers, mode, benchTopic+"-latency-"+mode.name, notes, idleClosed, waits)
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

// rules8Message is the message of rules8's publish rule for token
// ("t<key>-<n>"): its key is "k<key>", its value the token.
func rules8Message(topic, token string) *outbox.Message {
	return &outbox.Message{Topic: topic, Key: []byte("k" + strings.SplitN(token[1:], "-", 2)[0]), Value: []byte(token)}
}

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
	pub   benchPublisher
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
	pub, err := newPublisher(ctx, brokers, e.tl.franzOpts()...)
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
	err := poll(ctx, setupTimeout, 5*time.Millisecond, func() (bool, error) { return len(rl.Leases()) >= n, nil })
	if errors.Is(err, errPollTimeout) {
		return fmt.Errorf("relay owns %d of %d buckets after %s", len(rl.Leases()), n, setupTimeout)
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
	// to look for work, of which there is none yet. A NOTIFY that times
	// out (pgnotify's Timeout, 5 s: on a loaded server, behind other
	// sessions' NOTIFY commits) is sent again, for up to a minute: it
	// only warms the connection up.
	var sent error
	err = poll(ctx, time.Minute, 100*time.Millisecond, func() (bool, error) {
		sent = transport.Publish(ctx, []int{outbox.UnknownBucket})
		switch {
		case sent == nil:
			return true, nil
		case errors.Is(sent, context.DeadlineExceeded) && ctx.Err() == nil:
			return false, nil
		}
		return false, sent
	})
	if errors.Is(err, errPollTimeout) {
		err = sent
	}
	if err != nil {
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
// return → consumer receipt for each message written after the warm-up:
// openLatencyRun, then every message in one slice.
//
// A non-nil waits receives the counted messages' latencyWaits.
//
// idleClosed receives how many connections the bench process's pool (the
// writer's and, but for listen, the relay's) closed at its idle limit
// while the messages were written and delivered (sql.DBStats.MaxIdleClosed).
func measureLatency(ctx context.Context, cfg config, brokers []string, mode latencyMode, topic string, notes *[]string, idleClosed *int64, waits *latencyWaits) ([]time.Duration, int, error) {
	lr, err := openLatencyRun(ctx, cfg, brokers, mode, topic, notes)
	if err != nil {
		return nil, 0, err
	}
	defer lr.close()
	if cfg.latencyProfile != "" {
		stop, err := startCPUProfile(cfg.latencyProfile + "." + mode.label())
		if err != nil {
			return nil, 0, err
		}
		defer stop()
	}
	if err := lr.slice(ctx, lr.total); err != nil {
		return nil, 0, err
	}
	return lr.result(notes, idleClosed, waits)
}

// latencyRun is one mode's run of the latency scenario: its database,
// relay, consumer and topic, set up once, and the messages it writes in
// one or more slices (slice), each slice delivered before it returns.
//
// With cfg.Timeline it also records each message's path through the
// relay (not for listen, whose relay runs elsewhere; for direct, the
// writer's publish); result writes it there and appends a summary of the
// slowest messages to the notes.
type latencyRun struct {
	cfg   config
	mode  latencyMode
	topic string
	e     *env
	// after publishes a committed message itself (direct).
	after func(*outbox.Message) error
	// warm of the total messages are written first and not counted.
	warm, total int
	// written is how many messages the slices wrote so far.
	written              int
	scheduled, committed []time.Time
	ids                  []string
	werr                 atomic.Value
	closedAtStart        int64
	poolAtStart          sql.DBStats
	closers              []func() // run in reverse by close
	mu                   sync.Mutex
	recv                 map[string]time.Time
	// cpu is the machine's and this process's CPU over the slices, from
	// the first write to the last message's receipt.
	cpu cpuUse
}

// close stops what openLatencyRun started, in reverse.
func (lr *latencyRun) close() {
	for i := len(lr.closers) - 1; i >= 0; i-- {
		lr.closers[i]()
	}
	lr.closers = nil
}

// directRetryFor bounds how long the direct writer retries a publish
// that failed for a while only.
const directRetryFor = time.Minute

// publishDirect publishes msgs as a writer publishing for itself does: a
// failure that is not the message's own (the relay would retry it: the
// brokers unavailable, a partition's leader moving, as on a busy cluster
// right after the topic's creation) is retried every 10 ms, for up to
// directRetryFor, and the wait counts in the message's latency.
func publishDirect(ctx context.Context, pub relay.Publisher, msgs []relay.Message) error {
	deadline := time.Now().Add(directRetryFor)
	for {
		_, err := pub.Publish(ctx, msgs)
		if err == nil || relay.IsPermanent(err) || relay.IsMisconfiguration(err) || !time.Now().Before(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// openLatencyRun sets up mode's run on topic: a fresh database with the
// outbox, the consumer, the relay (owning every bucket) or the direct
// publisher, and for listen the NOTIFY sender, so that the first measured
// commit pays for none of them.
func openLatencyRun(ctx context.Context, cfg config, brokers []string, mode latencyMode, topic string, notes *[]string) (_ *latencyRun, err error) {
	lr := &latencyRun{cfg: cfg, mode: mode, topic: topic, recv: map[string]time.Time{}}
	defer func() {
		if err != nil {
			lr.close()
		}
	}()
	var rules []outbox.Rule
	if mode.rules8 {
		rules = append(rules, outbox.OnCreate(func(c outbox.Change[*LatencyOrder]) (*outbox.Message, error) {
			return rules8Message(topic, c.Entity.Token), nil
		}))
	}
	ecfg := cfg
	ecfg.walMode = mode.wal
	e, err := newEnv(ctx, ecfg, rules...)
	if err != nil {
		return nil, err
	}
	lr.e = e
	lr.closers = append(lr.closers, e.close)
	if mode.rules8 {
		if err := e.db.WithContext(ctx).AutoMigrate(&LatencyOrder{}); err != nil {
			return nil, err
		}
	}
	got := func(key string, at time.Time) {
		lr.mu.Lock()
		lr.recv[key] = at
		lr.mu.Unlock()
	}
	stopConsumer, err := startConsumer(ctx, cfg, brokers, topic, mode.rules8, got)
	if err != nil {
		return nil, err
	}
	lr.closers = append(lr.closers, stopConsumer)
	if cfg.Timeline != "" && !mode.listen {
		e.tl = newTimeline(func(m relay.Message) string {
			if mode.rules8 {
				return string(m.Value)
			}
			return m.MessageID
		})
		e.tl.franz = newFranzTrace(franzRecordKey(mode.rules8))
		stopProbe := make(chan struct{})
		go e.tl.probe(stopProbe)
		lr.closers = append(lr.closers, func() { close(stopProbe) })
	}
	var rl latencyRelay
	if mode.direct {
		pub, err := newPublisher(ctx, brokers, e.tl.franzOpts()...)
		if err != nil {
			return nil, err
		}
		lr.closers = append(lr.closers, func() { pub.Close() })
		var dpub relay.Publisher = pub
		if e.tl != nil {
			// The writer's publishes, timed as the relay's are: the same
			// produce → acknowledgement step without a relay.
			dpub = timedPub{pub, e.tl}
		}
		lr.after = func(m *outbox.Message) error {
			msg := []relay.Message{{MessageID: m.ID, Topic: m.Topic, Key: m.Key, Value: m.Value, CreatedAt: time.Now()}}
			return publishDirect(ctx, dpub, msg)
		}
	} else {
		var before func() error
		if mode.rrBacklog > 0 {
			before = func() error {
				if err := e.prefill(ctx, mode.rrBacklog); err != nil {
					return err
				}
				end, err := e.startRR(ctx)
				if err == nil {
					lr.closers = append(lr.closers, end) // after the relay stops
				}
				return err
			}
		}
		rl, err = startLatencyRelay(ctx, e, cfg, brokers, mode, before)
		if err != nil {
			return nil, err
		}
		lr.closers = append(lr.closers, rl.stop)
		if mode.rrBacklog > 0 {
			err := poll(ctx, 10*time.Minute, 20*time.Millisecond, func() (bool, error) { return rl.acked.acked.Load() >= int64(mode.rrBacklog), nil })
			if err != nil {
				return nil, fmt.Errorf("backlog of %d not relayed: %w", mode.rrBacklog, err)
			}
		}
	}
	if mode.listen {
		stopSender, err := startNotifySender(ctx, e, rl.channel)
		if err != nil {
			return nil, err
		}
		lr.closers = append(lr.closers, stopSender)
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
	lr.warm = int(float64(cfg.Rate) * cfg.Warmup.Seconds())
	lr.total = lr.warm + int(float64(cfg.Rate)*cfg.Duration.Seconds())
	lr.committed = make([]time.Time, lr.total)
	lr.scheduled = make([]time.Time, lr.total)
	lr.ids = make([]string, lr.total)
	lr.closedAtStart = maxIdleClosed(e.db)
	lr.poolAtStart = poolStats(e.db)
	return lr, nil
}

// remaining is how many of the run's messages no slice wrote yet.
func (lr *latencyRun) remaining() int { return lr.total - lr.written }

// slice writes the run's next n messages (fewer if fewer remain) at
// cfg.Rate, on a schedule starting now, and returns once every message
// the run wrote has arrived, or none arrived for arrivalStall (result
// counts the missing ones as lost).
func (lr *latencyRun) slice(ctx context.Context, n int) error {
	from := lr.written
	to := min(lr.total, from+n)
	c0, t0 := readCPU(), time.Now()
	defer func() { lr.cpu.add(c0, readCPU(), time.Since(t0)) }()
	if lr.mode.rules8 {
		writeRules8(ctx, lr.e, lr.cfg, lr.topic, from, to, lr.scheduled, lr.committed, lr.ids, lr.after, &lr.werr)
	} else {
		writePaced(ctx, lr.e, lr.cfg, lr.topic, from, to, lr.scheduled, lr.committed, lr.ids, lr.after, &lr.werr)
	}
	lr.written = to
	if err, _ := lr.werr.Load().(error); err != nil {
		return fmt.Errorf("%s: %w", lr.mode.name, err)
	}
	// Wait for every message while they keep arriving: a relay that
	// delivers nothing for arrivalStall has lost them (or is stuck).
	// Progress, not a total deadline, so a busy machine's slow relay is
	// measured rather than reported as losing messages.
	last, stalled := -1, time.Now()
	for {
		lr.mu.Lock()
		n := len(lr.recv)
		lr.mu.Unlock()
		if n >= to || ctx.Err() != nil {
			return ctx.Err()
		}
		if n != last {
			last, stalled = n, time.Now()
		} else if time.Since(stalled) > arrivalStall {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// latencyWaits are, per counted message of a latency run, sorted: lag, how
// far behind its schedule its commit returned (the time it waited to be
// written because the writers were busy, which commit → receipt does not
// count); fromSchedule, its place in the schedule → receipt, the lag
// included.
//
// poolWaits and poolWaited are how often and how long, in all, the bench
// process's pool of the run (the writers' and, but for listen, the
// relay's connections) made a caller wait for a connection at its open
// limit while the run wrote and delivered its messages.
type latencyWaits struct {
	lag, fromSchedule []time.Duration
	poolWaits         int64
	poolWaited        time.Duration
}

// result is commit return → receipt of every counted message the run
// wrote, sorted, and how many of its messages never arrived. A non-nil
// waits receives the messages' latencyWaits; idleClosed what
// measureLatency describes.
func (lr *latencyRun) result(notes *[]string, idleClosed *int64, waits *latencyWaits) ([]time.Duration, int, error) {
	*idleClosed = maxIdleClosed(lr.e.db) - lr.closedAtStart
	lr.mu.Lock()
	defer lr.mu.Unlock()
	warm, ids := lr.warm, lr.ids[:lr.written]
	lat := make([]time.Duration, 0, max(0, len(ids)-warm))
	lost := 0
	for i, id := range ids {
		at, ok := lr.recv[id]
		if !ok {
			lost++
			continue
		}
		if i < warm {
			continue // written during the warm-up: delivered, not counted
		}
		d := at.Sub(lr.committed[i])
		if d < 0 {
			d = 0 // received before the writer's goroutine read the clock
		}
		lat = append(lat, d)
	}
	sortDurations(lat)
	if len(lat) == 0 {
		return nil, lost, errors.New("no message arrived")
	}
	if waits != nil {
		now := poolStats(lr.e.db)
		waits.poolWaits = now.WaitCount - lr.poolAtStart.WaitCount
		waits.poolWaited = now.WaitDuration - lr.poolAtStart.WaitDuration
		for i := warm; i < len(ids); i++ {
			if lr.committed[i].IsZero() {
				continue // its transaction failed: werr
			}
			waits.lag = append(waits.lag, max(0, lr.committed[i].Sub(lr.scheduled[i])))
			if at, ok := lr.recv[ids[i]]; ok {
				waits.fromSchedule = append(waits.fromSchedule, max(0, at.Sub(lr.scheduled[i])))
			}
		}
		sortDurations(waits.lag)
		sortDurations(waits.fromSchedule)
	}
	*notes = append(*notes, lr.mode.label()+" "+lr.cpu.String()+", from its slices' first writes to their last receipts")
	if e := lr.e; e.tl != nil && len(ids) > warm {
		msgs := e.tl.trace(ids[warm:], lr.committed[warm:len(ids)], lr.recv)
		*notes = append(*notes, lr.mode.label()+" timeline: "+e.tl.summary(msgs, percentile(lat, 0.99)))
		if err := e.tl.write(lr.cfg.Timeline, lr.mode.label(), msgs); err != nil {
			return nil, 0, fmt.Errorf("timeline: %w", err)
		}
	}
	return lat, lost, nil
}

// writePaced enqueues the one-message transactions from..to-1 at cfg.Rate
// from one schedule starting now, handed to a pool of 8 connections so
// that a slow commit does not delay the next one, recording each
// transaction's time in the schedule and its commit's return. A non-nil
// after runs with each message once its transaction committed, on the
// same connection's goroutine: a slow after holds the next transactions
// back.
func writePaced(ctx context.Context, e *env, cfg config, topic string, from, to int, scheduled, committed []time.Time, ids []string, after func(*outbox.Message) error, werr *atomic.Value) {
	jobs := make(chan int, to-from)
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
	for i := from; i < to; i++ {
		scheduled[i] = start.Add(time.Duration(i-from) * interval)
		if d := time.Until(scheduled[i]); d > 0 {
			time.Sleep(d) // pacing the writer, not synchronization
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
}

// writeRules8 runs 8 independent writers over the transactions from..to-1,
// each on its own schedule at an eighth of cfg.Rate from a random phase,
// each creating one LatencyOrder per transaction whose publish rule emits
// the message: what a service with concurrent requests does.
func writeRules8(ctx context.Context, e *env, cfg config, topic string, from, to int, scheduled, committed []time.Time, ids []string, after func(*outbox.Message) error, werr *atomic.Value) {
	const writers = 8
	interval := writers * time.Second / time.Duration(cfg.Rate)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		phase := time.Duration(rand.Int64N(int64(interval)))
		wg.Go(func() {
			for n, i := 0, from+w; i < to; n, i = n+1, i+writers {
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
				if after != nil {
					if err := after(rules8Message(topic, token)); err != nil {
						werr.Store(err)
					}
				}
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
// consumePartition starts consuming partition p of topic at its newest
// offset. A topic just created can still answer with a partition whose
// leader the brokers have not all learnt yet (NotLeaderForPartition,
// LeaderNotAvailable): the metadata is refreshed and the request tried
// again, for up to a minute or until ctx ends.
func consumePartition(ctx context.Context, client sarama.Client, consumer sarama.Consumer, topic string, p int32) (sarama.PartitionConsumer, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetNewest)
		if err == nil {
			return pc, nil
		}
		if !errors.Is(err, sarama.ErrNotLeaderForPartition) && !errors.Is(err, sarama.ErrLeaderNotAvailable) &&
			!errors.Is(err, sarama.ErrUnknownTopicOrPartition) || !time.Now().Before(deadline) {
			return nil, err
		}
		_ = client.RefreshMetadata(topic)
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

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
		pc, err := consumePartition(ctx, client, consumer, topic, p)
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

// poolStats returns db's pool statistics; zero if it has no *sql.DB.
func poolStats(db *gorm.DB) sql.DBStats {
	sqlDB, err := db.DB()
	if err != nil {
		return sql.DBStats{}
	}
	return sqlDB.Stats()
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
