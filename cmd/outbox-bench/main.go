// Command outbox-bench measures gorm-outbox against ceilings taken in the
// same run, so its ratios mean something on a noisy, shared machine.
//
//	go run ./cmd/outbox-bench                       # every scenario, PostgreSQL
//	go run ./cmd/outbox-bench -driver sqlite -scenarios drain,write
//	go run ./cmd/outbox-bench -json > results.jsonl # one JSON object per scenario
//
// It starts what it needs: a Kafka-protocol broker (kfake) in a separate
// process, a fresh schema (PostgreSQL), database (MySQL) or file (SQLite)
// per scenario, and, for the relays scenario, relay processes. See
// BENCHMARKS.md for the scenarios and what their ratios mean.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gorm-outbox/outbox/internal/devbroker"
	"github.com/gorm-outbox/outbox/relay"
)

// config is what the flags set.
type config struct {
	Driver     string
	DSN        string
	Scenarios  []string
	N          int
	Keys       int
	ValueSize  int
	Buckets    int
	Partitions int
	BatchSize  int
	// StrictBatch is the strict scenario's relay batch size; 0 takes the
	// relay's default for a strict-mode publisher
	// (relay.BatchSizeReconcilerDefault), or -batch if given.
	StrictBatch int
	// Parallelism is the relay's Config.Parallelism; 0 takes the relay's
	// default.
	Parallelism int
	// PipelineDepth is the relay's Config.PipelineDepth (with a publisher
	// that pipelines: -publisher franz); 0 takes the relay's default.
	PipelineDepth int
	// Publisher is the relay's Kafka publisher: "sarama"
	// (publisher.Kafka, the default) or "franz" (publisher.Franz).
	Publisher string
	// Producers is the Kafka publisher's KafkaConfig.Producers; 0 takes
	// the publisher's default.
	Producers int
	// FlushFrequency is the Kafka publisher's sarama
	// Producer.Flush.Frequency; 0 leaves sarama's default.
	FlushFrequency time.Duration
	// LingerBatch is the Kafka publisher's KafkaConfig.LingerBatch; 0
	// takes the publisher's default, negative turns the routing by size
	// off.
	LingerBatch int
	// MaxIdleConns is the idle (and open) connection limit of every pool
	// the bench and its relay processes open; negative leaves
	// database/sql's defaults (2 idle, no open limit).
	MaxIdleConns int
	// WideBuckets is the bucket count of the drain scenario's wide run.
	WideBuckets int
	Rate        int
	Duration    time.Duration
	// Warmup is written before Duration and not counted (latency).
	Warmup time.Duration
	// Consumer is where the latency scenario's consumer runs: "process"
	// (its own) or "inline" (the bench's).
	Consumer string
	// LatencyModes are the latency scenario's modes in the order they
	// run; a mode named more than once runs again (default:
	// defaultLatencyOrder).
	LatencyModes []string
	// LatencySlice is the length of the latency scenario's turns: every
	// mode is set up at once and they write in turns of this long each
	// (measureSliced); 0 runs each mode whole, one after the other.
	LatencySlice time.Duration
	// Timeline is a directory for the latency scenario's per-message
	// timelines; empty records none.
	Timeline string
	// CPUProfile is a file for the CPU profile of the drain scenario's
	// relay drain (at the configured Parallelism), and the prefix of the
	// latency, wal and strict scenarios' profiles; empty takes none.
	CPUProfile string
	profile    string // the one run CPUProfile applies to
	// latencyProfile is the prefix of the latency scenario's profiles,
	// one per mode run (CPUProfile, in that scenario only).
	latencyProfile string
	// RelayProfiles is a directory where each relay process of the relays
	// scenario writes its CPU profile, relays-K-PID.pprof for a drain by K
	// processes; empty takes none.
	RelayProfiles string
	WriteOps      int
	Growth        []int
	Relays        []int
	JSON          bool
	TmpDir        string
	// Brokers is an Apache Kafka cluster to run against instead of the
	// Kafka-protocol broker the harness starts in its own process.
	Brokers []string
	// WALDSN is the PostgreSQL server with wal_level = logical of the wal
	// scenario, which runs both modes there.
	WALDSN string
	// WALParts are the parts of the wal scenario to run.
	WALParts []string
	// Rounds is how many interleaved rounds the wal and strict scenarios
	// run; they report their medians.
	Rounds int
	// RRBacklog is the backlog of the wal scenario's rr part.
	RRBacklog int
	// walMode makes newEnv's outbox write in outbox.ModeWAL.
	walMode bool
}

