package chaos_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// EnvKafkaScript names scripts/kafka.sh when KAFKA_BROKERS points at the
// Apache Kafka cluster that script runs: the chaos suite then injects real
// broker faults (SIGKILL and restart of a broker process, SIGSTOP past the
// broker session timeout and SIGCONT, leader moves) instead of kfake's.
// scripts/test.sh sets both.
const EnvKafkaScript = "OUTBOX_KAFKA_SCRIPT"

// Real broker fault kinds.
const (
	evBrokerKill  = "broker_sigkill"
	evBrokerStop  = "broker_sigstop"
	evLeaderMove  = "broker_leader_move"
	brokerSession = 9 * time.Second // broker.session.timeout.ms in scripts/kafka.sh
)

// clusterFaults is shared by the chaos tests that run in parallel on one
// real cluster (TestChaos and TestChaosStrict): the rule that at most one
// broker is down at a time holds across them, not only within each test,
// and while a test measures its recovery no broker fault starts, so that
// its liveness bound is not charged with another test's outage.
var clusterFaults struct {
	sync.Mutex
	owner   string          // the test whose broker fault is in progress, "" when none
	last    string          // the test of the last broker fault
	refused map[string]bool // tests refused a broker fault since their last one
	quiet   int             // tests measuring their recovery
}

// claimFault reserves the cluster for one broker fault of test name. It
// fails while another broker fault is in progress or a test measures its
// recovery, and takes turns: a test that had the last broker fault waits
// while another test was refused one since.
func claimFault(name string) bool {
	clusterFaults.Lock()
	defer clusterFaults.Unlock()
	if clusterFaults.refused == nil {
		clusterFaults.refused = map[string]bool{}
	}
	turn := true
	if clusterFaults.last == name {
		for other, r := range clusterFaults.refused {
			turn = turn && (other == name || !r)
		}
	}
	if clusterFaults.owner != "" || clusterFaults.quiet > 0 || !turn {
		clusterFaults.refused[name] = true
		return false
	}
	clusterFaults.owner, clusterFaults.last = name, name
	clusterFaults.refused[name] = false
	return true
}

// endFault gives the cluster back after test name's broker fault healed.
func endFault(name string) {
	clusterFaults.Lock()
	defer clusterFaults.Unlock()
	if clusterFaults.owner == name {
		clusterFaults.owner = ""
	}
}

// faultInProgress reports whether any test's broker fault is in progress.
func faultInProgress() bool {
	clusterFaults.Lock()
	defer clusterFaults.Unlock()
	return clusterFaults.owner != ""
}

// realBrokers drives the nodes of a cluster started by scripts/kafka.sh.
// At most one broker is down (killed or stopped) at a time, across all the
// tests sharing the cluster (clusterFaults), and the next broker fault
// waits until every partition, internal ones included, is fully replicated
// again: with three nodes and min.insync.replicas 2 the cluster then
// always accepts acks=all writes, and what the suite measures is the
// relay's recovery, not an unavailable cluster.
type realBrokers struct {
	name    string // the test's name, for clusterFaults
	script  string
	cluster *kafkatest.Cluster
	topic   string
	nodes   int
	quiet   bool // heal made the cluster quiet; endQuiet ends it (under clusterFaults)

	down     int    // the node that is killed or stopped, 0 when none
	downKind string // evBrokerKill or evBrokerStop
	healing  bool   // down's fault was undone; waiting for full replication
	healBy   time.Time
}

// newRealBrokers returns the controller of the real cluster, or nil when
// the suite runs on kfake. With KAFKA_BROKERS set and no script it skips,
// or fails in CI.
func newRealBrokers(t *testing.T, cluster *kafkatest.Cluster, topic string) *realBrokers {
	if cluster.Fake() != nil {
		return nil
	}
	script := os.Getenv(EnvKafkaScript)
	if script == "" {
		msg := fmt.Sprintf("chaos on a real cluster (%s) injects broker faults through scripts/kafka.sh: set %s to its path", kafkatest.EnvBrokers, EnvKafkaScript)
		if os.Getenv("CI") == "true" || os.Getenv("CI") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	rb := &realBrokers{name: t.Name(), script: script, cluster: cluster, topic: topic}
	t.Cleanup(func() {
		rb.endQuiet()
		endFault(rb.name)
	})
	out, err := rb.run("status")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 6 && f[0] == "node" && f[5] == "running" {
			rb.nodes++
		}
	}
	if rb.nodes < 3 {
		t.Fatalf("chaos needs a 3-node cluster (scripts/kafka.sh start --nodes 3); %s reports:\n%s", script, out)
	}
	return rb
}

func (rb *realBrokers) run(args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "bash", append([]string{rb.script}, args...)...).CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("chaos: %s %s: %v: %s", rb.script, strings.Join(args, " "), err, out)
	}
	return out, nil
}

// actions are the real broker faults, drawn with the relay and database
// faults of the injector.
func (rb *realBrokers) actions(in *injector) []action {
	return []action{
		{2, func() bool { return rb.kill(in) }},
		{2, func() bool { return rb.stop(in) }},
		{2, func() bool { return rb.moveLeader(in) }},
	}
}

