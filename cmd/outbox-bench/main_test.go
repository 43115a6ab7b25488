package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/relay"
)

// TestMain lets the test binary play the broker and relay processes the
// scenarios start from their own executable.
func TestMain(m *testing.M) {
	switch os.Getenv("OUTBOX_BENCH_ROLE") {
	case "broker":
		os.Exit(runBrokerRole())
	case "relay":
		os.Exit(runRelayRole())
	case "consumer":
		os.Exit(runConsumerRole())
	}
	os.Exit(m.Run())
}

// TestSmoke runs every scenario at a tiny size: it checks that the harness
// works and that every message arrives, and asserts no timing.
func TestSmoke(t *testing.T) {
	for _, driver := range []string{dbtest.Postgres, dbtest.SQLite} {
		t.Run(driver, func(t *testing.T) {
			if driver != dbtest.SQLite {
				dbtest.Require(t, driver)
			}
			cfg, err := parseFlags([]string{"-smoke", "-driver", driver})
			require.NoError(t, err)
			cfg.TmpDir = t.TempDir()
			// KAFKA_BROKERS (scripts/test.sh's Apache Kafka pass): the
			// scenarios run on that cluster, as the command's -brokers.
			useExternalBrokers(cfg.Brokers)
			t.Cleanup(func() { externalBrokers = nil })
			if driver == dbtest.SQLite {
				// One driver runs the latency modes with -timeline and the
				// consumer inline.
				cfg.Timeline, cfg.Consumer = t.TempDir(), "inline"
				cfg.RelayProfiles = t.TempDir()
				cfg.CPUProfile = filepath.Join(t.TempDir(), "cpu")
			}
			results, err := run(context.Background(), cfg, io.Discard)
			require.NoError(t, err)
			require.Len(t, results, len(allScenarios))
			for _, r := range results {
				require.Empty(t, r.Err, "%s: %s", r.Scenario, r.Err)
				require.NotEmpty(t, r.Figures, r.Scenario)
				if len(cfg.Brokers) > 0 {
					require.Positive(t, r.Params["kafka_brokers"], "%s ran on %v", r.Scenario, cfg.Brokers)
				}
				if r.Scenario == "latency" {
					requireLatencyModes(t, cfg, r)
				}
				if r.Scenario == "strict" {
					// Both modes timed from their first acknowledgement too,
					// in cfg.Rounds interleaved rounds.
					for _, f := range []string{"strict/default", "strict/default_streaming", "strict_streaming", "default_streaming"} {
						require.Positive(t, r.Values[f], f)
						require.Len(t, r.Params["rounds:"+f], cfg.Rounds, f)
					}
				}
			}
			if cfg.RelayProfiles != "" {
				requireRelayProfiles(t, cfg)
			}
			if cfg.CPUProfile != "" {
				// The drain's profile, one over the latency modes' turns and
				// one per strict round and mode.
				files := []string{cfg.CPUProfile, cfg.CPUProfile + ".sliced"}
				for round := range cfg.Rounds {
					files = append(files, fmt.Sprintf("%s.default.%d", cfg.CPUProfile, round+1), fmt.Sprintf("%s.strict.%d", cfg.CPUProfile, round+1))
				}
				for _, f := range files {
					st, err := os.Stat(f)
					require.NoError(t, err)
					require.NotZero(t, st.Size(), f)
				}
			}
		})
	}
}

// requireRelayProfiles checks that every relay process of the relays
// scenario wrote a CPU profile: K files for the drain by K processes.
func requireRelayProfiles(t *testing.T, cfg config) {
	t.Helper()
	for _, k := range cfg.Relays {
		files, err := filepath.Glob(filepath.Join(cfg.RelayProfiles, fmt.Sprintf("relays-%d-*.pprof", k)))
		require.NoError(t, err)
		require.Len(t, files, k, "profiles of the drain by %d relays", k)
		for _, f := range files {
			st, err := os.Stat(f)
			require.NoError(t, err)
			require.NotZero(t, st.Size(), f)
		}
	}
}