var allScenarios = []string{"drain", "latency", "write", "growth", "relays", "strict"}

// extraScenarios run only when named: they need more than the default
// servers.
var extraScenarios = []string{"wal"}

func defaultWALDSN() string {
	if v := os.Getenv("OUTBOX_TEST_POSTGRES_WAL_DSN"); v != "" {
		return v
	}
	return "host=127.0.0.1 port=5434 user=postgres dbname=test sslmode=disable"
}

func defaultDSN(driver string) string {
	switch driver {
	case "postgres":
		if v := os.Getenv("OUTBOX_TEST_POSTGRES_DSN"); v != "" {
			return v
		}
		return "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"
	case "mysql":
		if v := os.Getenv("OUTBOX_TEST_MYSQL_DSN"); v != "" {
			return v
		}
		return "root:@tcp(127.0.0.1:3306)/test?parseTime=true"
	}
	return ""
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(strings.ReplaceAll(f, "_", ""))
		if err != nil {
			return nil, fmt.Errorf("%q is not a number", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func parseFlags(args []string) (config, error) {
	fs := flag.NewFlagSet("outbox-bench", flag.ContinueOnError)
	var c config
	var scenarios, growth, relays string
	var smoke bool
	fs.StringVar(&c.Driver, "driver", "postgres", "database: postgres, mysql or sqlite")
	fs.StringVar(&c.DSN, "dsn", "", "database DSN (default: the local test server; SQLite uses a temp file)")
	fs.StringVar(&scenarios, "scenarios", strings.Join(allScenarios, ","), "comma-separated scenarios: "+strings.Join(allScenarios, ", "))
	fs.IntVar(&c.N, "n", 100_000, "messages for drain and relays")
	fs.IntVar(&c.Keys, "keys", 1000, "distinct keys")
	fs.IntVar(&c.ValueSize, "value-size", 200, "value bytes")
	fs.IntVar(&c.Buckets, "buckets", 8, "outbox buckets")
	fs.IntVar(&c.Partitions, "partitions", 8, "topic partitions")
	fs.IntVar(&c.BatchSize, "batch", relay.BatchSizeDefault, "relay batch size (the relay's default, relay.BatchSizeDefault)")
	fs.IntVar(&c.StrictBatch, "strict-batch", 0, "strict: the strict drain's relay batch size (0: -batch if given, else the relay's default for a strict-mode publisher, relay.BatchSizeReconcilerDefault)")
	fs.IntVar(&c.Parallelism, "parallelism", 0, "relay Parallelism (0: the relay's default)")
	fs.IntVar(&c.PipelineDepth, "pipeline-depth", 0, "relay PipelineDepth, batches of a bucket in flight with -publisher franz (0: the relay's default; 1: one at a time)")
	fs.StringVar(&c.Publisher, "publisher", publisherSarama, "the relay's Kafka publisher: sarama (publisher.Kafka) or franz (publisher.Franz; -producers, -linger-batch and -flush-frequency do not apply)")
	fs.IntVar(&c.Producers, "producers", 0, "Kafka publisher's Producers (0: the publisher's default)")
	fs.IntVar(&c.LingerBatch, "linger-batch", 0, "Kafka publisher's LingerBatch, the smallest batch sent through a slot's lingering producer (0: the publisher's default; negative: no routing by size)")
	fs.DurationVar(&c.FlushFrequency, "flush-frequency", 0, "Kafka publisher's sarama Producer.Flush.Frequency, how long a producer gathers records before a request (0: sarama's default, a request as soon as the connection is free)")
	fs.IntVar(&c.MaxIdleConns, "max-idle-conns", 16, "connections each database pool keeps idle, and its open limit (-1: database/sql's defaults, 2 idle and no open limit, as in an application that sets neither, which the GORM store raises itself; -2: the same defaults set explicitly with SetMaxIdleConns(2), which the store keeps: an untuned pool)")
	fs.IntVar(&c.WideBuckets, "wide-buckets", 256, "drain: bucket count of the wide drain, compared with -buckets")
	fs.IntVar(&c.Rate, "rate", 1000, "latency: transactions per second")
	fs.DurationVar(&c.Duration, "duration", 10*time.Second, "latency: how long to write")
	fs.StringVar(&c.Consumer, "consumer", "process", "latency: run the consumer in its own process, or inline in the bench's, sharing its CPU and Go runtime with the writer and the relay")
	var latencyOrder string
	fs.StringVar(&latencyOrder, "latency-modes", strings.Join(defaultLatencyOrder, ","), "latency: comma-separated modes in the order they run, a mode named more than once running again (its figures then pool every run's messages, each run's also reported as MODE.K_...): "+strings.Join(latencyModeNames(), ", "))
	fs.DurationVar(&c.LatencySlice, "latency-slice", time.Second, "latency: set every mode up at once and write them in turns of this long each, the turns' order reversed every rotation, so that every mode's figures span the whole run (a mode named more than once runs once); 0 runs each mode whole, one after the other")
	fs.StringVar(&c.Timeline, "timeline", "", "latency: record each message's path through the relay into this directory and summarise the slow ones (costs some speed)")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "drain: write the CPU profile of this process during the relay drain to this file; latency: during each mode's writes and deliveries to this file's name followed by .MODE; wal: during the first WAL mode drain through the acknowledging publisher; strict: during each round's drains to this file's name followed by .default.N and .strict.N")
	fs.StringVar(&c.RelayProfiles, "relay-cpuprofiles", "", "relays: write the CPU profile of each relay process, from its start to its exit, into this directory as relays-K-PID.pprof (K relay processes)")
	fs.DurationVar(&c.Warmup, "warmup", time.Second, "latency: how long to write before -duration, delivered but not counted (fresh connections run 2-3x slower)")
	fs.IntVar(&c.WriteOps, "write-ops", 3000, "write: transactions per side")
	fs.StringVar(&growth, "growth", "10000,100000,1000000", "growth: backlog sizes")
	fs.StringVar(&relays, "relays", "1,2,4", "relays: relay process counts")
	fs.BoolVar(&c.JSON, "json", false, "print one JSON object per scenario instead of a table")
	fs.BoolVar(&smoke, "smoke", false, "tiny sizes: check every scenario runs (CI), measure nothing")
	var parts string
	fs.StringVar(&c.WALDSN, "wal-dsn", defaultWALDSN(), "wal: PostgreSQL server with wal_level = logical; the wal scenario runs table mode and WAL mode there (env OUTBOX_TEST_POSTGRES_WAL_DSN)")
	fs.StringVar(&parts, "wal-parts", strings.Join(allWALParts, ","), "wal: comma-separated parts: "+strings.Join(allWALParts, ", "))
	fs.IntVar(&c.Rounds, "rounds", 3, "wal, strict: interleaved rounds, whose medians are reported")
	fs.IntVar(&c.RRBacklog, "rr-backlog", 400_000, "wal: backlog relayed while the rr part's REPEATABLE READ transaction stays open")
	var brokers string
	fs.StringVar(&brokers, "brokers", os.Getenv("KAFKA_BROKERS"), "comma-separated brokers of a real Kafka cluster (env KAFKA_BROKERS); empty starts a kfake broker process")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.StrictBatch == 0 {
		fs.Visit(func(f *flag.Flag) {
			if f.Name == "batch" {
				c.StrictBatch = c.BatchSize // -batch sets both modes' batch
			}
		})
	}
	for _, b := range strings.Split(brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			c.Brokers = append(c.Brokers, b)
		}
	}
	var err error
	if c.Growth, err = parseInts(growth); err != nil {
		return c, fmt.Errorf("-growth: %w", err)
	}
	if c.Relays, err = parseInts(relays); err != nil {
		return c, fmt.Errorf("-relays: %w", err)
	}
	if smoke {
		c.N, c.Keys, c.Rate, c.Duration, c.WriteOps = 2000, 100, 200, time.Second, 100
		c.Warmup = 200 * time.Millisecond
		c.Growth, c.Relays = []int{500, 2000}, []int{1, 2}
		c.Rounds, c.RRBacklog = 1, 2000
	}
	for _, p := range strings.Split(parts, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if !slices.Contains(allWALParts, p) {
			return c, fmt.Errorf("unknown -wal-parts part %q (known: %s)", p, strings.Join(allWALParts, ", "))
		}
		c.WALParts = append(c.WALParts, p)
	}
	if c.LatencyModes, err = parseLatencyModes(latencyOrder); err != nil {
		return c, fmt.Errorf("-latency-modes: %w", err)
	}
	if c.LatencySlice < 0 {
		return c, fmt.Errorf("-latency-slice must not be negative")
	}
	if c.Rounds < 1 || c.RRBacklog < 1 {
		return c, fmt.Errorf("-rounds and -rr-backlog must be positive")
	}
	if c.Publisher != publisherSarama && c.Publisher != publisherFranz {
		return c, fmt.Errorf("unknown -publisher %q (known: %s, %s)", c.Publisher, publisherSarama, publisherFranz)
	}
	for _, s := range strings.Split(scenarios, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(allScenarios, s) && !slices.Contains(extraScenarios, s) {
			return c, fmt.Errorf("unknown scenario %q (known: %s)", s, strings.Join(append(slices.Clone(allScenarios), extraScenarios...), ", "))
		}
		c.Scenarios = append(c.Scenarios, s)
	}
	if c.DSN == "" {
		c.DSN = defaultDSN(c.Driver)
	}
	if c.Driver != "sqlite" && c.DSN == "" {
		return c, fmt.Errorf("-dsn is required for %s", c.Driver)
	}
	if c.MaxIdleConns == 0 || c.MaxIdleConns < -2 {
		return c, fmt.Errorf("-max-idle-conns must be positive, -1 for database/sql's defaults or -2 for them set explicitly")
	}
	if c.Parallelism < 0 || c.PipelineDepth < 0 || c.StrictBatch < 0 || c.WideBuckets < 1 {
		return c, fmt.Errorf("-parallelism, -pipeline-depth and -strict-batch must be 0 or positive and -wide-buckets positive")
	}
	if c.Consumer != "process" && c.Consumer != "inline" {
		return c, fmt.Errorf("-consumer must be process or inline, not %q", c.Consumer)
	}
	if c.FlushFrequency < 0 {
		return c, fmt.Errorf("-flush-frequency must not be negative")
	}
	if c.Warmup < 0 {
		return c, fmt.Errorf("-warmup must not be negative")
	}
	if c.N < 1 || c.Keys < 1 || c.Buckets < 1 || c.Partitions < 1 || c.BatchSize < 1 || c.Rate < 1 {
		return c, fmt.Errorf("sizes must be positive")
	}
	return c, nil
}

// result is one scenario's outcome: named figures, in order.
type result struct {
	Scenario string         `json:"scenario"`
	Driver   string         `json:"driver"`
	Params   map[string]any `json:"params"`
	Figures  []figure       `json:"-"`
	Values   map[string]any `json:"figures"`
	Notes    []string       `json:"notes,omitempty"`
	Err      string         `json:"error,omitempty"`
}

type figure struct {
	Name  string
	Value float64
	Unit  string
}

func (r *result) add(name string, v float64, unit string) {
	r.Figures = append(r.Figures, figure{name, v, unit})
	if r.Values == nil {
		r.Values = map[string]any{}
	}
	r.Values[name] = v
}

func main() {
	switch os.Getenv("OUTBOX_BENCH_ROLE") {
	case "broker":
		os.Exit(runBrokerRole())
	case "relay":
		os.Exit(runRelayRole())
	case "consumer":
		os.Exit(runConsumerRole())
	}
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	useExternalBrokers(cfg.Brokers)
	kafkaProducers = cfg.Producers
	kafkaPublisher = cfg.Publisher
	kafkaFlushFrequency = cfg.FlushFrequency
	kafkaLingerBatch = cfg.LingerBatch
	results, err := run(ctx, cfg, os.Stderr)
	print(os.Stdout, cfg, results)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(1)
	}
	for _, r := range results {
		if r.Err != "" {
			os.Exit(1)
		}
	}
}

