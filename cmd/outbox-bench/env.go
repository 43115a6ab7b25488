package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/dbopen"
	"github.com/gorm-outbox/outbox/publisher"

	// database/sql drivers for the admin connections.
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
)

// database is one fresh namespace (PostgreSQL schema, MySQL database,
// SQLite file) for one scenario run, dropped by drop.
type database struct {
	driver string
	dsn    string // DSN of the fresh namespace, for this and child processes
	drop   func()
}

func randomSuffix() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func newDatabase(driver, baseDSN, tmp string) (*database, error) {
	name := "bench_" + randomSuffix()
	switch driver {
	case "postgres":
		admin, err := sql.Open("pgx", baseDSN)
		if err != nil {
			return nil, err
		}
		if _, err := admin.Exec("CREATE SCHEMA " + name); err != nil {
			admin.Close()
			return nil, fmt.Errorf("create schema: %w", err)
		}
		return &database{driver: driver, dsn: baseDSN + " search_path=" + name, drop: func() {
			_, _ = admin.Exec("DROP SCHEMA " + name + " CASCADE")
			admin.Close()
		}}, nil
	case "mysql":
		admin, err := sql.Open("mysql", baseDSN)
		if err != nil {
			return nil, err
		}
		if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
			admin.Close()
			return nil, fmt.Errorf("create database: %w", err)
		}
		return &database{driver: driver, dsn: dbopen.WithMySQLDatabase(baseDSN, name), drop: func() {
			_, _ = admin.Exec("DROP DATABASE " + name)
			admin.Close()
		}}, nil
	case "sqlite":
		path := filepath.Join(tmp, name+".db")
		return &database{driver: driver, dsn: "file:" + path + "?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate&_synchronous=NORMAL", drop: func() {
			for _, suffix := range []string{"", "-wal", "-shm"} {
				_ = os.Remove(path + suffix)
			}
		}}, nil
	}
	return nil, fmt.Errorf("unknown driver %q (postgres, mysql, sqlite)", driver)
}

// openGorm opens a pool of up to maxIdle open and idle connections
// (SQLite: one), or with database/sql's defaults (any number open, 2
// idle) when maxIdle is negative: untouched at -1 (the GORM store raises
// the idle limit), set explicitly at -2 (the store keeps it).
func openGorm(driver, dsn string, maxIdle int) (*gorm.DB, error) {
	db, err := dbopen.Open(driver, dsn, &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return nil, err
	}
	if driver != dbopen.SQLite && (maxIdle >= 0 || maxIdle == -2) {
		sqlDB, err := db.DB()
		if err != nil {
			return nil, err
		}
		if maxIdle == -2 {
			sqlDB.SetMaxIdleConns(2)
		} else {
			sqlDB.SetMaxOpenConns(maxIdle)
			sqlDB.SetMaxIdleConns(maxIdle)
		}
	}
	return db, nil
}

func closeGorm(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		sqlDB.Close()
	}
}

// setupTimeout bounds each of the bench's setup waits: a child process
// printing its first line, a relay owning its buckets, relays sharing the
// leases, a WAL reader streaming its slot, topics ready, the table's
// counters reported. None of them is measured; on a quiet machine each
// takes well under a second. The bound is for a step that will not
// happen, and is long because on a starved machine (a CI host with other
// suites, a broker whose JVM waits for the CPU) a step that will happen
// can take tens of seconds.
const setupTimeout = 3 * time.Minute

// child is a process started from this executable in another role.
type child struct {
	cmd  *exec.Cmd
	line string // the first line it printed
	done chan error
}

// startChild re-executes this binary with OUTBOX_BENCH_ROLE=role and the
// given environment, and waits for its first output line (prefix).
func startChild(ctx context.Context, role string, env []string, prefix string) (*child, error) {
	return startChildLines(ctx, role, env, prefix, nil)
}

// startChildLines is startChild that also hands every line the child
// prints after its first to onLine, on one goroutine, if onLine is set.
func startChildLines(ctx context.Context, role string, env []string, prefix string, onLine func(string)) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = append(append(os.Environ(), "OUTBOX_BENCH_ROLE="+role), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, done: make(chan error, 1)}
	lines := make(chan string, 1)
	go func() {
		r := bufio.NewReader(out)
		first := true
		for {
			l, err := r.ReadString('\n')
			switch {
			case first && strings.HasPrefix(l, prefix):
				lines <- strings.TrimSpace(strings.TrimPrefix(l, prefix))
				first = false
			case !first && onLine != nil && strings.HasSuffix(l, "\n"):
				onLine(strings.TrimSuffix(l, "\n"))
			}
			if err != nil {
				_, _ = io.Copy(io.Discard, r)
				break
			}
		}
		c.done <- cmd.Wait()
	}()
	select {
	case l := <-lines:
		c.line = l
		return c, nil
	case err := <-c.done:
		return nil, fmt.Errorf("%s process exited before it was ready: %v", role, err)
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		return nil, ctx.Err()
	case <-time.After(setupTimeout):
		_ = cmd.Process.Kill()
		return nil, fmt.Errorf("%s process not ready after %s", role, setupTimeout)
	}
}