// requireLatencyModes checks that the latency scenario ran every mode
// (the listen mode on PostgreSQL only, reported as skipped elsewhere) and
// received every message it wrote.
func requireLatencyModes(t *testing.T, cfg config, r *result) {
	t.Helper()
	written := float64(cfg.Rate) * cfg.Duration.Seconds()
	runs := map[string]int{}
	for _, name := range cfg.LatencyModes {
		runs[name]++
		if cfg.LatencySlice > 0 {
			runs[name] = 1 // in turns, a mode runs once
		}
	}
	if cfg.LatencySlice > 0 {
		require.Positive(t, r.Params["latency_turns"], "the modes ran in turns")
		require.Positive(t, r.Values["notify_turn_p99/direct_turn_p99"])
		require.Positive(t, r.Values["rules8_turn_p99/direct8_turn_p99"])
	}
	for _, m := range latencyModes {
		if m.listen && cfg.Driver != dbtest.Postgres {
			require.Contains(t, r.Params, m.name, "the skipped listen mode is reported")
			require.NotContains(t, r.Values, m.name+"_messages")
			continue
		}
		// A mode run more than once pools its runs' messages.
		require.Equal(t, float64(runs[m.name])*written, r.Values[m.name+"_messages"], m.name)
		for _, f := range []string{"_p50", "_p99", "_p99.9", "_max", "_write_lag_p50", "_write_lag_p99", "_sched_p50", "_sched_p99", "_pool_waits", "_pool_wait_ms"} {
			require.Contains(t, r.Values, m.name+f)
		}
		for k := 1; runs[m.name] > 1 && k <= runs[m.name]; k++ {
			require.Contains(t, r.Values, fmt.Sprintf("%s.%d_p99", m.name, k))
		}
	}
	require.Contains(t, r.Values, "notify_p99/poll10_p99")
	require.Contains(t, r.Values, "rules8_p99/poll10_p99")
	require.Contains(t, r.Values, "rules8_p99/direct8_p99")
	require.Contains(t, r.Values, "rules8_sched_p99/direct8_sched_p99")
	require.Contains(t, r.Values, "notify_p99/direct_p99")
	require.Contains(t, r.Values, "notify_sched_p99/direct_sched_p99")
	if cfg.Timeline == "" {
		return
	}
	for _, m := range latencyModes {
		if m.listen {
			continue // its relay runs in another process: no timeline
		}
		names := []string{m.name}
		if runs[m.name] > 1 {
			names = nil
			for k := 1; k <= runs[m.name]; k++ {
				names = append(names, fmt.Sprintf("%s.%d", m.name, k))
			}
		}
		for _, name := range names {
			b, err := os.ReadFile(filepath.Join(cfg.Timeline, name+"-messages.tsv"))
			require.NoError(t, err)
			// A header and one line per counted message, each traced to
			// its publish.
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			require.Len(t, lines, 1+int(written), name)
			for _, l := range lines[1:] {
				require.Len(t, strings.Split(l, "\t"), 8, name)
			}
			_, err = os.Stat(filepath.Join(cfg.Timeline, name+"-steps.tsv"))
			require.NoError(t, err)
			require.True(t, slices.ContainsFunc(r.Notes, func(n string) bool { return strings.HasPrefix(n, name+" timeline: ") }), name)
		}
	}
}

func TestParseFlags(t *testing.T) {
	_, err := parseFlags([]string{"-scenarios", "drain,nope"})
	require.ErrorContains(t, err, `unknown scenario "nope"`)
	_, err = parseFlags([]string{"-consumer", "elsewhere"})
	require.ErrorContains(t, err, "-consumer must be process or inline")
	_, err = parseFlags([]string{"-growth", "10k"})
	require.Error(t, err)
	c, err := parseFlags([]string{"-growth", "1_000,2000", "-driver", "sqlite"})
	require.NoError(t, err)
	require.Equal(t, []int{1000, 2000}, c.Growth)
	require.Equal(t, relay.BatchSizeDefault, c.BatchSize, "-batch follows the relay's default")
	require.Zero(t, c.StrictBatch, "the strict drain takes the relay's default for a strict-mode publisher")
	c, err = parseFlags([]string{"-batch", "500"})
	require.NoError(t, err)
	require.Equal(t, 500, c.StrictBatch, "-batch sets both modes' batch")
	c, err = parseFlags([]string{"-batch", "500", "-strict-batch", "4000"})
	require.NoError(t, err)
	require.Equal(t, []int{500, 4000}, []int{c.BatchSize, c.StrictBatch})
	_, err = parseFlags([]string{"-strict-batch", "-1"})
	require.ErrorContains(t, err, "-strict-batch must be 0 or positive")
	c, err = parseFlags(nil)
	require.NoError(t, err)
	require.Equal(t, "sarama", c.Publisher, "the Kafka publisher by default")
	c, err = parseFlags([]string{"-publisher", "franz"})
	require.NoError(t, err)
	require.Equal(t, "franz", c.Publisher)
	_, err = parseFlags([]string{"-publisher", "confluent"})
	require.ErrorContains(t, err, `unknown -publisher "confluent"`)
	_, err = parseFlags([]string{"-flush-frequency", "-1ms"})
	require.ErrorContains(t, err, "-flush-frequency must not be negative")
	c, err = parseFlags([]string{"-flush-frequency", "1ms"})
	require.NoError(t, err)
	require.Equal(t, time.Millisecond, c.FlushFrequency)
	require.Equal(t, defaultLatencyOrder, c.LatencyModes)
	require.Equal(t, "direct", c.LatencyModes[0], "the floor is measured first")
	require.Equal(t, "direct", c.LatencyModes[len(c.LatencyModes)-1], "and last")
	c, err = parseFlags([]string{"-latency-modes", "direct, notify,direct"})
	require.NoError(t, err)
	require.Equal(t, []string{"direct", "notify", "direct"}, c.LatencyModes)
	_, err = parseFlags([]string{"-latency-modes", "notify,fast"})
	require.ErrorContains(t, err, `-latency-modes: unknown mode "fast"`)
	_, err = parseFlags([]string{"-latency-modes", ","})
	require.ErrorContains(t, err, "-latency-modes: no mode named")
	require.Equal(t, time.Second, c.LatencySlice, "the modes run in turns of a second by default")
	c, err = parseFlags([]string{"-latency-slice", "0"})
	require.NoError(t, err)
	require.Zero(t, c.LatencySlice)
	_, err = parseFlags([]string{"-latency-slice", "-1s"})
	require.ErrorContains(t, err, "-latency-slice must not be negative")
}

