package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/internal/dbtest"
	"github.com/gorm-outbox/outbox/internal/kafkatest"
	"github.com/gorm-outbox/outbox/publisher"
)

// TestBenchKafkaThreeNodes runs the bench's three-node mode,
// scripts/bench-kafka.sh --nodes 3, on a cluster of its own: the script
// starts three Apache Kafka nodes, the drain runs on them at a tiny size
// and records the cluster it ran on (three brokers, replication factor 3,
// min.insync.replicas 2), and no node is left running when the bench
// exits. It asserts no timing.
func TestBenchKafkaThreeNodes(t *testing.T) {
	kafkaScript := os.Getenv("OUTBOX_KAFKA_SCRIPT")
	if kafkaScript == "" {
		t.Skip("starts a three-node Apache Kafka cluster of its own: set OUTBOX_KAFKA_SCRIPT to scripts/kafka.sh (scripts/test.sh does in its three-node pass)")
	}
	dbtest.Require(t, dbtest.Postgres)
	script := filepath.Join(filepath.Dir(kafkaScript), "bench-kafka.sh")
	state := t.TempDir()
	port := freeKafkaPorts(t)
	env := append(os.Environ(), "OUTBOX_KAFKA_DIR="+state, "OUTBOX_KAFKA_PORT="+strconv.Itoa(port), "KAFKA_BROKERS=")
	t.Cleanup(func() { // the script's own stop is what the test checks; this one only cleans up after a failure
		stop := exec.Command("bash", kafkaScript, "stop")
		stop.Env = env
		_ = stop.Run()
	})

	cmd := exec.Command("bash", script, "--nodes", "3", "-smoke", "-scenarios", "drain", "-json")
	cmd.Env = env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "stderr:\n%s", stderr.String())

	var results []result
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		var r result
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
		results = append(results, r)
	}
	require.Len(t, results, 1, stdout.String())
	r := results[0]
	require.Equal(t, "drain", r.Scenario)
	require.Empty(t, r.Err)
	require.Positive(t, r.Values["relay"], "%v", r.Values)
	// JSON numbers decode as float64.
	require.Equal(t, 3.0, r.Params["kafka_brokers"], "%v", r.Params)
	require.Equal(t, 3.0, r.Params["kafka_default_replication_factor"], "%v", r.Params)
	require.Equal(t, 2.0, r.Params["kafka_min_insync_replicas"], "%v", r.Params)

	// Stopped: every node's pid file is gone and no broker port answers.
	for i := 1; i <= 3; i++ {
		require.NoFileExists(t, filepath.Join(state, fmt.Sprintf("node-%d", i), "pid"))
		c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+i-1)))
		if err == nil {
			c.Close()
		}
		require.Error(t, err, "node %d still listens", i)
	}
}

// freeKafkaPorts returns a base port whose three broker ports and three
// controller ports (base+100, scripts/kafka.sh) nothing listens on.
func freeKafkaPorts(t *testing.T) int {
	t.Helper()
	for base := 29192; base < 46000; base += 1000 {
		free := true
		for _, p := range []int{base, base + 1, base + 2, base + 100, base + 101, base + 102} {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
			if err != nil {
				free = false
				break
			}
			l.Close()
		}
		if free {
			return base
		}
	}
	t.Fatal("no free port range for a three-node Apache Kafka cluster")
	return 0
}

// TestCreateTopicsReady checks, on the Apache Kafka cluster of
// KAFKA_BROKERS, that the run's topics answer once createTopics returns:
// a consumer on every partition of topics created an instant before
// starts at once, without the NOT_LEADER_OR_FOLLOWER a new partition
// answers first. kfake creates a topic in the request that creates it,
// so the test needs a real cluster.
func TestCreateTopicsReady(t *testing.T) {
	brokers := os.Getenv(kafkatest.EnvBrokers)
	if brokers == "" {
		t.Skip("needs an Apache Kafka cluster: set KAFKA_BROKERS (scripts/test.sh does in its Apache Kafka pass)")
	}
	const partitions = 8
	topics := make([]string, 8)
	for i := range topics {
		topics[i] = "bench-ready-" + randomSuffix()
	}
	require.NoError(t, createTopics(strings.Split(brokers, ","), partitions, topics...))

	sc := sarama.NewConfig()
	sc.Version = publisher.MinKafkaVersion
	sc.Metadata.Retry.Max = 0 // a partition not ready fails the test rather than a retry hiding it
	consumer, err := sarama.NewConsumer(strings.Split(brokers, ","), sc)
	require.NoError(t, err)
	defer consumer.Close()
	for _, topic := range topics {
		for p := range int32(partitions) {
			pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetNewest)
			require.NoError(t, err, "%s partition %d", topic, p)
			pc.AsyncClose()
		}
	}
}
