// Package kafkatest gives tests a Kafka-protocol cluster, unique topics and
// a reader that returns what the brokers hold.
//
// By default Start runs an in-process kfake cluster on loopback, one per
// test, so tests can run in parallel and inject faults through Fake. When
// the environment variable KAFKA_BROKERS names a real cluster
// ("host:port,host:port"), Start uses it instead: topics get unique names
// and are deleted at the end of the test, and Fake returns nil, so tests that
// need fault injection call RequireFake, which skips them there.
//
// The helper talks to the cluster with franz-go (kgo), not with sarama, so
// that what a test reads back does not depend on the client under test.
package kafkatest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// EnvBrokers is the environment variable that, when set, points Start at a
// real cluster instead of starting a kfake cluster.
const EnvBrokers = "KAFKA_BROKERS"

// adminTimeout bounds each admin operation (topic creation, offsets).
const adminTimeout = 30 * time.Second

// Option configures Start.
type Option func(*options)

type options struct {
	numBrokers int
	seeds      []seed
	blackhole  bool
	inProcess  bool
}

type seed struct {
	partitions int32
	topics     []string
}

// NumBrokers sets how many brokers the kfake cluster runs, default 1. It
// has no effect on a real cluster.
func NumBrokers(n int) Option {
	return func(o *options) { o.numBrokers = n }
}

// InProcess starts a kfake cluster even when KAFKA_BROKERS names a real
// one: for tests whose subject is not the broker (the database, the WAL
// slot), which must not share a real cluster other tests fault.
func InProcess() Option {
	return func(o *options) { o.inProcess = true }
}

// BlackholeProduce makes the kfake cluster acknowledge produce requests
// without storing the records, for benchmarks that should measure the
// client rather than the fake broker's memory. Nothing can be read back.
// It has no effect on a real cluster.
func BlackholeProduce() Option {
	return func(o *options) { o.blackhole = true }
}

// SeedTopics creates the named topics with the given number of partitions
// when the cluster starts. On a real cluster an existing topic is kept as
// is. Prefer Cluster.Topic, whose names are unique.
func SeedTopics(partitions int32, topics ...string) Option {
	return func(o *options) { o.seeds = append(o.seeds, seed{partitions, topics}) }
}

// Cluster is a running cluster. Everything it started is stopped on the
// test's cleanup.
type Cluster struct {
	fake    *kfake.Cluster
	brokers []string
	admin   *kgo.Client
}

// Start starts a cluster for t, or connects to the one in KAFKA_BROKERS.
func Start(t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	o := options{numBrokers: 1}
	for _, opt := range opts {
		opt(&o)
	}

	c := &Cluster{}
	if env := os.Getenv(EnvBrokers); env != "" && !o.inProcess {
		for _, b := range strings.Split(env, ",") {
			if b = strings.TrimSpace(b); b != "" {
				c.brokers = append(c.brokers, b)
			}
		}
	} else {
		kopts := []kfake.Opt{kfake.NumBrokers(o.numBrokers)}
		if o.blackhole {
			kopts = append(kopts, kfake.BlackholeProduce())
		}
		for _, s := range o.seeds {
			kopts = append(kopts, kfake.SeedTopics(s.partitions, s.topics...))
		}
		fake, err := kfake.NewCluster(kopts...)
		require.NoError(t, err, "kafkatest: start kfake cluster")
		t.Cleanup(fake.Close)
		c.fake = fake
		c.brokers = fake.ListenAddrs()
	}

	admin, err := kgo.NewClient(kgo.SeedBrokers(c.brokers...), kgo.RetryTimeout(adminTimeout))
	require.NoError(t, err, "kafkatest: admin client")
	// Cleanups run last-in first-out: the admin client closes before the
	// kfake cluster does.
	t.Cleanup(admin.Close)
	c.admin = admin

	if c.fake == nil {
		for _, s := range o.seeds {
			for _, name := range s.topics {
				c.createTopic(t, name, s.partitions, nil, true)
			}
		}
	}
	return c
}

