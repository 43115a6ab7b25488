package chaos_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/pgwal"
	"github.com/gorm-outbox/outbox/relay"
)

// EnvWALChaos enables TestChaosWAL outside CI: it runs a PostgreSQL
// cluster of its own (wal_level = logical) and needs root, as
// TestChaosPostgresRestart does.
const EnvWALChaos = "OUTBOX_CHAOS_WAL"

// walMaxPending is the readers' pgwal.Config.MaxPending in the WAL chaos
// run.
const walMaxPending = 2000

// TestChaosWAL runs the chaos suite against an outbox in WAL mode
// (outbox.ModeWAL): the writers emit their messages into the WAL, three
// chaos-relay processes run pgwal readers that compete for the slot's
// lease, and the injector SIGKILLs, stops and pauses them, terminates
// their database sessions (the walsender included), restarts the
// PostgreSQL server (fast and immediate) and makes the brokers fail
// (kfake's request faults; on Apache Kafka, broker processes killed,
// stopped, leaders moved).
// The last fault is an immediate restart right after a backlog was
// written. It asserts: nothing lost, no key reordered (WAL order is commit
// order: each key's first deliveries follow its sequence numbers), the
// slot confirms everything written once the faults stop within the lease
// plus three standby intervals of the last fault, and duplicates stay
// within what the faults explain (see walDuplicateBound); in strict mode a
// read_committed consumer sees no duplicate at all.
func TestChaosWAL(t *testing.T) {
	if os.Getenv(EnvWALChaos) != "1" && !dbtest.InCI() {
		t.Skipf("restarts a PostgreSQL server of its own; set %s=1 (CI runs it)", EnvWALChaos)
	}
	for _, strict := range []bool{false, true} {
		name := "default"
		if strict {
			name = "strict"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := loadParams(t, strict)
			if os.Getenv(EnvMessages) == "" && !p.soak {
				p.messages = 6000
			}
			p.minChaos = 20 * time.Second
			if os.Getenv(EnvRate) == "" {
				p.rate = float64(p.messages) / p.minChaos.Seconds()
			}
			p.faultEvery = time.Second
			p.drainLimit = 2 * time.Minute
			runWALChaos(t, p)
		})
	}
}

// WAL chaos fault kinds of its own.
var walBrokerKinds = []string{evNotLeader, evTimeoutAfter, evDelay, evDropConn, evShuffle, evBrokerKill, evBrokerStop, evLeaderMove}

