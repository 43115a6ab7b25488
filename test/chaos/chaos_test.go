// Package chaos_test is the chaos suite of gorm-outbox: writers enqueue
// messages with per-key sequence numbers in business transactions on
// PostgreSQL while three relay processes (built from
// test/chaos/cmd/chaos-relay) drain them to an in-process Kafka-protocol
// cluster of three brokers, and a fault injector kills, stops and pauses
// the relays, terminates their database backends and makes the brokers
// misbehave. At the end a consumer reads the topic back and the test counts
// what was lost (must be 0), duplicated, and delivered out of order.
//
// See RELIABILITY.md at the root of the repository for how to run it and
// for the figures.
package chaos_test

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// Environment variables.
const (
	// EnvSoak selects the long run: 1,000,000 messages by default.
	EnvSoak = "OUTBOX_SOAK"
	// EnvMessages overrides the number of messages.
	EnvMessages = "OUTBOX_CHAOS_MESSAGES"
	// EnvRate overrides the writers' combined pace in messages per second.
	EnvRate = "OUTBOX_CHAOS_RATE"
	// EnvSeed fixes the fault injector's random seed (logged on every run).
	EnvSeed = "OUTBOX_CHAOS_SEED"
	// EnvLogDir keeps the relays' logs in this directory instead of a
	// temporary one.
	EnvLogDir = "OUTBOX_CHAOS_LOGDIR"
	// EnvMarkerBytes sets the strict relays' MarkerMaxBytes: 64 records
	// every batch of more than about 35 rows as its span.
	EnvMarkerBytes = "OUTBOX_CHAOS_MARKER_BYTES"
)

// params sizes one chaos run.
type params struct {
	strict bool
	// franz: the relays publish through publisher.Franz, a bucket's
	// batches overlapping in flight (relay.Pipeliner), in default mode.
	franz   bool
	soak    bool
	network bool // relays in network namespaces, network faults only (TestChaosNetwork)
	// pgRestart: a PostgreSQL server of the test's own, restarted by the
	// injector, the only fault (TestChaosPostgresRestart).
	pgRestart bool
	// netKafka: with network, an Apache Kafka cluster of the test's own
	// whose brokers each relay reaches over a link per broker
	// (TestChaosNetworkKafka).
	netKafka *netCluster

	messages   int
	keys       int
	writers    int
	maxPerTx   int     // messages per business transaction: 1..maxPerTx
	rate       float64 // writers' combined pace, messages/s
	buckets    int
	relays     int
	brokers    int
	partitions int32
	batch      int
	lease      time.Duration
	renew      time.Duration
	faultEvery time.Duration // mean time between two faults
	minChaos   time.Duration // faults go on at least this long
	drainLimit time.Duration // after healing, the backlog must be gone within this
	seed       uint64
}

func loadParams(t *testing.T, strict bool) params {
	p := params{
		strict:     strict,
		messages:   50_000,
		keys:       256,
		writers:    4,
		maxPerTx:   20,
		buckets:    16,
		relays:     3,
		brokers:    3,
		partitions: 6,
		batch:      200,
		lease:      2 * time.Second,
		renew:      500 * time.Millisecond,
		faultEvery: 600 * time.Millisecond,
		minChaos:   20 * time.Second,
		drainLimit: 90 * time.Second,
	}
	if v := os.Getenv(EnvSoak); v != "" && v != "0" {
		p.soak = true
		p.messages = 1_000_000
		p.keys = 2000
		p.writers = 8
		p.drainLimit = 10 * time.Minute
	}
	if v := os.Getenv(EnvMessages); v != "" {
		n, err := strconv.Atoi(v)
		require.NoError(t, err, EnvMessages)
		p.messages = n
	}
	// The writers spread the messages over the chaos window; the soak
	// writes as fast as the pace below allows.
	p.rate = float64(p.messages) / p.minChaos.Seconds()
	if p.soak {
		p.rate = 4000
		p.minChaos = time.Duration(float64(p.messages)/p.rate*float64(time.Second)) + 10*time.Second
	}
	if v := os.Getenv(EnvRate); v != "" {
		r, err := strconv.ParseFloat(v, 64)
		require.NoError(t, err, EnvRate)
		p.rate = r
	}
	p.seed = uint64(time.Now().UnixNano())
	if v := os.Getenv(EnvSeed); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, EnvSeed)
		p.seed = s
	}
	return p
}