// TestSmokeWAL runs the wal scenario at a tiny size on the WAL mode
// server: every part runs, every message arrives, every figure is
// reported, and WAL mode leaves the messages table untouched while table
// mode's drain leaves dead tuples. It asserts no timing.
// TestSmokeFranz runs drain and latency at their smoke size through the
// Franz publisher (-publisher franz), in this process and in the listen
// mode's relay process: every message arrives.
func TestSmokeFranz(t *testing.T) {
	dbtest.Require(t, dbtest.Postgres)
	cfg, err := parseFlags([]string{"-smoke", "-scenarios", "drain,latency", "-publisher", "franz"})
	require.NoError(t, err)
	cfg.TmpDir = t.TempDir()
	useExternalBrokers(cfg.Brokers)
	kafkaPublisher = cfg.Publisher
	t.Cleanup(func() { externalBrokers, kafkaPublisher = nil, "" })
	sarama, franz := publishersStarted["sarama"].Load(), publishersStarted["franz"].Load()
	results, err := run(context.Background(), cfg, io.Discard)
	require.NoError(t, err)
	require.Len(t, results, 2)
	for _, r := range results {
		require.Empty(t, r.Err, "%s: %s", r.Scenario, r.Err)
		require.NotEmpty(t, r.Figures, r.Scenario)
		if r.Scenario == "latency" {
			requireLatencyModes(t, cfg, r)
		}
	}
	require.Equal(t, sarama, publishersStarted["sarama"].Load(), "no sarama publisher")
	require.Greater(t, publishersStarted["franz"].Load(), franz, "the Franz publisher ran")
}

func TestSmokeWAL(t *testing.T) {
	dbtest.RequireWAL(t)
	cfg, err := parseFlags([]string{"-smoke", "-scenarios", "wal", "-wal-dsn", dbtest.PostgresWALDSN()})
	require.NoError(t, err)
	cfg.TmpDir = t.TempDir()
	results, err := run(context.Background(), cfg, io.Discard)
	require.NoError(t, err)
	require.Len(t, results, 1)
	r := results[0]
	require.Empty(t, r.Err)
	for _, f := range []string{
		"write_round_trips_per_tx_none", "write_round_trips_per_tx_table", "write_round_trips_per_tx_wal", "write_select1_us", "write_wal/none",
		"latency_table_p99", "latency_wal_p99", "latency_wal_p99/table_p99", "rr_table_p99", "rr_wal_p99",
		"drain_table_ack", "drain_wal_ack", "drain_table_kafka", "drain_wal_kafka", "drain_decode_ceiling_ack", "drain_decode_ceiling_kafka", "drain_wal_ack/decode_ceiling_ack", "drain_streaming_wal_ack",
	} {
		require.Contains(t, r.Values, f)
		require.Positive(t, r.Values[f], f)
	}
	// GORM's Create in its own transaction: BEGIN, INSERT, COMMIT; a
	// rule's message adds an INSERT in table mode and goes with COMMIT in
	// WAL mode (one pipeline: one round trip).
	require.Equal(t, 3.0, r.Values["write_round_trips_per_tx_none"])
	require.Equal(t, 4.0, r.Values["write_round_trips_per_tx_table"])
	require.Equal(t, 3.0, r.Values["write_round_trips_per_tx_wal"])
	for _, side := range []string{"wal_ack", "wal_kafka"} {
		for _, f := range []string{"rows_inserted_", "rows_deleted_", "dead_tuples_"} {
			require.Contains(t, r.Values, f+side)
			require.Zero(t, r.Values[f+side], f+side)
		}
	}
	for _, side := range []string{"table_ack", "table_kafka"} {
		require.Equal(t, float64(cfg.N), r.Values["rows_deleted_"+side], side)
	}
}

