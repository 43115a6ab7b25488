package chaos_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
)

// EnvNetKafka=1 runs TestChaosNetworkKafka outside the Apache Kafka pass
// of scripts/test.sh, with scripts/kafka.sh of this checkout.
const EnvNetKafka = "OUTBOX_CHAOS_NET_KAFKA"

// Network fault kinds on Apache Kafka, with a link per broker.
const (
	evNetPartitionOneBroker = "net_partition_one_broker"
	evNetSlowBroker         = "net_slow_broker"
)

// TestChaosNetworkKafka is TestChaosNetwork on a three-node Apache Kafka
// cluster of its own: each broker listens and advertises on an address of
// its own in the root namespace, and each relay reaches each broker over
// a link of its own, so that a fault can cut a relay off from one broker
// (the leader of some of the topic's partitions) while the brokers still
// replicate to each other. Faults: a relay partitioned from one broker,
// from every broker, from the database, its link to one broker slowed,
// links delayed or lossy, and the stale-relay last fault; then the heal.
// It asserts what TestChaosNetwork asserts (nothing lost, no key
// reordered in either mode, progress within LeaseDuration plus three poll
// intervals after the last heal, no delete in a bucket another relay
// held) and that every fault kind on one broker's link was injected.
//
// 10,000 messages per mode (OUTBOX_CHAOS_MESSAGES applies) over a 30 s
// fault window. It runs in the Apache Kafka pass (OUTBOX_KAFKA_SCRIPT set), or with
// OUTBOX_CHAOS_NET_KAFKA=1; its cluster, state directory and ports are its
// own, so the pass's cluster is never disturbed.
func TestChaosNetworkKafka(t *testing.T) {
	script := os.Getenv(EnvKafkaScript)
	if script == "" {
		if os.Getenv(EnvNetKafka) != "1" {
			t.Skipf("runs a three-node Apache Kafka cluster of its own: in the Apache Kafka pass (%s set), or with %s=1", EnvKafkaScript, EnvNetKafka)
		}
		abs, err := filepath.Abs("../../scripts/kafka.sh")
		require.NoError(t, err)
		script = abs
	}
	dbtest.Require(t, dbtest.Postgres)
	requireNetTools(t)
	seed := loadParams(t, false).seed
	c := startNetCluster(t, script, 3, seed)
	eachMode(t, func(t *testing.T, strict bool) {
		p := shortParams(t, strict)
		// Fewer messages than on kfake: the relays' produce round trips
		// to a real cluster are slower, and the run must stay short in
		// CI.
		if os.Getenv(EnvMessages) == "" && !p.soak {
			p.messages = 10_000
			if os.Getenv(EnvRate) == "" {
				p.rate = float64(p.messages) / p.minChaos.Seconds()
			}
		}
		p.network = true
		p.netKafka = c
		p.faultEvery = time.Second
		t.Logf("chaos net: on Apache Kafka, brokers %s, a link per broker from each relay", strings.Join(c.brokers(), ","))
		runChaos(t, p)
	})
}

// netCluster is a three-node Apache Kafka cluster run by scripts/kafka.sh
// with a state directory and ports of its own, each node on an address of
// addrs.
type netCluster struct {
	addrs   *netLab
	boot    []string
	cluster *kafkatest.Cluster
}

func (c *netCluster) brokers() []string { return append([]string(nil), c.boot...) }