// Connect returns the cluster of brokers, a real cluster the caller runs
// (not the one of KAFKA_BROKERS).
func Connect(t testing.TB, brokers []string) *Cluster {
	t.Helper()
	admin, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.RetryTimeout(adminTimeout))
	require.NoError(t, err, "kafkatest: admin client")
	t.Cleanup(admin.Close)
	return &Cluster{brokers: slices.Clone(brokers), admin: admin}
}

// Brokers returns the addresses to bootstrap a client with. On a kfake
// cluster they reflect nodes added or removed since Start.
func (c *Cluster) Brokers() []string {
	if c.fake != nil {
		return c.fake.ListenAddrs()
	}
	return slices.Clone(c.brokers)
}

// Fake returns the kfake cluster for fault injection, or nil on a real
// cluster.
func (c *Cluster) Fake() *kfake.Cluster { return c.fake }

// RequireFake returns the kfake cluster, skipping t on a real cluster.
func (c *Cluster) RequireFake(t testing.TB) *kfake.Cluster {
	t.Helper()
	if c.fake == nil {
		t.Skipf("kafkatest: kfake only: this test injects a broker fault or observes requests, which Apache Kafka (%s) cannot be made to do on demand; it runs on kfake in the default pass", EnvBrokers)
	}
	return c.fake
}

// HoldRequest makes the kfake broker hold the first request of key that
// match accepts (any request of key for a nil match) until release is
// closed; held is closed once it is held. The requests match refuses, and
// every one after the held one, are handled as usual.
func HoldRequest(fake *kfake.Cluster, key kmsg.Key, match func(kmsg.Request) bool) (held, release chan struct{}) {
	held, release = make(chan struct{}), make(chan struct{})
	var once sync.Once
	fake.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if match != nil && !match(req) {
			return nil, nil, false // not handled: the control stays
		}
		first := false
		once.Do(func() { first = true })
		if !first {
			fake.DropControl()
			return nil, nil, false
		}
		close(held)
		fake.SleepControl(func() { <-release })
		return nil, nil, false // then handle it as usual
	})
	return held, release
}

// TopicOption configures a topic that Topic creates.
type TopicOption func(map[string]*string)

// TopicConfig sets a topic-level config, for example "max.message.bytes".
func TopicConfig(key, value string) TopicOption {
	return func(m map[string]*string) { m[key] = &value }
}

var topicSeq atomic.Int64

// Topic creates a topic with a name unique to this test run and returns
// its name. It waits until every partition has a leader. On a real cluster
// the topic is deleted when the test ends.
func (c *Cluster) Topic(t testing.TB, partitions int32, opts ...TopicOption) string {
	t.Helper()
	configs := map[string]*string{}
	for _, opt := range opts {
		opt(configs)
	}
	name := uniqueName(t.Name())
	c.createTopic(t, name, partitions, configs, false)
	if c.fake == nil {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
			defer cancel()
			req := kmsg.NewPtrDeleteTopicsRequest()
			req.TopicNames = []string{name}
			rt := kmsg.NewDeleteTopicsRequestTopic()
			rt.Topic = &name
			req.Topics = append(req.Topics, rt)
			if _, err := req.RequestWith(ctx, c.admin); err != nil {
				t.Logf("kafkatest: delete topic %q: %v", name, err)
			}
		})
	}
	return name
}