func TestParseFlagsWAL(t *testing.T) {
	_, err := parseFlags([]string{"-scenarios", "wal", "-wal-parts", "write,nope"})
	require.ErrorContains(t, err, `unknown -wal-parts part "nope"`)
	c, err := parseFlags([]string{"-scenarios", "wal", "-wal-parts", "drain", "-rounds", "5"})
	require.NoError(t, err)
	require.Equal(t, []string{"drain"}, c.WALParts)
	require.Equal(t, 5, c.Rounds)
	_, err = parseFlags([]string{"-rounds", "0"})
	require.Error(t, err)
}

// TestCeilingDelete checks that the database ceiling's deletes, in every
// shape (a PostgreSQL array parameter, a literal within bounds, chunks of
// ceilingChunk ids), delete exactly the listed rows of the bucket.
func TestCeilingDelete(t *testing.T) {
	dbtest.ForEach(t, func(t *testing.T, db *dbtest.DB) {
		ctx := context.Background()
		require.NoError(t, db.Exec("CREATE TABLE ceiling_rows (id BIGINT PRIMARY KEY, bucket INT NOT NULL)").Error)
		const n = 2*ceilingChunk + 300
		rows := make([]map[string]any, 0, n)
		for i := 1; i <= n; i++ {
			rows = append(rows, map[string]any{"id": int64(i), "bucket": i % 2})
		}
		require.NoError(t, db.Table("ceiling_rows").CreateInBatches(rows, 500).Error)
		sqlDB, err := db.DB.DB()
		require.NoError(t, err)
		// Bucket 0's even ids: two full chunks and a literal-sized rest,
		// then a few (below ceilingLiteralMin) of bucket 1's odd ids.
		var even, odd []any
		for i := int64(2); i <= n; i += 2 {
			even = append(even, i)
		}
		for i := int64(1); i < 2*ceilingLiteralMin-2; i += 2 {
			odd = append(odd, i)
		}
		require.Greater(t, len(even), ceilingChunk)
		require.Less(t, len(odd), ceilingLiteralMin)
		require.NoError(t, ceilingDelete(ctx, sqlDB, db.Dialect, "ceiling_rows", 0, even))
		require.NoError(t, ceilingDelete(ctx, sqlDB, db.Dialect, "ceiling_rows", 1, odd))
		// An id of the other bucket is not deleted.
		require.NoError(t, ceilingDelete(ctx, sqlDB, db.Dialect, "ceiling_rows", 0, []any{int64(n - 1)}))
		var left []int64
		require.NoError(t, db.Raw("SELECT id FROM ceiling_rows ORDER BY id").Scan(&left).Error)
		var want []int64
		for i := int64(2*ceilingLiteralMin - 1); i <= n; i += 2 {
			want = append(want, i)
		}
		require.Equal(t, want, left)
	})
}

// latencyTestSetup is the configuration of -smoke on PostgreSQL with
// args, and the brokers of a Kafka-protocol broker process (or of
// KAFKA_BROKERS's cluster), stopped when the test ends.
func latencyTestSetup(t *testing.T, args ...string) (config, []string) {
	t.Helper()
	dbtest.Require(t, dbtest.Postgres)
	cfg, err := parseFlags(append([]string{"-smoke", "-driver", dbtest.Postgres}, args...))
	require.NoError(t, err)
	cfg.TmpDir = t.TempDir()
	useExternalBrokers(cfg.Brokers)
	t.Cleanup(func() { externalBrokers = nil })
	broker, brokers, err := startBroker(context.Background(), cfg.Partitions, false)
	require.NoError(t, err)
	t.Cleanup(broker.stop)
	return cfg, brokers
}