// TestChaos runs the chaos suite with the default Kafka publisher
// (idempotent producer, at-least-once): no message may be lost; duplicates
// and per-key order violations are counted and reported, not failed on,
// because a takeover while a publish is in flight can deliver a late copy
// after the new owner's (docs/design.md, "What the guarantees mean").
func TestChaos(t *testing.T) {
	t.Parallel()
	runChaos(t, loadParams(t, false))
}

// TestChaosFranz runs the chaos suite with publisher.Franz, whose
// producer keeps several requests in flight and with which the relay
// keeps several batches of a bucket in flight (Config.PipelineDepth): no
// message may be lost, and no key may be reordered other than by a late
// copy near a takeover, as with the default publisher: the per-key gates
// of the relay and of the publisher hold under kills, backend kills,
// pauses and broker faults.
func TestChaosFranz(t *testing.T) {
	t.Parallel()
	p := loadParams(t, false)
	p.franz = true
	runChaos(t, p)
}

// TestChaosStrict runs the chaos suite in strict mode: every batch is one
// Kafka transaction of its bucket's transactional producer, and the
// consumer reads committed records only. No message may be lost, none may
// be delivered twice (each transaction's progress marker tells the next
// owner of the bucket which rows Kafka holds), and no key may be delivered
// out of order.
func TestChaosStrict(t *testing.T) {
	t.Parallel()
	runChaos(t, loadParams(t, true))
}

// order is the business row written with each message.
type order struct {
	ID    int64  `gorm:"primaryKey"`
	K     string `gorm:"column:k;type:varchar(32);not null;uniqueIndex:chaos_orders_k_seq,priority:1"`
	Seq   int32  `gorm:"column:seq;not null;uniqueIndex:chaos_orders_k_seq,priority:2"`
	MsgID string `gorm:"column:msg_id;type:varchar(64);not null;uniqueIndex"`
}

func (order) TableName() string { return "chaos_orders" }

func keyName(k int) string { return fmt.Sprintf("key-%05d", k) }