func runWALChaos(t *testing.T, p params) {
	pgc := startPGCluster(t, "wal_level = logical", "max_wal_senders = 20", "max_replication_slots = 10")
	mode := "default"
	if p.strict {
		mode = "strict"
	}
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	d := pgc.open(t)
	plugin, err := outbox.NewPlugin(outbox.Config{BucketCount: p.buckets, Mode: outbox.ModeWAL, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, d.DB.Use(plugin))
	require.NoError(t, plugin.AutoMigrate(ctx, d.DB))
	require.NoError(t, d.DB.AutoMigrate(&order{}))
	sqlDB, err := d.DB.DB()
	require.NoError(t, err)
	sqlDB.SetMaxOpenConns(p.writers + 4)
	// The slot exists before anything is written.
	setup, err := pgwal.New(d.DB, plugin, relay.PublisherFunc(func(context.Context, []relay.Message) (int, error) {
		return 0, errors.New("not used")
	}), pgwal.Config{ReplicationDSN: d.DSN})
	require.NoError(t, err)
	require.NoError(t, setup.EnsureSlot(ctx))
	slot := setup.Config().Slot

	cluster := kafkatest.Start(t, kafkatest.NumBrokers(p.brokers))
	topic := cluster.Topic(t, p.partitions)
	// kfake's request faults, or on Apache Kafka (KAFKA_BROKERS,
	// OUTBOX_KAFKA_SCRIPT) its broker processes killed, stopped and
	// leaders moved.
	fake := cluster.Fake()
	real := newRealBrokers(t, cluster, topic)
	nodeIDs := map[string]int32{}
	if fake != nil {
		for i, a := range fake.ListenAddrs() {
			nodeIDs[a] = int32(i)
		}
	} else if p.minChaos < 30*time.Second && !p.soak {
		// A real broker fault takes seconds to heal and the next one
		// waits for full replication: a longer window than on kfake.
		p.minChaos = 30 * time.Second
		if os.Getenv(EnvRate) == "" {
			p.rate = float64(p.messages) / p.minChaos.Seconds()
		}
	}

	t.Logf("chaos wal %s: seed %d (rerun with %s=%d), %d messages over %d keys at %.0f/s, %d readers, %d brokers, %d buckets, lease %s",
		mode, p.seed, EnvSeed, p.seed, p.messages, p.keys, p.rate, p.relays, p.brokers, p.buckets, p.lease)
	bin := relayBinary(t)
	logDir := os.Getenv(EnvLogDir)
	if logDir == "" {
		logDir = t.TempDir()
	} else {
		logDir = fmt.Sprintf("%s/wal-%s-%d", logDir, mode, time.Now().Unix())
		require.NoError(t, os.MkdirAll(logDir, 0o755))
	}
	events := &eventLog{}
	pr := &procs{
		t: t,
		args: relayArgs{
			bin: bin, dsn: d.DSN, tag: "chaos-" + d.Namespace, brokers: cluster.Brokers, logDir: logDir,
			flags: []string{
				"-source", "wal",
				"-mode", mode,
				"-txn-prefix", "chaos-" + d.Namespace + "-",
				"-buckets", strconv.Itoa(p.buckets),
				"-batch", strconv.Itoa(p.batch),
				"-lease", p.lease.String(),
				"-renew", p.renew.String(),
				"-max-pending", strconv.Itoa(walMaxPending),
				"-backoff-min", "50ms",
				"-backoff-max", "1s",
			},
		},
		slots: make([]*relayProc, p.relays),
		log:   events,
	}
	t.Cleanup(pr.killAll)
	for i := range p.relays {
		pr.start(i)
	}

	in := &injector{
		t: t, rng: rand.New(rand.NewPCG(p.seed, p.seed^0x9e3779b97f4a7c15)), procs: pr, fake: fake, real: real,
		partitions: p.partitions, db: d.DB, log: events, lease: p.lease, every: p.faultEvery, nodeIDs: nodeIDs,
	}
	pgr := &pgRestarter{c: pgc}
	in.kinds = func(in *injector) []action {
		kinds := append(pgr.actions(in),
			action{3, in.sigkill},
			action{1, in.sigterm},
			action{1, in.pause},
			action{2, in.killBackends},
		)
		if real != nil {
			return append(kinds, real.actions(in)...)
		}
		return append(kinds,
			action{1, in.brokerFault(evNotLeader, kerr.NotLeaderForPartition, 1, 12)},
			action{1, in.brokerFault(evTimeoutAfter, kerr.RequestTimedOut, 1, 8)},
			action{1, in.delay},
			action{1, in.dropConnection},
			action{1, in.shuffleLeaders},
		)
	}
	stop := startFaults(t, in)

	written, writeErrs := runWriters(ctx, t, d.DB, plugin, topic, p)
	writeTime := time.Since(start)
	t.Logf("chaos wal: %d messages written in %s (%d transaction retries)", written, writeTime.Round(time.Millisecond), writeErrs)
	sleepUntil(ctx, start, p.minChaos)
	stop()

	// The last fault: a backlog, then a crash of the server at once.
	var healAt time.Time
	lastFault(t, evPGRestartImmediate, events, func() {
		written += crashWithBacklog(t, d.DB, sqlDB, p.writers+4, plugin, topic, pgc, 5000, 500)
		healAt = time.Now()
	})
	live := waitSlotConfirms(t, d.DB, slot, p.drainLimit, healAt)
	// The readers confirm once per standby interval (-renew); a reader
	// whose walsender died with the server reconnects after its backoff.
	bound, boundNote := withMetadataRefresh(p.lease+3*p.renew, real)
	t.Logf("chaos wal liveness: %d WAL bytes unconfirmed at the heal; the slot confirmed progress after %s (bound: lease %s + 3 standby intervals of %s%s = %s); everything written confirmed after %s",
		live.behindAtHeal, live.resumed.Round(10*time.Millisecond), p.lease, p.renew, boundNote, bound, live.caughtUp.Round(10*time.Millisecond))
	if real != nil {
		real.endQuiet()
	}
	stopErrs := pr.stopAll(termTimeout)

	expected, perKey := committed(t, d.DB)
	var dead int64
	require.NoError(t, d.DB.Raw("SELECT COUNT(*) FROM "+d.DB.Statement.Quote(plugin.Config().Tables.DeadLettersTable())).Scan(&dead).Error)
	got := consume(t, cluster.Brokers(), topic, p.strict, expected, 2*time.Minute)
	lost := lostOf(expected, got)
	logs := scanRelayLogs(pr.logs())
	wl := scanWALLogs(pr.logs())
	dups := got.records - len(got.seen)
	writeEvents(t, logDir, events.snapshot())
	pr.mu.Lock()
	unexpected := append([]string(nil), pr.unexpected...)
	pr.mu.Unlock()
	restarts := events.count(evPGRestartFast, evPGRestartImmediate) + 1 // and the last fault
	dupBound := walDuplicateBound(wl, p)
	t.Logf("chaos wal summary: mode=%s messages=%d committed=%d keys=%d readers=%d buckets=%d"+
		" | kills=%d graceful_stops=%d pauses=%d backend_kills=%d (backends=%d) restarts_fast=%d restarts_immediate=%d broker_faults=%d"+
		" | reading_terms=%d reconnects=%d publish_failures_logged=%d replayed_skipped=%d records_not_ours=%d"+
		" | lost=%d duplicates=%d (records=%d, max_copies=%d, bound %d) order_violations=%d dead_letters=%d"+
		" | resumed after %s (bound %s), caught up after %s | total=%s seed=%d",
		mode, p.messages, len(expected), p.keys, p.relays, p.buckets,
		events.count(evKill), events.count(evTerm), events.count(evPause), events.count(evBackendKill), in.backends,
		events.count(evPGRestartFast), events.count(evPGRestartImmediate)+1, events.count(walBrokerKinds...),
		wl.terms, wl.retries, wl.publishFailed, wl.skipped, wl.notOurs,
		len(lost), dups, got.records, got.maxCopies, dupBound, len(got.violations), dead,
		live.resumed.Round(10*time.Millisecond), bound, live.caughtUp.Round(10*time.Millisecond), time.Since(start).Round(time.Second), p.seed)
	events.mu.Lock()
	t.Logf("chaos wal: faults by kind: %v", events.counts)
	events.mu.Unlock()
	for i, v := range got.violations {
		if i == 10 {
			break
		}
		t.Logf("order violation: key %s seq %d first delivered after seq %d (partition %d offset %d)", v.key, v.seq, v.after, v.partition, v.offset)
	}
	if len(logs.unexpectedErrs) > 0 {
		t.Logf("reader error lines: %d, first: %s", len(logs.unexpectedErrs), logs.unexpectedErrs[0])
	}

	require.Empty(t, logs.ourRaces, "data races in this module's code, reported by the race detector in the readers")
	require.Empty(t, unexpected, "readers exit only when told to: no slot was reported lost")
	require.Empty(t, stopErrs, "every reader stops gracefully at the end")
	require.Equal(t, written, len(expected), "every transaction the writers saw commit is in the business table, and no other")
	require.Zero(t, live.remaining, "the slot confirms everything written once the faults stop")
	require.Positive(t, live.behindAtHeal, "a backlog was unconfirmed when the last fault healed")
	require.LessOrEqual(t, live.resumed, bound, "after the last fault the slot confirms progress within the lease plus three standby intervals (plus a metadata refresh on a real cluster)")
	require.Zero(t, dead, "no message is dead-lettered by transient faults")
	require.Empty(t, got.unknown, "every delivered message belongs to a committed business transaction")
	require.Empty(t, got.corrupt, "every delivered record carries its id, key and sequence intact")
	requireAllDelivered(t, lost, perKey, got)
	require.Empty(t, got.violations, "each key's first deliveries follow its commit order")
	if p.strict {
		require.Zero(t, dups, "strict mode delivers each message once to read_committed consumers (max_copies %d)", got.maxCopies)
	} else {
		require.LessOrEqual(t, got.maxCopies, wl.terms+wl.publishFailed, "a message is delivered again only by a new reading term or a failed publish's retry")
		require.LessOrEqual(t, dups, dupBound, "duplicates are bounded by the replays the faults caused")
	}
	require.Positive(t, events.count(evKill), "readers were killed")
	require.Positive(t, restarts, "PostgreSQL was restarted")
}

// walLogStats is what the readers' logs say about replays.
type walLogStats struct {
	terms         int // "pgwal: reading the slot": each replays from the slot's confirmed position
	retries       int // terms that ended with an error and were retried
	publishFailed int // failed publishes, each retried: its batch may be delivered again
	skipped       int // replayed messages a strict reader did not publish again: Kafka held them
	notOurs       int // records a strict reader found not to be this outbox's (skipped nothing)
}

func scanWALLogs(paths []string) walLogStats {
	var s walLogStats
	eachLogLine(paths, func(_, text string) bool {
		var line struct {
			Msg       string `json:"msg"`
			Published int    `json:"published"`
			Skipped   int    `json:"skipped"`
		}
		if json.Unmarshal([]byte(text), &line) != nil {
			return true
		}
		switch {
		case line.Msg == "pgwal: reading the slot":
			s.terms++
		case strings.HasPrefix(line.Msg, "pgwal: reading the slot failed"):
			s.retries++
		case strings.HasPrefix(line.Msg, "pgwal: skipped replayed messages"):
			s.skipped += line.Skipped
		case strings.HasPrefix(line.Msg, "pgwal: Kafka's record of the bucket's last batch"):
			s.notOurs++
		case strings.HasPrefix(line.Msg, "relay: publish failed"):
			// The reader publishes through the relay engine, which
			// logs each failed publish (retried, possibly written).
			s.publishFailed++
		}
		return true
	})
	return s
}

// walDuplicateBound bounds the duplicates of a WAL chaos run. A reading
// term starts from the last position a reader recorded (or the slot's,
// when further); what earlier terms published past it is delivered
// again. The position is the oldest message not yet published, recorded
// every standby interval: past it lie what was published since the last
// standby update (the writers' pace over an interval covers it; a backlog
// drains faster, so the batches in flight, one per bucket, are added) and
// what the other buckets published while one bucket's head waited, which
// MaxPending bounds in that bucket's queue: at most BucketCount times
// MaxPending decoded meanwhile. A failed publish may have been written by
// the broker: its batch is sent again.
func walDuplicateBound(s walLogStats, p params) int {
	perTerm := p.buckets*walMaxPending + p.buckets*p.batch + int(p.rate*p.renew.Seconds())
	return max(0, s.terms-1)*perTerm + s.publishFailed*p.batch
}

// walLiveness is how the slot caught up after the last fault.
type walLiveness struct {
	behindAtHeal int64         // WAL bytes between the slot's confirmed position and the WAL end at the heal
	resumed      time.Duration // until the slot's confirmed position first moved
	caughtUp     time.Duration // until it reached the WAL end at the heal
	remaining    int64         // bytes still unconfirmed at the limit (0 when caught up)
}

// waitSlotConfirms waits until the slot's confirmed position reaches the
// WAL end at healAt, at most limit after it.
func waitSlotConfirms(t *testing.T, db *gorm.DB, slot string, limit time.Duration, healAt time.Time) walLiveness {
	var l walLiveness
	deadline := healAt.Add(limit)
	var target, first pglogrepl.LSN
	for {
		var row struct {
			Confirmed string
			Current   string
		}
		err := db.Raw("SELECT confirmed_flush_lsn::text AS confirmed, pg_current_wal_lsn()::text AS current FROM pg_replication_slots WHERE slot_name = ?", slot).Scan(&row).Error
		if err != nil || row.Confirmed == "" {
			require.True(t, time.Now().Before(deadline), "read the slot: %v", err)
			time.Sleep(50 * time.Millisecond)
			continue
		}
		confirmed, err := pglogrepl.ParseLSN(row.Confirmed)
		require.NoError(t, err)
		if target == 0 {
			target, err = pglogrepl.ParseLSN(row.Current)
			require.NoError(t, err)
			first = confirmed
			l.behindAtHeal = int64(target) - int64(confirmed)
		}
		now := time.Now()
		if l.resumed == 0 && confirmed > first {
			l.resumed = now.Sub(healAt)
		}
		if confirmed >= target || now.After(deadline) {
			l.remaining = max(0, int64(target)-int64(confirmed))
			l.caughtUp = now.Sub(healAt)
			if l.resumed == 0 {
				l.resumed = l.caughtUp
			}
			return l
		}
		time.Sleep(50 * time.Millisecond)
	}
}