// stop asks the child to stop (SIGTERM) and waits.
func (c *child) stop() {
	if c.cmd == nil {
		return // a real cluster: nothing was started
	}
	_ = c.cmd.Process.Signal(os.Interrupt)
	select {
	case <-c.done:
	case <-time.After(20 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// externalBrokers is the real cluster the scenarios use, if any.
var externalBrokers []string

// useExternalBrokers makes startBroker use the cluster in brokers instead
// of starting a broker process, with topics unique to this run.
func useExternalBrokers(brokers []string) {
	if len(brokers) == 0 {
		return
	}
	externalBrokers = brokers
	benchTopic = "bench-" + randomSuffix()
}

// startBroker starts a Kafka-protocol broker in its own process, or, with
// a real cluster configured, creates the run's topics there. blackhole has
// no effect on a real cluster: it stores every record.
func startBroker(ctx context.Context, partitions int, blackhole bool) (*child, []string, error) {
	if len(externalBrokers) > 0 {
		if err := createTopics(externalBrokers, partitions, append([]string{benchTopic}, latencyTopics()...)...); err != nil {
			return nil, nil, err
		}
		return &child{}, externalBrokers, nil
	}
	env := []string{fmt.Sprintf("OUTBOX_BENCH_PARTITIONS=%d", partitions)}
	if blackhole {
		env = append(env, "OUTBOX_BENCH_BLACKHOLE=1")
	}
	c, err := startChild(ctx, "broker", env, "BROKER ")
	if err != nil {
		return nil, nil, err
	}
	return c, strings.Split(c.line, ","), nil
}

// clusterParams describes the real cluster in brokers for the results:
// how many brokers it has, and the replication factor and
// min.insync.replicas its topics get (the run's topics take the defaults).
func clusterParams(brokers []string) (map[string]any, error) {
	sc := sarama.NewConfig()
	// DescribeConfigs v1 or later: Apache Kafka 4 no longer answers v0.
	sc.Version = sarama.V2_1_0_0
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("connect to %v: %w", brokers, err)
	}
	defer admin.Close()
	nodes, _, err := admin.DescribeCluster()
	if err != nil {
		return nil, fmt.Errorf("describe cluster %v: %w", brokers, err)
	}
	if len(nodes) == 0 {
		return nil, fmt.Errorf("describe cluster %v: no brokers", brokers)
	}
	entries, err := admin.DescribeConfig(sarama.ConfigResource{
		Type: sarama.BrokerResource, Name: strconv.Itoa(int(nodes[0].ID())),
		ConfigNames: []string{"default.replication.factor", "min.insync.replicas"},
	})
	if err != nil {
		return nil, fmt.Errorf("describe broker %d's configuration: %w", nodes[0].ID(), err)
	}
	p := map[string]any{"kafka_brokers": len(nodes)}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Value)
		if err != nil {
			return nil, fmt.Errorf("broker %d's %s is %q, not a number", nodes[0].ID(), e.Name, e.Value)
		}
		p["kafka_"+strings.ReplaceAll(e.Name, ".", "_")] = n
	}
	return p, nil
}

// createTopics creates the topics that do not exist yet, each with
// partitions partitions and the cluster's default replication factor, and
// returns once every partition's leader answers for it (topicsReady).
func createTopics(brokers []string, partitions int, names ...string) error {
	sc := sarama.NewConfig()
	sc.Version = publisher.MinKafkaVersion
	admin, err := sarama.NewClusterAdmin(brokers, sc)
	if err != nil {
		return fmt.Errorf("connect to %v: %w", brokers, err)
	}
	defer admin.Close()
	for _, name := range names {
		err := admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: int32(partitions), ReplicationFactor: -1}, false)
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", name, err)
		}
	}
	return topicsReady(brokers, names)
}

// topicsReady waits until the leader of every partition of topics answers
// a ListOffsets for it. CreateTopics returns before that: a new topic's
// partitions first answer NOT_LEADER_OR_FOLLOWER, which a producer meets
// with retries after a backoff and a metadata refresh, and a consumer
// with an error. A scenario that started then would measure the topics'
// birth, not the relay.
func topicsReady(brokers []string, topics []string) error {
	sc := sarama.NewConfig()
	sc.Version = publisher.MinKafkaVersion
	sc.Metadata.Retry.Max = 0
	client, err := sarama.NewClient(brokers, sc)
	if err != nil {
		return fmt.Errorf("connect to %v: %w", brokers, err)
	}
	defer client.Close()
	var last error
	err = poll(context.Background(), setupTimeout, 20*time.Millisecond, func() (bool, error) {
		if last = client.RefreshMetadata(topics...); last != nil {
			return false, nil
		}
		for _, t := range topics {
			parts, err := client.Partitions(t)
			if err == nil && len(parts) == 0 {
				err = errors.New("no partitions")
			}
			if err != nil {
				last = fmt.Errorf("topic %s: %w", t, err)
				return false, nil
			}
			for _, p := range parts {
				if _, err := client.GetOffset(t, p, sarama.OffsetNewest); err != nil {
					last = fmt.Errorf("topic %s partition %d: %w", t, p, err)
					return false, nil
				}
			}
		}
		return true, nil
	})
	if errors.Is(err, errPollTimeout) {
		return fmt.Errorf("topics not ready after %s: %w", setupTimeout, last)
	}
	return err
}