func runChaos(t *testing.T, p params) {
	var pgc *pgCluster
	if p.pgRestart {
		pgc = startPGCluster(t)
	} else {
		dbtest.Require(t, dbtest.Postgres)
	}
	mode := "default"
	switch {
	case p.strict:
		mode = "strict"
	case p.franz:
		mode = "franz"
	}
	t.Logf("chaos %s: seed %d (rerun with %s=%d), %d messages over %d keys at %.0f/s, %d relays, %d brokers, %d buckets, %d partitions, lease %s",
		mode, p.seed, EnvSeed, p.seed, p.messages, p.keys, p.rate, p.relays, p.brokers, p.buckets, p.partitions, p.lease)
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	// The database: the outbox and the business table in a fresh schema.
	var d *dbtest.DB
	if pgc != nil {
		d = pgc.open(t)
	} else {
		d = dbtest.Open(t, dbtest.Postgres)
	}
	plugin, err := outbox.NewPlugin(outbox.Config{BucketCount: p.buckets, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, d.DB.Use(plugin))
	require.NoError(t, plugin.AutoMigrate(ctx, d.DB))
	require.NoError(t, d.DB.AutoMigrate(&order{}))
	sqlDB, err := d.DB.DB()
	require.NoError(t, err)
	sqlDB.SetMaxOpenConns(p.writers + 4)
	tables := plugin.Config().Tables

	// The network of the network-fault run, and the term guard's audit.
	var lab *netLab
	var audit *deleteAudit
	if p.network && p.netKafka != nil {
		lab = newNetLabBrokers(t, p.relays, p.seed, p.netKafka.addrs.brokerIPs)
	} else if p.network {
		lab = newNetLab(t, p.relays, p.seed)
	}
	if p.network || p.pgRestart {
		audit = installDeleteAudit(t, d.DB, tables.MessagesTable(), tables.LeasesTable())
	}

	// The cluster: kfake in this process, so that the test can break it
	// from inside, or the Apache Kafka cluster of scripts/kafka.sh, whose
	// broker processes it kills, stops and resumes. The network-fault run
	// has kfake listen on its network's brokers' address.
	var (
		brokers func() []string
		topic   string
		real    *realBrokers
		fake    *kfake.Cluster
	)
	if lab != nil && p.netKafka != nil {
		topic = p.netKafka.cluster.Topic(t, p.partitions)
		brokers = p.netKafka.brokers
	} else if lab != nil {
		topic = "chaos-net-" + d.Namespace
		var err error
		fake, err = kfake.NewCluster(kfake.NumBrokers(p.brokers), kfake.ListenFn(lab.listen), kfake.SeedTopics(p.partitions, topic))
		require.NoError(t, err)
		t.Cleanup(fake.Close)
		brokers = fake.ListenAddrs
	} else {
		cluster := kafkatest.Start(t, kafkatest.NumBrokers(p.brokers))
		topic = cluster.Topic(t, p.partitions)
		real = newRealBrokers(t, cluster, topic)
		fake = cluster.Fake()
		brokers = cluster.Brokers
	}
	nodeIDs := map[string]int32{}
	if fake != nil {
		for i, a := range fake.ListenAddrs() {
			nodeIDs[a] = int32(i) // kfake numbers its initial brokers in order
		}
	} else if real != nil {
		p.brokers = real.nodes
		// A stopped broker is fenced only after the session timeout and a
		// restarted one takes seconds to rejoin: a longer window lets each
		// kind of real broker fault happen more than once.
		if p.minChaos < 45*time.Second && !p.soak {
			p.minChaos = 45 * time.Second
			if os.Getenv(EnvRate) == "" {
				p.rate = float64(p.messages) / p.minChaos.Seconds()
			}
		}
		t.Logf("chaos %s: on Apache Kafka (%s), %d nodes; faults for %s at %.0f messages/s", mode, strings.Join(brokers(), ","), real.nodes, p.minChaos, p.rate)
	}

	// The relays.
	bin := relayBinary(t)
	t.Logf("chaos: relay command built in %s (race=%v)", buildDur.Round(time.Millisecond), raceEnabled)
	logDir := os.Getenv(EnvLogDir)
	if logDir == "" {
		logDir = t.TempDir()
	} else {
		logDir = fmt.Sprintf("%s/%s-%d", logDir, mode, time.Now().Unix())
		require.NoError(t, os.MkdirAll(logDir, 0o755))
		t.Logf("chaos: relay logs in %s", logDir)
	}
	events := &eventLog{}
	pr := &procs{
		t: t,
		args: relayArgs{
			bin:     bin,
			dsn:     d.DSN,
			tag:     "chaos-" + d.Namespace,
			brokers: brokers,
			logDir:  logDir,
			net:     lab,
			flags: []string{
				"-mode", mode,
				"-txn-prefix", "chaos-" + d.Namespace + "-",
				"-buckets", strconv.Itoa(p.buckets),
				"-batch", strconv.Itoa(p.batch),
				"-lease", p.lease.String(),
				"-renew", p.renew.String(),
				"-poll", chaosPoll.String(),
				"-backoff-min", "50ms",
				"-backoff-max", "1s",
				"-marker-max-bytes", cmp.Or(os.Getenv(EnvMarkerBytes), "0"),
			},
		},
		slots: make([]*relayProc, p.relays),
		log:   events,
	}
	if lab != nil {
		dsnFor, err := lab.dbDSN(d.DSN)
		require.NoError(t, err)
		pr.args.dsnFor = dsnFor
	}
	t.Cleanup(pr.killAll)
	for i := range p.relays {
		pr.start(i)
	}

	// The fault injector.
	in := &injector{
		t:          t,
		rng:        rand.New(rand.NewPCG(p.seed, p.seed^0x9e3779b97f4a7c15)),
		procs:      pr,
		fake:       fake,
		real:       real,
		partitions: p.partitions,
		db:         d.DB,
		log:        events,
		lease:      p.lease,
		every:      p.faultEvery,
		nodeIDs:    nodeIDs,
	}
	if lab != nil {
		in.net = &netInjector{lab: lab, active: map[int]string{}, cluster: p.netKafka, topic: topic}
	}
	if pgc != nil {
		in.pg = &pgRestarter{c: pgc}
	}
	stop := startFaults(t, in)

	// The writers.
	written, writeErrs := runWriters(ctx, t, d.DB, plugin, topic, p)
	writeTime := time.Since(start)
	t.Logf("chaos: %d messages written in %s (%d transaction retries)", written, writeTime.Round(time.Millisecond), writeErrs)

	// Keep the faults going for the rest of the chaos window, then heal.
	sleepUntil(ctx, start, p.minChaos)
	stop()
	// The last fault, with a backlog the relays cannot drain before it
	// heals, so that the resumption below is measured: a stale relay's
	// deletes landing while its buckets' new owners hold them (see
	// staleRelay), or a crash of the database server right after messages
	// were written.
	healStart, atHeal := time.Time{}, int64(-1)
	switch {
	case lab != nil:
		lastFault(t, "a stale relay's statements land under the new owners' leases", events, func() {
			var n int
			n, atHeal, healStart = staleRelay(t, lab, d.DB, plugin, topic, tables.LeasesTable(), tables.MessagesTable(), p.lease, p.buckets)
			written += n
		})
	case pgc != nil:
		lastFault(t, evPGRestartImmediate, events, func() {
			// One transaction, then the crash at once.
			written += crashWithBacklog(t, d.DB, sqlDB, p.writers+4, plugin, topic, pgc, 5000, 5000)
		})
	}
	chaosTime := time.Since(start)

	// Everything must drain once the faults stop, and the relays must be
	// live again quickly: progress within the liveness bound.
	if healStart.IsZero() {
		healStart = time.Now()
	}
	live := waitEmpty(t, d.DB, tables.MessagesTable(), p.drainLimit, healStart, atHeal)
	if real != nil {
		real.endQuiet() // the other test may break brokers again
	}
	remaining := live.remaining
	drainTime := time.Since(healStart)
	polls := livenessPolls
	if p.network || p.pgRestart {
		polls = networkLivenessPolls
	}
	bound, boundNote := withMetadataRefresh(p.lease+time.Duration(polls)*chaosPoll, real)
	t.Logf("chaos liveness: %d pending when the faults stopped; progress resumed after %s (bound: lease %s + %d polls of %s%s = %s); drained in %s (%.0f messages/s after resuming)",
		live.atHeal, live.resumed.Round(10*time.Millisecond), p.lease, polls, chaosPoll, boundNote, bound,
		drainTime.Round(10*time.Millisecond), live.rate())
	stopErrs := pr.stopAll(termTimeout)
	var dead int64
	require.NoError(t, d.DB.Raw("SELECT COUNT(*) FROM "+d.DB.Statement.Quote(tables.DeadLettersTable())).Scan(&dead).Error)

	// What was committed: the business table is the truth.
	expected, perKey := committed(t, d.DB)

	// What was delivered.
	got := consume(t, brokers(), topic, p.strict, expected, 2*time.Minute)

	// Count.
	lost := lostOf(expected, got)
	logs := scanRelayLogs(pr.logs())
	explained, byTakeover, kinds := explain(got.violations, events.snapshot(), logs, p.lease)
	slowExits, longestExit := pr.exitStats()
	writeEvents(t, logDir, events.snapshot())
	dups := got.records - len(got.seen)
	totalTime := time.Since(start)

	pr.mu.Lock()
	unexpected := append([]string(nil), pr.unexpected...)
	pr.mu.Unlock()

	summary := fmt.Sprintf("chaos summary: mode=%s messages=%d committed=%d keys=%d relays=%d brokers=%d buckets=%d"+
		" | kills=%d graceful_stops=%d backend_kills=%d (backends=%d) broker_faults=%d broker_removals=%d pauses=%d"+
		" | lost=%d duplicates=%d (records=%d, max_copies=%d) order_violations=%d (near_a_takeover=%d near_any_fault=%d %v)"+
		" | dead_letters=%d pending=%d takeovers_logged=%d publish_failures_logged=%d slow_graceful_exits=%d (longest %s)"+
		" | write=%s chaos=%s drain=%s (resumed after %s, bound %s) total=%s seed=%d",
		mode, p.messages, len(expected), p.keys, p.relays, p.brokers, p.buckets,
		events.count(evKill), events.count(evTerm), events.count(evBackendKill), in.backends,
		events.count(append(brokerFaultKinds, evBrokerKill, evBrokerStop, evLeaderMove)...), events.count(evNodeBounce), events.count(evPause),
		len(lost), dups, got.records, got.maxCopies, len(got.violations), byTakeover, explained, kinds,
		dead, remaining, len(logs.takeovers), logs.publishFailed, slowExits, longestExit.Round(100*time.Millisecond),
		writeTime.Round(time.Second), chaosTime.Round(time.Second), drainTime.Round(time.Second),
		live.resumed.Round(10*time.Millisecond), bound, totalTime.Round(time.Second), p.seed)
	t.Log(summary)
	var foreign []string
	if p.pgRestart {
		total, byRelays, f := audit.foreignDeletes(t, pr.args.tag)
		foreign = f
		t.Logf("chaos postgres summary: mode=%s restarts_fast=%d restarts_immediate=%d (the last one with %d pending)"+
			" | lost=%d order_violations=%d duplicates=%d (max_copies=%d) | resumed after %s (bound lease %s + %d polls of %s = %s)"+
			" | rows deleted=%d (by relays %d) deleted in a bucket another relay held=%d lease_lost_before_delete=%d fenced=%d takeovers_during_publish=%d | seed=%d",
			mode, events.count(evPGRestartFast), events.count(evPGRestartImmediate), live.atHeal,
			len(lost), len(got.violations), dups, got.maxCopies, live.resumed.Round(10*time.Millisecond), p.lease, polls, chaosPoll, bound,
			total, byRelays, len(foreign), len(logs.lateDeletes), len(logs.fenced), len(logs.takeovers)+len(logs.explainers), p.seed)
	}
	if p.network {
		total, byRelays, f := audit.foreignDeletes(t, pr.args.tag)
		foreign = f
		lapsed := in.net.lapsed
		t.Logf("chaos network summary: mode=%s partitions_brokers=%d partitions_database=%d delays=%d losses=%d database_partitions_past_the_lease=%d"+
			" | lost=%d order_violations=%d duplicates=%d (max_copies=%d) | resumed after %s (bound lease %s + %d polls of %s = %s)"+
			" | rows deleted=%d (by relays %d) deleted in a bucket another relay held=%d lease_lost_before_delete=%d fenced=%d takeovers_during_publish=%d | netem=%v seed=%d",
			mode, events.count(evNetPartitionBrokers), events.count(evNetPartitionDB), events.count(evNetDelay), events.count(evNetLoss), lapsed,
			len(lost), len(got.violations), dups, got.maxCopies, live.resumed.Round(10*time.Millisecond), p.lease, polls, chaosPoll, bound,
			total, byRelays, len(foreign), len(logs.lateDeletes), len(logs.fenced), len(logs.takeovers)+len(logs.explainers), lab.netem, p.seed)
		if left := lab.qdiscsLeft(); len(left) > 0 {
			t.Errorf("faults left in place after the heal: %v", left)
		}
	}
	events.mu.Lock()
	t.Logf("chaos: faults by kind: %v", events.counts)
	events.mu.Unlock()
	for i, v := range got.violations {
		if i == 10 {
			t.Logf("... %d more order violations", len(got.violations)-10)
			break
		}
		t.Logf("order violation: key %s seq %d first delivered after seq %d (partition %d offset %d, produced %s)",
			v.key, v.seq, v.after, v.partition, v.offset, v.ts.Format("15:04:05.000"))
	}
	for i, r := range logs.depRaces {
		if i == 3 {
			t.Logf("... %d more data races reported in dependencies", len(logs.depRaces)-3)
			break
		}
		t.Logf("data race in a dependency, not in this module (reported, not failed on): %s", r)
	}
	if len(logs.unexpectedErrs) > 0 {
		t.Logf("relay error lines: %d, first: %s", len(logs.unexpectedErrs), logs.unexpectedErrs[0])
	}

	if remaining > 0 || (live.atHeal > 0 && live.resumed > bound) {
		for _, l := range relayLinesSince(pr.logs(), healStart.Add(-2*p.lease), 60) {
			t.Log("relay log around the heal: " + l)
		}
	}

	// Judge.
	require.Empty(t, logs.ourRaces, "data races in this module's code, reported by the race detector in the relays")
	require.Empty(t, unexpected, "relays must exit only when told to")
	require.Empty(t, stopErrs, "every relay stops gracefully at the end")
	require.Equal(t, written, len(expected), "every transaction the writers saw commit is in the business table, and no other")
	require.Zero(t, remaining, "the outbox drains once the faults stop")
	if live.atHeal > 0 {
		require.LessOrEqual(t, live.resumed, bound,
			"after the last fault the relays publish again within LeaseDuration plus %d poll intervals", livenessPolls)
	}
	require.Zero(t, dead, "no message is dead-lettered by transient faults")
	require.Empty(t, got.unknown, "every delivered message belongs to a committed business transaction")
	require.Empty(t, got.corrupt, "every delivered record carries its id, key and sequence intact")
	requireAllDelivered(t, lost, perKey, got)
	if p.strict {
		require.Empty(t, got.violations, "strict mode keeps per-key order")
		require.Zero(t, dups, "strict mode delivers each message once to read_committed consumers (max_copies %d)", got.maxCopies)
	}
	if p.franz {
		require.Equal(t, byTakeover, len(got.violations),
			"with batches of a bucket overlapping in flight, no key reordered except by a late copy near a takeover")
	}
	if p.network || p.pgRestart {
		require.Empty(t, got.violations, "no key reordered, in strict mode and with the default publisher's order gate")
		require.Empty(t, foreign, "no relay deletes rows of a bucket whose lease another relay holds (term guard)")
		require.Positive(t, live.atHeal, "a backlog was pending when the last fault healed")
	}
	if p.network {
		require.Positive(t, events.count(netFaultKinds...), "network faults were injected")
	}
	if p.netKafka != nil {
		for _, kind := range []string{evNetPartitionOneBroker, evNetPartitionBrokers, evNetSlowBroker} {
			require.Positive(t, events.count(kind), "%s injected", kind)
		}
	}
	if p.pgRestart {
		require.Positive(t, events.count(evPGRestartFast, evPGRestartImmediate), "PostgreSQL was restarted")
	}
}

// ref is what a message is: the key and its sequence number.
type ref struct {
	key string
	seq int32
}

// runWriters writes p.messages messages at p.rate and returns how many
// committed, and how many transactions failed and were retried.
func runWriters(ctx context.Context, t *testing.T, db *gorm.DB, plugin *outbox.Plugin, topic string, p params) (int, int) {
	var (
		wg        sync.WaitGroup
		committed atomic.Int64
		retries   atomic.Int64
		errMu     sync.Mutex
		firstErr  error
	)
	start := time.Now()
	perWriter := p.rate / float64(p.writers)
	for w := range p.writers {
		share := p.messages / p.writers
		if w < p.messages%p.writers {
			share++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var keys []int
			for k := w; k < p.keys; k += p.writers {
				keys = append(keys, k)
			}
			next := make([]int32, len(keys))
			rng := rand.New(rand.NewPCG(p.seed, uint64(w)))
			sent := 0
			failures := 0
			var failingSince time.Time
			for sent < share {
				if ctx.Err() != nil {
					return
				}
				// Pace: message sent+1 is due at start + sent/perWriter.
				if due := start.Add(time.Duration(float64(sent) / perWriter * float64(time.Second))); time.Until(due) > 0 {
					select {
					case <-time.After(time.Until(due)):
					case <-ctx.Done():
						return
					}
				}
				n := min(1+rng.IntN(p.maxPerTx), share-sent)
				seqs := slices.Clone(next)
				rows := make([]order, n)
				msgs := make([]*outbox.Message, n)
				for i := range n {
					ki := rng.IntN(len(keys))
					key := keyName(keys[ki])
					seq := seqs[ki]
					seqs[ki]++
					id := uuid.Must(uuid.NewV7()).String()
					rows[i] = order{K: key, Seq: seq, MsgID: id}
					msgs[i] = &outbox.Message{
						ID:      id,
						Topic:   topic,
						Key:     []byte(key),
						Value:   []byte(key + "/" + strconv.Itoa(int(seq))),
						Headers: []outbox.Header{{Key: "chaos-writer", Value: []byte(strconv.Itoa(w))}},
					}
				}
				err := db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
					if err := tx.Create(&rows).Error; err != nil {
						return err
					}
					return plugin.Enqueue(tx, msgs...)
				})
				if err != nil && ctx.Err() == nil {
					// Did it commit anyway (an error after COMMIT was
					// sent)? Ask until the database answers: while it
					// restarts, it does not, and a retry of what did commit
					// would write the same sequence numbers again.
					committed, cerr := committedAnyway(ctx, db, rows[0].MsgID)
					if cerr != nil {
						errMu.Lock()
						firstErr = fmt.Errorf("writer %d: whether a transaction committed: %w (its error: %v)", w, cerr, err)
						errMu.Unlock()
						return
					}
					if committed {
						err = nil
					}
				}
				if err != nil {
					retries.Add(1)
					failures++
					if failures == 1 {
						failingSince = time.Now()
					}
					// A database restart fails every transaction for a few
					// seconds.
					if failures > 50 && time.Since(failingSince) > time.Minute {
						errMu.Lock()
						firstErr = fmt.Errorf("writer %d: %d transactions in a row failed: %w", w, failures, err)
						errMu.Unlock()
						return
					}
					time.Sleep(50 * time.Millisecond)
					continue
				}
				failures = 0
				next = seqs
				sent += n
				committed.Add(int64(n))
			}
		}()
	}
	wg.Wait()
	require.NoError(t, firstErr)
	require.NoError(t, ctx.Err())
	return int(committed.Load()), int(retries.Load())
}