// run runs every selected scenario and returns their results; progress
// goes to log.
func run(ctx context.Context, cfg config, log io.Writer) ([]*result, error) {
	tmp, err := os.MkdirTemp(cfg.TmpDir, "outbox-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	cfg.TmpDir = tmp
	var cluster map[string]any
	if len(externalBrokers) > 0 {
		if cluster, err = clusterParams(externalBrokers); err != nil {
			return nil, err
		}
	}
	var results []*result
	for _, s := range cfg.Scenarios {
		fmt.Fprintf(log, "outbox-bench: %s on %s...\n", s, cfg.Driver)
		start := time.Now()
		r := &result{Scenario: s, Driver: cfg.Driver, Params: maps.Clone(cluster)}
		if r.Params == nil {
			r.Params = map[string]any{}
		}
		if err := scenarios[s](ctx, cfg, r); err != nil {
			r.Err = err.Error()
		}
		fmt.Fprintf(log, "outbox-bench: %s done in %s\n", s, time.Since(start).Round(time.Millisecond))
		results = append(results, r)
		if ctx.Err() != nil {
			return results, ctx.Err()
		}
	}
	return results, nil
}

var scenarios = map[string]func(context.Context, config, *result) error{
	"drain":   drainScenario,
	"latency": latencyScenario,
	"write":   writeScenario,
	"growth":  growthScenario,
	"relays":  relaysScenario,
	"strict":  strictScenario,
	"wal":     walScenario,
}

func print(w io.Writer, cfg config, results []*result) {
	if cfg.JSON {
		enc := json.NewEncoder(w)
		for _, r := range results {
			_ = enc.Encode(r)
		}
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\tfigure\tvalue\tunit")
	for _, r := range results {
		if r.Err != "" {
			fmt.Fprintf(tw, "%s\tERROR\t%s\t\n", r.Scenario, r.Err)
			continue
		}
		for _, f := range r.Figures {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.Scenario, f.Name, formatValue(f.Value), f.Unit)
		}
	}
	tw.Flush()
	// Notes after the table: they are sentences, too long for a column.
	for _, r := range results {
		for _, n := range r.Notes {
			fmt.Fprintf(w, "%s note: %s\n", r.Scenario, n)
		}
	}
}

func formatValue(v float64) string {
	switch {
	case v == float64(int64(v)) && v < 1e12:
		return strconv.FormatInt(int64(v), 10)
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	default:
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
}

func runBrokerRole() int {
	parts, _ := strconv.Atoi(os.Getenv("OUTBOX_BENCH_PARTITIONS"))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	err := devbroker.Run(ctx, devbroker.Options{Partitions: int32(parts), Blackhole: os.Getenv("OUTBOX_BENCH_BLACKHOLE") == "1"}, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p)
	return sorted[i]
}

func sortDurations(d []time.Duration) { sort.Slice(d, func(i, j int) bool { return d[i] < d[j] }) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// warnings logs warnings and errors to stderr: the Franz publisher's, so
// that a client replacement (a stall) shows beside the figures it
// affects.
var warnings = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