// startNetCluster starts the cluster and stops it when the test ends.
func startNetCluster(t *testing.T, script string, nodes int, seed uint64) *netCluster {
	t.Helper()
	addrs := newBrokerAddrs(t, seed, nodes)
	dir, err := os.MkdirTemp("", "chaos-net-kafka-")
	require.NoError(t, err)
	var env []string
	run := func(timeout time.Duration, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", append([]string{script}, args...)...)
		cmd.Env = env
		var out, errOut strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		if err != nil {
			return "", fmt.Errorf("%s %s: %v: %s", script, strings.Join(args, " "), err, errOut.String())
		}
		return out.String(), nil
	}
	// The cleanup stops the nodes before the addresses go (cleanups run
	// last in, first out).
	t.Cleanup(func() {
		if _, err := run(2*time.Minute, "stop"); err != nil {
			t.Logf("chaos net: stop the cluster: %v", err)
		}
		_ = os.RemoveAll(dir)
	})
	// A start that fails (a port taken meanwhile by another process's
	// connection, a node that dies at start on a loaded machine) is
	// retried once on other ports, after the nodes' errors are logged.
	var out string
	port := 39092
	for attempt := 1; ; attempt++ {
		port = freeKafkaPort(t, addrs.brokerIPs, port)
		env = append(os.Environ(),
			"OUTBOX_KAFKA_DIR="+dir,
			"OUTBOX_KAFKA_PORT="+strconv.Itoa(port),
			"OUTBOX_KAFKA_HOSTS="+strings.Join(addrs.brokerIPs, ","),
			"OUTBOX_KAFKA_HEAP=384m",
		)
		start := time.Now()
		out, err = run(4*time.Minute, "start", "--nodes", strconv.Itoa(nodes))
		if err == nil {
			t.Logf("chaos net: Apache Kafka started in %s (state %s)", time.Since(start).Round(100*time.Millisecond), dir)
			break
		}
		for i := 1; i <= nodes; i++ {
			for _, f := range []string{"server.log", "stdout.log"} {
				if b, rerr := os.ReadFile(filepath.Join(dir, fmt.Sprintf("node-%d", i), f)); rerr == nil {
					for _, line := range strings.Split(string(b), "\n") {
						if strings.Contains(line, "ERROR") || strings.Contains(line, "Exception") {
							t.Logf("chaos net: node %d %s: %s", i, f, line)
						}
					}
				}
			}
		}
		_, _ = run(2*time.Minute, "stop")
		require.Less(t, attempt, 2, "start the cluster (needs Java 17+ and Maven, as scripts/kafka.sh says): %v", err)
		t.Logf("chaos net: start the cluster: %v; once more, on other ports", err)
		port += 1000
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	boot := strings.Split(lines[len(lines)-1], ",")
	require.Len(t, boot, nodes, "bootstrap addresses: %q", out)
	for i, b := range boot {
		require.True(t, strings.HasPrefix(b, addrs.brokerIPs[i]+":"), "node %d listens on %s, not on its address %s", i+1, b, addrs.brokerIPs[i])
	}
	t.Logf("chaos net: Apache Kafka, %d nodes on %s", nodes, strings.Join(boot, ","))
	return &netCluster{addrs: addrs, boot: boot, cluster: kafkatest.Connect(t, boot)}
}

// freeKafkaPort returns a base port, from from on, whose broker and
// controller ports (base+i, base+100+i) are free on every address.
func freeKafkaPort(t *testing.T, addrs []string, from int) int {
	t.Helper()
	for base := from; base < 60000; base += 1000 {
		ok := true
		var held []net.Listener
		for i, a := range addrs {
			for _, p := range []int{base + i, base + 100 + i} {
				ln, err := net.Listen("tcp", net.JoinHostPort(a, strconv.Itoa(p)))
				if err != nil {
					ok = false
					break
				}
				held = append(held, ln)
			}
		}
		for _, ln := range held {
			ln.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("chaos net: no free port range for the cluster")
	return 0
}

// leaders returns how many of topic's partitions each broker leads, by
// broker index (node id - 1).
func (c *netCluster) leaders(topic string) (map[int]int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	leaders, err := c.cluster.Leaders(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := map[int]int{}
	for _, node := range leaders {
		if node >= 1 {
			out[int(node)-1]++
		}
	}
	return out, nil
}

// brokerFaultsFirst makes every action inject a fault on the broker links
// instead while one of those kinds (one broker cut off, every broker cut
// off, one broker's link slowed) has not been injected yet, so that each
// run has them all whatever the draw and the slots' availability.
func (n *netInjector) brokerFaultsFirst(in *injector, acts []action) []action {
	owed := []struct {
		kind string
		fn   func() bool
	}{
		{evNetPartitionOneBroker, func() bool { return n.partitionOneBroker(in) }},
		{evNetPartitionBrokers, func() bool { return n.partition(in, linkBroker) }},
		{evNetSlowBroker, func() bool { return n.slowBroker(in) }},
	}
	for i := range acts {
		fn := acts[i].fn
		acts[i].fn = func() bool {
			for _, o := range owed {
				if in.log.count(o.kind) == 0 && o.fn() {
					return true
				}
			}
			return fn()
		}
	}
	return acts
}

// partitionOneBroker cuts a relay off from one broker, both ways, for half
// a lease to three leases: a broker that leads some of the topic's
// partitions (the relay's produce requests to it hang; the other brokers
// answer).
func (n *netInjector) partitionOneBroker(in *injector) bool {
	slot := n.slot(in)
	if slot < 0 {
		return false
	}
	lead, err := n.cluster.leaders(n.topic)
	var cands []int
	for b, cnt := range lead {
		if cnt > 0 && b < n.lab.brokerLinks {
			cands = append(cands, b)
		}
	}
	if err != nil || len(cands) == 0 {
		in.t.Logf("chaos net: leaders of %s: %v %v", n.topic, lead, err)
		return false
	}
	b := cands[in.rng.IntN(len(cands))]
	k := linkToBroker + linkKind(b)
	d := in.jitter(in.lease/2, 3*in.lease)
	return n.start(in, evNetPartitionOneBroker, slot, k, d, fmt.Sprintf("broker %d (leader of %d partitions), both ways", b+1, lead[b]),
		func() error { return n.lab.partition(slot, k) })
}

// slowBroker slows one direction of a relay's link to one broker, for 2
// to 6 s.
func (n *netInjector) slowBroker(in *injector) bool {
	slot := n.slot(in)
	if slot < 0 {
		return false
	}
	b := in.rng.IntN(n.lab.brokerLinks)
	k := linkToBroker + linkKind(b)
	sd, dir := side(in)
	d := in.jitter(200*time.Millisecond, 2*time.Second)
	rate := 32 << in.rng.IntN(4)
	var how string
	return n.start(in, evNetSlowBroker, slot, k, in.jitter(2*time.Second, 6*time.Second), "", func() error {
		var err error
		how, err = n.lab.delay(slot, k, sd, d, rate)
		return err
	}) && n.note(in, fmt.Sprintf("%s link, %s: %s", k, dir, how))
}