// committedAnyway reports whether the message id was committed, asking
// until the database answers, for up to two minutes.
func committedAnyway(ctx context.Context, db *gorm.DB, msgID string) (bool, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int64
		err := db.WithContext(ctx).Model(&order{}).Where("msg_id = ?", msgID).Count(&n).Error
		if err == nil {
			return n > 0, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false, err
		}
		time.Sleep(100 * time.Millisecond) // until the database is back
	}
}

// The relays' poll interval, and how many of them past LeaseDuration the
// relays may take to publish again after the last fault: a relay that
// died holding leases is taken over once they expire, and the new owner
// finds the rows at its next poll.
const (
	chaosPoll     = 200 * time.Millisecond
	livenessPolls = 5
	// networkLivenessPolls is the same for the network faults: they stop
	// no relay process, so no relay restarts after the last fault.
	networkLivenessPolls = 3
	// chaosMetadataRefresh is chaos-relay's sarama Metadata.RefreshFrequency.
	chaosMetadataRefresh = 5 * time.Second
)

// liveness is how the backlog drained after the faults stopped.
type liveness struct {
	atHeal    int64         // pending rows when the faults stopped
	resumed   time.Duration // until the first row was published after that
	drained   time.Duration // from resuming until the table was empty
	remaining int64         // rows left at the drain limit (0 when drained)
}