// kill SIGKILLs a broker and starts it again a few seconds later.
func (rb *realBrokers) kill(in *injector) bool {
	return rb.takeDown(in, "kill", evBrokerKill, in.jitter(2*time.Second, 6*time.Second))
}

// stop SIGSTOPs a broker past the broker session timeout, so that the
// controller fences it and its partitions move, then resumes it.
func (rb *realBrokers) stop(in *injector) bool {
	return rb.takeDown(in, "pause", evBrokerStop, brokerSession+in.jitter(time.Second, 4*time.Second))
}

// takeDown applies verb (kafka.sh kill or pause) to a random node for d,
// unless a broker is already down.
func (rb *realBrokers) takeDown(in *injector, verb, kind string, d time.Duration) bool {
	if rb.down != 0 || !claimFault(rb.name) {
		return false
	}
	node := 1 + in.rng.IntN(rb.nodes)
	if _, err := rb.run(verb, strconv.Itoa(node)); err != nil {
		in.t.Log(err)
		endFault(rb.name)
		return false
	}
	rb.down, rb.downKind = node, kind
	now := time.Now()
	in.log.add(event{Kind: kind, Slot: -1, Start: now, End: now.Add(d), Note: fmt.Sprintf("node %d for %s", node, d)})
	in.after(d, func() { rb.undo(in) })
	return true
}

// undo restarts or resumes the broker that is down, then waits (polling
// from the injector's loop) until the cluster is fully replicated.
func (rb *realBrokers) undo(in *injector) {
	if rb.down == 0 || rb.healing {
		return
	}
	verb := "start-node"
	if rb.downKind == evBrokerStop {
		verb = "resume"
	}
	if _, err := rb.run(verb, strconv.Itoa(rb.down)); err != nil {
		in.t.Log(err)
		in.after(time.Second, func() { rb.undo(in) })
		return
	}
	rb.healing, rb.healBy = true, time.Now().Add(3*time.Minute)
	in.after(500*time.Millisecond, func() { rb.checkHealed(in) })
}

func (rb *realBrokers) checkHealed(in *injector) {
	ok, reason, err := rb.healthy(rb.down)

	if ok {
		in.log.end(rb.downKind, -1, time.Now())
		rb.down, rb.downKind, rb.healing = 0, "", false
		endFault(rb.name)
		return
	}
	if time.Now().After(rb.healBy) {
		in.t.Logf("chaos: node %d did not rejoin within 3 minutes (%s %v); giving up on it", rb.down, reason, err)
		rb.down, rb.downKind, rb.healing = 0, "", false
		endFault(rb.name)
		return
	}
	in.after(500*time.Millisecond, func() { rb.checkHealed(in) })
}

// healthy reports whether node (1-based; 0: every node) answers itself
// and sees a controller, every broker registered and every partition fully
// replicated. Asking the other brokers only is not enough: after a kill
// and restart they list the node, in sync, until the controller fences
// it, while the node itself is still starting up.
func (rb *realBrokers) healthy(node int) (bool, string, error) {
	addrs := rb.cluster.Brokers()
	if node > 0 {
		addrs = addrs[node-1 : node]
	}
	for _, a := range addrs {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		ok, reason, err := rb.cluster.NodeHealthy(ctx, a)
		cancel()
		if !ok || err != nil {
			return false, reason, err
		}
	}
	return true, "", nil
}

// moveLeader moves the leadership of one partition of the topic to another
// in-sync replica.
func (rb *realBrokers) moveLeader(in *injector) bool {
	if rb.down != 0 || !claimFault(rb.name) {
		return false // a partition may have a single in-sync replica
	}
	defer endFault(rb.name)
	partition := int32(in.rng.IntN(int(in.partitions)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	from, to, err := rb.cluster.MoveLeader(ctx, rb.topic, partition)
	if err != nil {
		in.t.Logf("chaos: %v", err)
		return false
	}
	now := time.Now()
	in.log.add(event{Kind: evLeaderMove, Slot: -1, Start: now, End: now.Add(time.Second), Note: fmt.Sprintf("partition %d: %d -> %d", partition, from, to)})
	return true
}

// heal stops every test sharing the cluster from starting broker faults
// until this one measured its recovery (endQuiet), undoes this test's
// broker fault, and waits until no test's broker fault is in progress and
// the cluster is fully replicated.
func (rb *realBrokers) heal(in *injector) {
	clusterFaults.Lock()
	if !rb.quiet {
		rb.quiet = true
		clusterFaults.quiet++
	}
	clusterFaults.Unlock()
	if rb.down != 0 && !rb.healing {
		rb.undo(in)
	}
	in.runDue(true)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		ok, reason, err := rb.healthy(0)
		busy := faultInProgress()
		if ok && !busy {
			return
		}
		if time.Now().After(deadline) {
			in.t.Logf("chaos: the cluster did not heal within 3 minutes (another test's broker fault in progress: %v; %s %v)", busy, reason, err)
			return
		}
		time.Sleep(250 * time.Millisecond) // polling the cluster's state
	}
}

// endQuiet lets the tests sharing the cluster start broker faults again
// once this test measured its recovery.
func (rb *realBrokers) endQuiet() {
	clusterFaults.Lock()
	defer clusterFaults.Unlock()
	if rb.quiet {
		rb.quiet = false
		clusterFaults.quiet--
	}
}