// uniqueName derives a legal topic name from a test name.
func uniqueName(testName string) string {
	var b strings.Builder
	for _, r := range testName {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	base := b.String()
	if len(base) > 150 {
		base = base[:150]
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	return fmt.Sprintf("outbox-%s-%d-%s", base, topicSeq.Add(1), hex.EncodeToString(rnd[:]))
}

func (c *Cluster) createTopic(t testing.TB, name string, partitions int32, configs map[string]*string, existsOK bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()

	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = int32(adminTimeout / time.Millisecond)
	rt := kmsg.NewCreateTopicsRequestTopic()
	rt.Topic = name
	rt.NumPartitions = partitions
	rt.ReplicationFactor = -1 // the broker's default.replication.factor
	for k, v := range configs {
		cfg := kmsg.NewCreateTopicsRequestTopicConfig()
		cfg.Name, cfg.Value = k, v
		rt.Configs = append(rt.Configs, cfg)
	}
	req.Topics = append(req.Topics, rt)
	// A request cut by a broker fault (the chaos tests kill and pause the
	// brokers of a cluster other tests use at the same time) or answered
	// with a retriable error is sent again until adminTimeout. The topic
	// an earlier attempt created then exists: the request's own topic,
	// since names are unique.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	sent := false
	for {
		resp, err := req.RequestWith(ctx, c.admin)
		if err == nil {
			require.Len(t, resp.Topics, 1)
			err = kerr.ErrorForCode(resp.Topics[0].ErrorCode)
			if errors.Is(err, kerr.TopicAlreadyExists) && (existsOK || sent) {
				err = nil
			}
			if err == nil || !kerr.IsRetriable(err) {
				require.NoError(t, err, "kafkatest: create topic %q", name)
				break
			}
		}
		sent = true
		select {
		case <-ctx.Done():
			require.NoError(t, err, "kafkatest: create topic %q (retried until %s)", name, adminTimeout)
		case <-tick.C:
		}
	}
	c.waitForLeaders(t, ctx, name, partitions)
}

// AutoCreatesTopics reports whether the cluster creates a topic when a
// client asks for its metadata (auto.create.topics.enable). A kfake
// cluster does not.
func (c *Cluster) AutoCreatesTopics(t testing.TB) bool {
	t.Helper()
	if c.fake != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()
	meta, err := kmsg.NewPtrMetadataRequest().RequestWith(ctx, c.admin)
	require.NoError(t, err, "kafkatest: metadata")
	require.NotEmpty(t, meta.Brokers, "kafkatest: metadata lists no broker")
	req := kmsg.NewPtrDescribeConfigsRequest()
	rr := kmsg.NewDescribeConfigsRequestResource()
	rr.ResourceType = kmsg.ConfigResourceTypeBroker
	rr.ResourceName = fmt.Sprint(meta.Brokers[0].NodeID)
	rr.ConfigNames = []string{"auto.create.topics.enable"}
	req.Resources = append(req.Resources, rr)
	resp, err := req.RequestWith(ctx, c.admin)
	require.NoError(t, err, "kafkatest: describe broker config")
	for _, r := range resp.Resources {
		for _, cfg := range r.Configs {
			if cfg.Name == "auto.create.topics.enable" && cfg.Value != nil {
				return *cfg.Value == "true"
			}
		}
	}
	return true // the broker default
}

// waitForLeaders polls metadata until the topic has all its partitions
// and each has a leader: a real cluster propagates a new topic to the
// brokers' metadata caches asynchronously.
func (c *Cluster) waitForLeaders(t testing.TB, ctx context.Context, topic string, partitions int32) {
	t.Helper()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	var last string
	for {
		req := kmsg.NewPtrMetadataRequest()
		rt := kmsg.NewMetadataRequestTopic()
		rt.Topic = &topic
		req.Topics = append(req.Topics, rt)
		resp, err := req.RequestWith(ctx, c.admin)
		switch {
		case err != nil:
			last = err.Error()
		case len(resp.Topics) != 1:
			last = fmt.Sprintf("%d topics in metadata", len(resp.Topics))
		default:
			mt := resp.Topics[0]
			ready := kerr.ErrorForCode(mt.ErrorCode) == nil && len(mt.Partitions) >= int(partitions)
			for _, p := range mt.Partitions {
				if p.Leader < 0 || kerr.ErrorForCode(p.ErrorCode) != nil {
					ready = false
				}
			}
			if ready {
				if last = c.notServing(ctx, topic, partitions); last == "" {
					return
				}
				break
			}
			last = fmt.Sprintf("topic error %v, %d partitions", kerr.ErrorForCode(mt.ErrorCode), len(mt.Partitions))
		}
		select {
		case <-ctx.Done():
			t.Fatalf("kafkatest: topic %q not ready within %v: %s", topic, adminTimeout, last)
		case <-tick.C:
		}
	}
}

// notServing asks every partition's leader for the partition's end offset
// (a read that writes nothing) and describes the first partition whose
// leader does not serve it yet, or returns "". A real broker lists itself
// as a new partition's leader in metadata a moment before it serves the
// partition, and answers NOT_LEADER_OR_FOLLOWER meanwhile: a test's first
// produce would then go through the producer's retry path.
func (c *Cluster) notServing(ctx context.Context, topic string, partitions int32) string {
	if c.fake != nil {
		return ""
	}
	req := kmsg.NewPtrListOffsetsRequest()
	rt := kmsg.NewListOffsetsRequestTopic()
	rt.Topic = topic
	for p := range partitions {
		rp := kmsg.NewListOffsetsRequestTopicPartition()
		rp.Partition = p
		rp.Timestamp = -1 // the end offset
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, c.admin)
	if err != nil {
		return "list offsets: " + err.Error()
	}
	served := 0
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return fmt.Sprintf("partition %d: %v", p.Partition, err)
			}
			served++
		}
	}
	if served < int(partitions) {
		return fmt.Sprintf("%d of %d partitions answered list offsets", served, partitions)
	}
	return ""
}