// TestLatencySlicedTurns runs two latency modes side by side in turns
// (measureSliced) on PostgreSQL: the modes take turns of -latency-slice's
// worth of messages, the turns' order reversed every rotation, each turn
// delivered before the next starts, until every mode wrote its warm-up and
// its counted messages; every counted message arrives and is measured.
func TestLatencySlicedTurns(t *testing.T) {
	cfg, brokers := latencyTestSetup(t, "-latency-modes", "direct,notify,direct", "-latency-slice", "50ms")
	ctx := context.Background()

	var notes []string
	pooled, lags, scheds := map[string][]time.Duration{}, map[string][]time.Duration{}, map[string][]time.Duration{}
	closed, poolWaits, poolWaited := map[string]int64{}, map[string]int64{}, map[string]time.Duration{}
	turns, err := measureSliced(ctx, cfg, brokers, []string{"direct", "notify"}, &notes, pooled, lags, scheds, closed, poolWaits, poolWaited)
	require.NoError(t, err)

	per := sliceMessages(cfg) // 200 tx/s for 50 ms
	require.Equal(t, 10, per)
	total := int(float64(cfg.Rate) * (cfg.Warmup + cfg.Duration).Seconds())
	require.Len(t, turns, 2*total/per)
	next := map[string]int{}
	for i, turn := range turns {
		// direct notify, notify direct, direct notify, ...
		want := []string{"direct", "notify", "notify", "direct"}[i%4]
		require.Equal(t, want, turn.mode, "turn %d", i)
		require.Equal(t, next[turn.mode], turn.from, "turn %d continues its mode's messages", i)
		require.Equal(t, per, turn.to-turn.from, "turn %d", i)
		require.Equal(t, turn.to, turn.arrived, "turn %d: its messages, and its mode's before, delivered before the next turn", i)
		next[turn.mode] = turn.to
		// Its own p99, but for the warm-up's turns.
		if turn.to <= int(float64(cfg.Rate)*cfg.Warmup.Seconds()) {
			require.Zero(t, turn.p99, "turn %d is the warm-up's", i)
		} else {
			require.Positive(t, turn.p99, "turn %d", i)
		}
		if i > 0 {
			require.False(t, turn.start.Before(turns[i-1].end), "turn %d starts after turn %d was delivered", i, i-1)
		}
	}
	counted := int(float64(cfg.Rate) * cfg.Duration.Seconds())
	for _, m := range []string{"direct", "notify"} {
		require.Equal(t, total, next[m], m)
		require.Len(t, pooled[m], counted, "%s: every counted message measured", m)
		require.Len(t, lags[m], counted, m)
		require.Len(t, scheds[m], counted, m)
		// From the schedule is the lag and commit → receipt together.
		require.GreaterOrEqual(t, scheds[m][counted-1], pooled[m][counted-1], m)
	}
}

// TestTurnRatio checks the turn-by-turn ratio: the k-th counted turn of
// a mode against the k-th of the base, the median of the ratios, so that
// one slow turn of either moves one ratio and not the result.
func TestTurnRatio(t *testing.T) {
	turn := func(mode string, p99ms int) latencyTurn {
		return latencyTurn{mode: mode, p99: time.Duration(p99ms) * time.Millisecond}
	}
	turns := []latencyTurn{
		turn("direct", 0), turn("notify", 0), // the warm-up's: not counted
		turn("notify", 20), turn("direct", 10), // 2
		turn("direct", 10), turn("notify", 400), // 40: a stall in notify's turn
		turn("notify", 30), turn("direct", 10), // 3
		turn("direct", 500), turn("notify", 25), // 0.05: a stall in direct's
		turn("notify", 25), turn("direct", 10), // 2.5
	}
	v, ok := turnRatio(turns, "notify", "direct")
	require.True(t, ok)
	require.InDelta(t, 2.5, v, 1e-9, "the median of 2, 40, 3, 0.05, 2.5")
	v, ok = turnRatio(turns[:6], "notify", "direct")
	require.True(t, ok)
	require.InDelta(t, 21, v, 1e-9, "an even count: the mean of the middle two")
	_, ok = turnRatio(turns, "listen", "direct")
	require.False(t, ok, "a mode without turns")
}

// TestLatencyPoolWaits checks that a latency run reports its pool's waits
// for a connection: with one connection for the 8 writers and the relay,
// callers wait, and the run counts the waits and their time.
func TestLatencyPoolWaits(t *testing.T) {
	cfg, brokers := latencyTestSetup(t, "-max-idle-conns", "1")
	ctx := context.Background()

	var (
		notes      []string
		idleClosed int64
		w          latencyWaits
	)
	lat, err := measureAll(ctx, cfg, brokers, latencyModeNamed("notify"), &notes, &idleClosed, &w)
	require.NoError(t, err)
	require.Len(t, lat, int(float64(cfg.Rate)*cfg.Duration.Seconds()))
	require.Positive(t, w.poolWaits, "8 writers and a relay on one connection wait for it")
	require.Positive(t, w.poolWaited)
}