// rate is the drain rate after progress resumed, in messages per second.
func (l liveness) rate() float64 {
	if l.drained <= 0 {
		return 0
	}
	return float64(l.atHeal) / l.drained.Seconds()
}

// waitEmpty waits until the messages table is empty, at most limit after
// start (the heal), and measures when publishing resumed. atHeal is the
// count at start when the caller took it (the heal takes a while and the
// relays may drain meanwhile), or -1: then the first count is.
func waitEmpty(t *testing.T, db *gorm.DB, table string, limit time.Duration, start time.Time, atHeal int64) liveness {
	q := "SELECT COUNT(*) FROM " + db.Statement.Quote(table)
	deadline := start.Add(limit)
	var l liveness
	first := true
	if atHeal >= 0 {
		l.atHeal, first = atHeal, false
	}
	for {
		var n int64
		if err := db.Raw(q).Scan(&n).Error; err != nil {
			// A connection the database closed (it restarted) fails once.
			require.True(t, time.Now().Before(deadline), "count the outbox: %v", err)
			time.Sleep(50 * time.Millisecond)
			continue
		}
		now := time.Now()
		if first {
			l.atHeal, first = n, false
		} else if l.resumed == 0 && n < l.atHeal {
			l.resumed = now.Sub(start)
		}
		if n == 0 || now.After(deadline) {
			l.remaining = n
			if l.resumed > 0 {
				l.drained = now.Sub(start) - l.resumed
			}
			return l
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// violation is a message whose first delivery came after the first
// delivery of a later message of its key.
type violation struct {
	key       string
	seq       int32
	after     int32 // the highest sequence number delivered before it
	partition int32
	offset    int64
	ts        time.Time // the record's timestamp: when the producer batched it
}

type consumed struct {
	records      int
	perPartition map[int32]int64
	lastOffset   map[int32]int64
	seen         map[string]int // message id -> copies
	maxCopies    int
	delivered    map[string]int32 // key -> distinct sequence numbers delivered
	unknown      []string         // ids not in the business table
	corrupt      []string
	// violations, checked on first deliveries (after deduplication) in
	// partition order; a key lives in one partition.
	violations []violation
}

// consume reads the topic from the start (with read_committed in strict
// mode) until every expected message arrived and nothing more came for two
// seconds: the relays have stopped, so nothing more is coming.
func consume(t *testing.T, brokers []string, topic string, strict bool, expected map[string]ref, timeout time.Duration) consumed {
	t.Helper()
	opts := []kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(200 * time.Millisecond),
		kgo.FetchMaxBytes(32 << 20),
	}
	if strict {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	cl, err := kgo.NewClient(opts...)
	require.NoError(t, err)
	defer cl.Close()

	c := consumed{seen: make(map[string]int, len(expected)), delivered: map[string]int32{},
		perPartition: map[int32]int64{}, lastOffset: map[int32]int64{}}
	maxSeq := map[string]int32{}
	uniqueExpected := 0
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	lastNew := time.Now()
	for {
		pollCtx, pollCancel := context.WithTimeout(ctx, 500*time.Millisecond)
		fetches := cl.PollFetches(pollCtx)
		pollCancel()
		fetches.EachRecord(func(r *kgo.Record) {
			c.records++
			c.perPartition[r.Partition]++
			c.lastOffset[r.Partition] = max(c.lastOffset[r.Partition], r.Offset)
			lastNew = time.Now()
			var id string
			for _, h := range r.Headers {
				if h.Key == "x-outbox-message-id" {
					id = string(h.Value)
				}
			}
			key, seqText, ok := strings.Cut(string(r.Value), "/")
			seq, err := strconv.Atoi(seqText)
			if id == "" || !ok || err != nil || key != string(r.Key) {
				c.corrupt = append(c.corrupt, fmt.Sprintf("partition %d offset %d: id %q value %q key %q", r.Partition, r.Offset, id, r.Value, r.Key))
				return
			}
			c.seen[id]++
			if n := c.seen[id]; n > 1 {
				c.maxCopies = max(c.maxCopies, n)
				return // a duplicate: order is judged on first deliveries
			}
			c.maxCopies = max(c.maxCopies, 1)
			want, known := expected[id]
			if !known {
				c.unknown = append(c.unknown, id)
				return
			}
			if want.key != key || want.seq != int32(seq) {
				c.corrupt = append(c.corrupt, fmt.Sprintf("id %s: delivered as %s/%d, written as %s/%d", id, key, seq, want.key, want.seq))
				return
			}
			uniqueExpected++
			c.delivered[key]++
			last, has := maxSeq[key]
			if has && int32(seq) < last {
				c.violations = append(c.violations, violation{key: key, seq: int32(seq), after: last,
					partition: r.Partition, offset: r.Offset, ts: r.Timestamp})
			}
			if !has || int32(seq) > last {
				maxSeq[key] = int32(seq)
			}
		})
		switch {
		case uniqueExpected == len(expected) && time.Since(lastNew) > 2*time.Second:
			if !strict {
				// Without transactions every offset is a record: none was
				// skipped.
				for part, n := range c.perPartition {
					require.Equal(t, c.lastOffset[part]+1, n, "partition %d: records read vs offsets", part)
				}
			}
			return c
		case ctx.Err() != nil:
			t.Logf("chaos: consumer timed out after %d records (%d of %d messages)", c.records, uniqueExpected, len(expected))
			return c
		}
	}
}

// explain ties each order violation to the faults and takeovers around
// the time its late copy was produced: an event that started up to a
// second before the record's timestamp or within three leases after it
// (the publish was in flight then). It returns how many violations have
// any event near them, how many have a takeover near them (a pause past
// the lease, or a relay's log line saying it lost a lease during a
// publish or before its delete, or was fenced), and the count per kind.
// With faults every few hundred milliseconds "near any fault" is a weak
// tie; "near a takeover" is the documented cause.
func explain(vs []violation, events []event, logs relayLogStats, lease time.Duration) (int, int, map[string]int) {
	for _, at := range append(slices.Clone(logs.takeovers), logs.explainers...) {
		events = append(events, event{Kind: evTakeover, Slot: -1, Start: at.Add(-lease), End: at})
	}
	for _, at := range logs.fenced {
		events = append(events, event{Kind: evFenced, Slot: -1, Start: at.Add(-lease), End: at})
	}
	for _, at := range logs.lateDeletes {
		events = append(events, event{Kind: evLateDelete, Slot: -1, Start: at.Add(-lease), End: at})
	}
	takeover := []string{evTakeover, evFenced, evLateDelete, evPause}
	kinds := map[string]int{}
	anyN, takeoverN := 0, 0
	for _, v := range vs {
		lo, hi := v.ts.Add(-time.Second), v.ts.Add(3*lease)
		var hit []string
		for _, e := range events {
			if e.Start.Before(hi) && e.End.After(lo) && !slices.Contains(hit, e.Kind) {
				hit = append(hit, e.Kind)
			}
		}
		if len(hit) > 0 {
			anyN++
			for _, k := range hit {
				kinds[k]++
			}
		}
		if slices.ContainsFunc(hit, func(k string) bool { return slices.Contains(takeover, k) }) {
			takeoverN++
		}
	}
	return anyN, takeoverN, kinds
}

// writeEvents writes the injected faults to events.log in the log
// directory, one line each, for reading next to the relays' logs.
func writeEvents(t *testing.T, dir string, events []event) {
	var b strings.Builder
	for _, e := range events {
		slot := "-"
		if e.Slot >= 0 {
			slot = strconv.Itoa(e.Slot)
		}
		fmt.Fprintf(&b, "%s %s %-40s slot=%s %s\n", e.Start.Format(time.RFC3339Nano), e.End.Format("15:04:05.000"), e.Kind, slot, e.Note)
	}
	if err := os.WriteFile(dir+"/events.log", []byte(b.String()), 0o644); err != nil {
		t.Logf("chaos: write events: %v", err)
	}
}