// Header is one record header.
type Header struct {
	Key   string
	Value []byte
}

// Record is a record read back from the cluster. Key and Value are nil for
// a null key or value.
type Record struct {
	Topic     string
	Partition int32
	Offset    int64
	Key       []byte
	Value     []byte
	Headers   []Header
	// ProducerID is the id of the idempotent or transactional producer
	// that wrote the record, -1 for a plain producer's.
	ProducerID int64
}

// ReadOption configures ReadAll and ReadLog.
type ReadOption func(*readOptions)

type readOptions struct {
	committed bool
}

// ReadCommitted makes ReadAll and ReadLog skip records of aborted or still
// open transactions (isolation level read_committed). The default is
// read_uncommitted.
func ReadCommitted() ReadOption {
	return func(o *readOptions) { o.committed = true }
}

// consumer returns a client consuming topic from its oldest offsets.
func (c *Cluster) consumer(t testing.TB, topic string, ro readOptions, extra ...kgo.Opt) *kgo.Client {
	t.Helper()
	kopts := []kgo.Opt{
		kgo.SeedBrokers(c.Brokers()...),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.MetadataMinAge(50 * time.Millisecond),
	}
	if ro.committed {
		kopts = append(kopts, kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	}
	cl, err := kgo.NewClient(append(kopts, extra...)...)
	require.NoError(t, err, "kafkatest: consumer client")
	return cl
}

func toRecord(r *kgo.Record) Record {
	rec := Record{
		Topic:      r.Topic,
		Partition:  r.Partition,
		Offset:     r.Offset,
		Key:        r.Key,
		Value:      r.Value,
		ProducerID: r.ProducerID,
	}
	for _, h := range r.Headers {
		rec.Headers = append(rec.Headers, Header{Key: h.Key, Value: h.Value})
	}
	return rec
}

func sortRecords(out []Record) {
	slices.SortStableFunc(out, func(a, b Record) int {
		if a.Partition != b.Partition {
			return cmp.Compare(a.Partition, b.Partition)
		}
		return cmp.Compare(a.Offset, b.Offset)
	})
}

// ReadLog returns exactly what a consumer sees of topic up to the end its
// partitions have when ReadLog is called: every partition is consumed from
// its oldest offset to its high watermark, or with ReadCommitted to its
// last stable offset (so records of aborted transactions are skipped, and
// an open transaction ends the read). Records are ordered by partition,
// then offset; transaction markers are left out. Unlike ReadAll it needs no
// expected count, so a test can assert that records are absent. It fails t
// if the end is not reached within timeout. ReadLog must be called from the
// test's goroutine.
func (c *Cluster) ReadLog(t testing.TB, topic string, timeout time.Duration, opts ...ReadOption) []Record {
	t.Helper()
	var ro readOptions
	for _, opt := range opts {
		opt(&ro)
	}
	// Read to the high watermark in both isolation levels. Apache Kafka
	// writes transaction markers after EndTxn has returned, so the last
	// stable offset read right after a commit can still lie before it; a
	// read_committed consumer reaches the high watermark once the markers
	// are written, and the aborted records it skips on the way are not
	// returned.
	end := c.listOffsets(t, topic, -1, 0)
	start := c.listOffsets(t, topic, -2, 0)
	next := map[int32]int64{} // the offset after the last one consumed, markers included
	done := func() bool {
		for p, e := range end {
			if max(next[p], start[p]) < e {
				return false
			}
		}
		return true
	}

	// Markers are kept so that the consumed position is known even when a
	// partition ends with a transaction marker.
	cl := c.consumer(t, topic, ro, kgo.KeepControlRecords())
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var (
		out     []Record
		lastErr error
	)
	for !done() {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				lastErr = err
			}
		})
		fetches.EachRecord(func(r *kgo.Record) {
			next[r.Partition] = max(next[r.Partition], r.Offset+1)
			if !r.Attrs.IsControl() && r.Offset < end[r.Partition] {
				out = append(out, toRecord(r))
			}
		})
		if ctx.Err() != nil && !done() {
			t.Fatalf("kafkatest: read topic %q to offsets %v within %v: reached %v (last fetch error: %v)",
				topic, end, timeout, next, lastErr)
		}
	}
	sortRecords(out)
	return out
}

