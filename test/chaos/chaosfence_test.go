package chaos_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// TestChaosStrictFencing is strict mode's fencing, step by step, with two
// relay processes in network namespaces of their own (netlab_test.go) and
// one bucket:
//
//  1. relay 0 owns the bucket and publishes a first batch;
//  2. messages are written; relay 0 produces them in a transaction, and
//     as its commit (EndTxn) reaches the broker, the broker drops it and
//     relay 0 is cut off from the brokers: the transaction stays open,
//     its records written, uncommitted. Relay 0 is cut off from the
//     database too;
//  3. relay 1 starts; once relay 0's lease lapsed it takes the bucket,
//     initialises the bucket's transactional id (which fences relay 0's
//     epoch and aborts its open transaction), publishes the rows and
//     deletes them;
//  4. relay 0's link to the brokers heals, its database link still cut:
//     its commit, retried, reaches the broker.
//
// Asserted: relay 0's commit fails as fenced (the publisher logs "producer
// fenced" with PRODUCER_FENCED or INVALID_PRODUCER_EPOCH); relay 0's
// records of that transaction are in the log (a read_uncommitted consumer
// sees them) but a read_committed consumer never sees them; every
// committed message is delivered; relay 0 deletes nothing from the cut
// on. The transaction timeout is a minute, far past the scenario, so only
// the takeover's InitProducerID can end relay 0's transaction: a takeover
// under another transactional id fails the test.
func TestChaosStrictFencing(t *testing.T) {
	if os.Getenv(kafkatest.EnvBrokers) != "" {
		t.Skip("holds a commit in the broker (kfake): runs in the kfake pass")
	}
	dbtest.Require(t, dbtest.Postgres)
	const lease = 2 * time.Second
	p := loadParams(t, true)
	lab := newNetLab(t, 2, p.seed)
	d := dbtest.Open(t, dbtest.Postgres)
	ctx := context.Background()
	plugin, err := outbox.NewPlugin(outbox.Config{BucketCount: 1, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	require.NoError(t, d.DB.Use(plugin))
	require.NoError(t, plugin.AutoMigrate(ctx, d.DB))
	require.NoError(t, d.DB.AutoMigrate(&order{}))
	tables := plugin.Config().Tables
	audit := installDeleteAudit(t, d.DB, tables.MessagesTable(), tables.LeasesTable())

	topic := "chaos-fence-" + d.Namespace
	fake, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.ListenFn(lab.listen), kfake.SeedTopics(3, topic))
	require.NoError(t, err)
	t.Cleanup(fake.Close)

	txnPrefix := "chaos-" + d.Namespace + "-"
	logDir := t.TempDir()
	if dir := os.Getenv(EnvLogDir); dir != "" {
		logDir = fmt.Sprintf("%s/fencing-%d", dir, time.Now().Unix())
		require.NoError(t, os.MkdirAll(logDir, 0o755))
	}
	pr := &procs{
		t: t,
		args: relayArgs{
			bin: relayBinary(t), dsn: d.DSN, tag: "chaos-" + d.Namespace, brokers: fake.ListenAddrs, logDir: logDir, net: lab,
			flags: []string{
				"-mode", "strict", "-txn-prefix", txnPrefix, "-txn-timeout", "1m",
				"-buckets", "1", "-batch", "200", "-lease", lease.String(), "-renew", "500ms",
				"-poll", chaosPoll.String(), "-backoff-min", "50ms", "-backoff-max", "1s",
			},
		},
		slots: make([]*relayProc, 2),
		log:   &eventLog{},
	}
	dsnFor, err := lab.dbDSN(d.DSN)
	require.NoError(t, err)
	pr.args.dsnFor = dsnFor
	t.Cleanup(pr.killAll)

	q := d.DB.Statement.Quote
	pending := func() int64 {
		var n int64
		require.NoError(t, d.DB.Raw("SELECT COUNT(*) FROM "+q(tables.MessagesTable())).Scan(&n).Error)
		return n
	}
	owner := func() string {
		var o []string
		require.NoError(t, d.DB.Raw("SELECT owner FROM "+q(tables.LeasesTable())+" WHERE bucket = 0 AND expires_at_ms > ?",
			time.Now().UnixMilli()).Scan(&o).Error)
		if len(o) == 0 {
			return ""
		}
		return o[0]
	}
	within := 30 * time.Second

	// 1. Relay 0 owns the bucket and publishes.
	pr.start(0)
	require.Eventually(t, func() bool { return strings.HasPrefix(owner(), "chaos-0-") }, within, 50*time.Millisecond, "relay 0 takes the bucket")
	first := writeBacklog(t, d.DB, plugin, topic, 100, 50, nil, "fence-1a", "fence-1b", "fence-1c", "fence-1d")
	require.Eventually(t, func() bool { return pending() == 0 }, within, 50*time.Millisecond, "relay 0 publishes the first batch")

	// 2. Relay 0's next commit is dropped at the broker as relay 0 is cut
	// off from it.
	var (
		mu    sync.Mutex
		stale *kmsg.EndTxnRequest
		cutAt time.Time
	)
	held := make(chan error, 1)
	fake.ControlKey(int16(kmsg.EndTxn), func(r kmsg.Request) (kmsg.Response, error, bool) {
		req := r.(*kmsg.EndTxnRequest)
		if !req.Commit || !strings.HasPrefix(req.TransactionalID, txnPrefix) {
			return nil, nil, false
		}
		// The cut before the drop: relay 0 sees neither the answer nor the
		// closed connection, and its retries do not get through.
		err := lab.partition(0, linkBroker)
		mu.Lock()
		stale, cutAt = req, time.Now()
		mu.Unlock()
		held <- err
		return nil, errors.New("chaos: commit dropped, relay cut off from the brokers"), true
	})
	second := writeBacklog(t, d.DB, plugin, topic, 60, 60, nil, "fence-2a", "fence-2b", "fence-2c", "fence-2d")
	var secondIDs []string
	require.NoError(t, d.DB.Model(&order{}).Order("id DESC").Limit(second).Pluck("msg_id", &secondIDs).Error)
	inSecond := map[string]bool{}
	for _, id := range secondIDs {
		inSecond[id] = true
	}
	select {
	case err := <-held:
		require.NoError(t, err, "cut relay 0 off from the brokers")
	case <-time.After(within):
		t.Fatalf("relay 0 did not commit the second batch within %s", within)
	}
	require.NoError(t, lab.partition(0, linkDB))
	mu.Lock()
	staleID, staleEpoch, cut := stale.ProducerID, stale.ProducerEpoch, cutAt
	mu.Unlock()
	t.Logf("chaos fencing: relay 0's commit (producer %d, epoch %d) dropped, relay 0 cut off from brokers and database", staleID, staleEpoch)

	// 3. Relay 1 takes the bucket over and publishes the rows.
	pr.start(1)
	require.Eventually(t, func() bool { return strings.HasPrefix(owner(), "chaos-1-") }, within, 50*time.Millisecond, "relay 1 takes the bucket once relay 0's lease lapsed")
	require.Eventually(t, func() bool { return pending() == 0 }, within, 50*time.Millisecond, "relay 1 publishes the second batch")

	// 4. Relay 0's broker link heals, its database link still cut: its
	// commit must be refused as fenced.
	require.NoError(t, lab.heal(0, linkBroker))
	// Its retries reach the broker within seconds of the heal (a read
	// timeout of 5 s, a dial timeout of 2 s); the outcome is asserted
	// with the rest below.
	var fenced string
	for deadline := time.Now().Add(time.Minute); fenced == "" && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond) // polling relay 0's log
		fenced = fencedLine(pr.slots[0].logPath)
	}
	t.Logf("chaos fencing: relay 0 logged: %q", fenced)

	// Everything heals; more messages, which relay 1 publishes while
	// relay 0 is back, then both stop.
	require.NoError(t, lab.heal(0, linkDB))
	third := writeBacklog(t, d.DB, plugin, topic, 60, 20, nil, "fence-3a", "fence-3b", "fence-3c", "fence-3d")
	require.Eventually(t, func() bool { return pending() == 0 }, within, 50*time.Millisecond, "the third batch is published")
	require.Empty(t, pr.stopAll(termTimeout), "both relays stop gracefully")

	// What the consumers see.
	var rows []order
	require.NoError(t, d.DB.Select("k", "seq", "msg_id").Find(&rows).Error)
	require.Len(t, rows, first+second+third)
	expected := make(map[string]ref, len(rows))
	for _, r := range rows {
		expected[r.MsgID] = ref{key: r.K, seq: r.Seq}
	}
	committed := readStamped(t, fake.ListenAddrs(), topic, true)
	uncommitted := readStamped(t, fake.ListenAddrs(), topic, false)
	// Relay 1 initialised the same transactional id: the same producer
	// id, a later epoch.
	isStale := func(r stamped) bool { return inSecond[r.id] && r.producer == staleID && r.epoch == staleEpoch }
	var staleSeen, staleWritten int
	seen := map[string]bool{}
	for _, r := range committed {
		seen[r.id] = true
		if isStale(r) {
			staleSeen++
		}
	}
	for _, r := range uncommitted {
		if isStale(r) {
			staleWritten++
		}
	}
	var lost []string
	for id := range expected {
		if !seen[id] {
			lost = append(lost, id)
		}
	}
	_, _, foreign := audit.foreignDeletes(t, pr.args.tag)
	var lateDeletes int64
	require.NoError(t, d.DB.Raw("SELECT COALESCE(SUM(n), 0) FROM chaos_deletes WHERE app = ? AND at_ms >= ?",
		pr.appName(0), cut.UnixMilli()).Scan(&lateDeletes).Error)
	t.Logf("chaos fencing summary: messages=%d lost=%d records read_committed=%d read_uncommitted=%d stale_records_written=%d stale_records_visible=%d relay0_deletes_after_cut=%d foreign_deletes=%d",
		len(expected), len(lost), len(committed), len(uncommitted), staleWritten, staleSeen, lateDeletes, len(foreign))

	assert.NotEmpty(t, fenced, "relay 0's commit, retried after the heal, is refused as fenced")
	assert.True(t, strings.Contains(fenced, sarama.ErrProducerFenced.Error()) || strings.Contains(fenced, sarama.ErrInvalidProducerEpoch.Error()),
		"relay 0 fenced by PRODUCER_FENCED or INVALID_PRODUCER_EPOCH: %s", fenced)
	require.Positive(t, staleWritten, "relay 0's open transaction wrote records (read_uncommitted sees them)")
	assert.Zero(t, staleSeen, "a read_committed consumer never sees the fenced transaction's records")
	assert.Empty(t, lost, "every committed message is delivered")
	assert.Zero(t, lateDeletes, "relay 0 deletes nothing after it was cut off")
	assert.Empty(t, foreign, "no relay deletes in a bucket another relay holds")
}