// ReadAll consumes every partition of topic from its oldest offset until at
// least want records arrived, and returns them ordered by partition, then
// offset. It fails t if fewer than want arrived within timeout. It may
// return more than want records if they arrived in the same fetch; callers
// that need exactly what the topic holds use ReadLog. ReadAll must be
// called from the test's goroutine.
func (c *Cluster) ReadAll(t testing.TB, topic string, want int, timeout time.Duration, opts ...ReadOption) []Record {
	t.Helper()
	var ro readOptions
	for _, opt := range opts {
		opt(&ro)
	}
	cl := c.consumer(t, topic, ro)
	defer cl.Close()

	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out, lastErr := Poll(ctx, cl, want, toRecord)
	if len(out) < want {
		t.Fatalf("kafkatest: read %d of %d records from topic %q within %v (last fetch error: %v)",
			len(out), want, topic, timeout, lastErr)
	}
	sortRecords(out)
	return out
}

// RecordCount returns how many offsets the topic's partitions hold: the sum
// of high watermark minus log start offset. For a topic written without
// transactions that is the number of records; transaction markers count
// too.
func (c *Cluster) RecordCount(t testing.TB, topic string) int64 {
	t.Helper()
	end := c.offsets(t, topic, -1)
	start := c.offsets(t, topic, -2)
	var n int64
	for p, e := range end {
		n += e - start[p]
	}
	return n
}

// offsets lists each partition's offset for timestamp (-1 latest, -2
// earliest).
func (c *Cluster) offsets(t testing.TB, topic string, timestamp int64) map[int32]int64 {
	t.Helper()
	return c.listOffsets(t, topic, timestamp, 0)
}

// listOffsets is offsets with an isolation level: with 1 (read_committed)
// the latest offset is the last stable offset.
func (c *Cluster) listOffsets(t testing.TB, topic string, timestamp int64, isolation int8) map[int32]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), adminTimeout)
	defer cancel()

	meta := kmsg.NewPtrMetadataRequest()
	mt := kmsg.NewMetadataRequestTopic()
	mt.Topic = &topic
	meta.Topics = append(meta.Topics, mt)
	mresp, err := meta.RequestWith(ctx, c.admin)
	require.NoError(t, err, "kafkatest: metadata for %q", topic)
	require.Len(t, mresp.Topics, 1)
	require.NoError(t, kerr.ErrorForCode(mresp.Topics[0].ErrorCode), "kafkatest: metadata for %q", topic)

	req := kmsg.NewPtrListOffsetsRequest()
	req.ReplicaID = -1
	req.IsolationLevel = isolation
	lt := kmsg.NewListOffsetsRequestTopic()
	lt.Topic = topic
	for _, p := range mresp.Topics[0].Partitions {
		lp := kmsg.NewListOffsetsRequestTopicPartition()
		lp.Partition = p.Partition
		lp.Timestamp = timestamp
		lp.CurrentLeaderEpoch = -1
		lt.Partitions = append(lt.Partitions, lp)
	}
	req.Topics = append(req.Topics, lt)
	resp, err := req.RequestWith(ctx, c.admin)
	require.NoError(t, err, "kafkatest: list offsets for %q", topic)
	out := make(map[int32]int64)
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			require.NoError(t, kerr.ErrorForCode(rp.ErrorCode), "kafkatest: list offsets for %q partition %d", topic, rp.Partition)
			out[rp.Partition] = rp.Offset
		}
	}
	require.Len(t, out, len(mresp.Topics[0].Partitions), "kafkatest: list offsets for %q", topic)
	return out
}

// MoveLeader moves the leadership of one partition of topic to another of
// its in-sync replicas: it rotates the partition's replica list so that
// replica becomes the preferred leader, then asks for a preferred leader
// election. It returns the old and the new leader. It is for fault
// injection on a real cluster and may be called from any goroutine.
func (c *Cluster) MoveLeader(ctx context.Context, topic string, partition int32) (from, to int32, err error) {
	p, err := c.partitionMeta(ctx, topic, partition)
	if err != nil {
		return -1, -1, err
	}
	from = p.Leader
	var target int32 = -1
	for _, r := range p.ISR {
		if r != from {
			target = r
			break
		}
	}
	if target < 0 {
		return from, -1, fmt.Errorf("kafkatest: partition %s/%d has no other in-sync replica (ISR %v)", topic, partition, p.ISR)
	}
	replicas := []int32{target}
	for _, r := range p.Replicas {
		if r != target {
			replicas = append(replicas, r)
		}
	}

	alter := kmsg.NewPtrAlterPartitionAssignmentsRequest()
	at := kmsg.NewAlterPartitionAssignmentsRequestTopic()
	at.Topic = topic
	ap := kmsg.NewAlterPartitionAssignmentsRequestTopicPartition()
	ap.Partition, ap.Replicas = partition, replicas
	at.Partitions = append(at.Partitions, ap)
	alter.Topics = append(alter.Topics, at)
	aresp, err := alter.RequestWith(ctx, c.admin)
	if err != nil {
		return from, target, fmt.Errorf("kafkatest: reassign %s/%d: %w", topic, partition, err)
	}
	if err := kerr.ErrorForCode(aresp.ErrorCode); err != nil {
		return from, target, fmt.Errorf("kafkatest: reassign %s/%d: %w", topic, partition, err)
	}
	for _, t := range aresp.Topics {
		for _, pr := range t.Partitions {
			if err := kerr.ErrorForCode(pr.ErrorCode); err != nil {
				return from, target, fmt.Errorf("kafkatest: reassign %s/%d: %w", topic, partition, err)
			}
		}
	}

	elect := kmsg.NewPtrElectLeadersRequest()
	elect.ElectionType = 0 // the preferred replica
	et := kmsg.NewElectLeadersRequestTopic()
	et.Topic, et.Partitions = topic, []int32{partition}
	elect.Topics = append(elect.Topics, et)
	// The reordered assignment reaches the controller's metadata shortly
	// after the reassignment returns; until then the election finds the
	// old leader preferred (ELECTION_NOT_NEEDED). Retry until it moves.
	for {
		eresp, err := elect.RequestWith(ctx, c.admin)
		if err != nil {
			return from, target, fmt.Errorf("kafkatest: elect leader of %s/%d: %w", topic, partition, err)
		}
		var perr error = kerr.ErrorForCode(eresp.ErrorCode)
		for _, t := range eresp.Topics {
			for _, pr := range t.Partitions {
				if e := kerr.ErrorForCode(pr.ErrorCode); e != nil && perr == nil {
					perr = e
				}
			}
		}
		if perr == nil {
			return from, target, nil
		}
		if !errors.Is(perr, kerr.ElectionNotNeeded) && !errors.Is(perr, kerr.PreferredLeaderNotAvailable) {
			return from, target, fmt.Errorf("kafkatest: elect leader of %s/%d: %w", topic, partition, perr)
		}
		if p, err := c.partitionMeta(ctx, topic, partition); err == nil && p.Leader == target {
			return from, target, nil
		}
		select {
		case <-ctx.Done():
			return from, target, fmt.Errorf("kafkatest: elect leader of %s/%d: %w (last: %v)", topic, partition, ctx.Err(), perr)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// underReplicated names the first topic or partition of meta that has an
// error, no leader or a replica out of sync; "" if none.
func underReplicated(meta *kmsg.MetadataResponse) string {
	for _, t := range meta.Topics {
		name := ""
		if t.Topic != nil {
			name = *t.Topic
		}
		if err := kerr.ErrorForCode(t.ErrorCode); err != nil {
			return fmt.Sprintf("topic %s: %v", name, err)
		}
		for _, p := range t.Partitions {
			if p.Leader < 0 || len(p.ISR) < len(p.Replicas) {
				return fmt.Sprintf("%s/%d: leader %d, replicas %v, in sync %v", name, p.Partition, p.Leader, p.Replicas, p.ISR)
			}
		}
	}
	return ""
}

// NodeHealthy reports whether the broker at addr (one of Brokers) serves
// requests itself, and whether, as it sees the cluster, a controller is
// elected, every broker of Brokers is registered, and every partition,
// internal ones included, has a leader and all its replicas in sync.
// Asking the restarted node itself matters: right after a broker was
// killed and started again, the others may still list it, in sync, until
// the controller fences it, and while it starts up it answers nothing. It
// is for fault injection on a real cluster (no second broker fault before
// the first healed) and may be called from any goroutine.
func (c *Cluster) NodeHealthy(ctx context.Context, addr string) (ok bool, reason string, err error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr))
	if err != nil {
		return false, "", fmt.Errorf("kafkatest: client for %s: %w", addr, err)
	}
	defer cl.Close()
	resp, err := cl.SeedBrokers()[0].Request(ctx, kmsg.NewPtrMetadataRequest()) // nil Topics: all of them
	if err != nil {
		return false, fmt.Sprintf("%s does not answer: %v", addr, err), nil
	}
	meta := resp.(*kmsg.MetadataResponse)
	if meta.ControllerID < 0 {
		return false, fmt.Sprintf("%s sees no controller", addr), nil
	}
	if len(meta.Brokers) < len(c.brokers) {
		return false, fmt.Sprintf("%s sees %d of %d brokers", addr, len(meta.Brokers), len(c.brokers)), nil
	}
	if why := underReplicated(meta); why != "" {
		return false, why, nil
	}
	return true, "", nil
}

// Leaders returns the leader (node id) of each of topic's partitions, -1
// for a partition without one.
func (c *Cluster) Leaders(ctx context.Context, topic string) (map[int32]int32, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = &topic
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, c.admin)
	if err != nil {
		return nil, fmt.Errorf("kafkatest: metadata of %s: %w", topic, err)
	}
	out := map[int32]int32{}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			out[p.Partition] = p.Leader
		}
	}
	return out, nil
}