// fencedLine returns the publisher's "producer fenced" log line in the
// log at path, or "".
func fencedLine(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line struct {
			Msg   string `json:"msg"`
			Error string `json:"error"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && strings.HasPrefix(line.Msg, "producer fenced") {
			return line.Msg + ": " + line.Error
		}
	}
	return ""
}

// stamped is a record with its producer id and epoch.
type stamped struct {
	id       string
	producer int64
	epoch    int16
}

// readStamped reads the whole topic, read_committed or read_uncommitted,
// until nothing new came for two seconds.
func readStamped(t *testing.T, brokers []string, topic string, committed bool) []stamped {
	t.Helper()
	opts := []kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(200 * time.Millisecond)}
	if committed {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	} else {
		opts = append(opts, kgo.FetchIsolationLevel(kgo.ReadUncommitted()))
	}
	cl, err := kgo.NewClient(opts...)
	require.NoError(t, err)
	defer cl.Close()
	var out []stamped
	last := time.Now()
	deadline := time.Now().Add(time.Minute)
	for time.Since(last) < 2*time.Second && time.Now().Before(deadline) {
		pctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		fs := cl.PollFetches(pctx)
		cancel()
		fs.EachRecord(func(r *kgo.Record) {
			last = time.Now()
			s := stamped{producer: r.ProducerID, epoch: r.ProducerEpoch}
			for _, h := range r.Headers {
				if h.Key == "x-outbox-message-id" {
					s.id = string(h.Value)
				}
			}
			out = append(out, s)
		})
	}
	return out
}