func (c *Cluster) partitionMeta(ctx context.Context, topic string, partition int32) (kmsg.MetadataResponseTopicPartition, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = &topic
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, c.admin)
	if err != nil {
		return kmsg.MetadataResponseTopicPartition{}, fmt.Errorf("kafkatest: metadata of %s: %w", topic, err)
	}
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if p.Partition == partition {
				return p, nil
			}
		}
	}
	return kmsg.MetadataResponseTopicPartition{}, fmt.Errorf("kafkatest: %s/%d not in metadata", topic, partition)
}

// Poll reads records from cl until n arrived or ctx ended, converting each
// with conv, in arrival order. It returns what arrived (fewer than n when
// ctx ended first) and the last fetch error other than the context's, nil
// if none.
func Poll[T any](ctx context.Context, cl *kgo.Client, n int, conv func(*kgo.Record) T) (out []T, lastErr error) {
	for len(out) < n {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(_ string, _ int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
				lastErr = err
			}
		})
		fetches.EachRecord(func(r *kgo.Record) { out = append(out, conv(r)) })
		if ctx.Err() != nil {
			break
		}
	}
	return out, lastErr
}

// RefusingAddr returns an address that refuses connections for as long
// as the test runs: the client end of a connection the test holds open.
// Nothing listens on that port, and no listener of a parallel test can be
// given it while the connection holds it, as it could be given the port
// of a listener closed to free it.
func RefusingAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("kafkatest: listen: %v", err)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("kafkatest: dial: %v", err)
	}
	t.Cleanup(func() {
		_ = c.Close()
		_ = ln.Close()
	})
	return c.LocalAddr().String()
}
