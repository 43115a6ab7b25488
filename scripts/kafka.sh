#!/usr/bin/env bash
# Runs Apache Kafka (KRaft, combined broker+controller nodes) on loopback for
# the tests, the chaos suite and the benchmarks.
#
#   scripts/kafka.sh start [--nodes 1|3]   resolve, format, start, wait, print the bootstrap
#   scripts/kafka.sh stop                  stop every node (no orphan JVMs)
#   scripts/kafka.sh status                the nodes and their pids
#   scripts/kafka.sh bootstrap             the bootstrap addresses of the running cluster
#   scripts/kafka.sh topic NAME [PARTITIONS]
#                                          create topic NAME (PARTITIONS, default 1, replicated
#                                          to every node; auto-creation is off) and print its
#                                          name; an existing NAME with as many partitions is kept
#   scripts/kafka.sh kill|pause|resume N   SIGKILL / SIGSTOP / SIGCONT node N (chaos)
#   scripts/kafka.sh start-node N          start node N again after a kill (chaos)
#   scripts/kafka.sh resolve               only fetch the jars into the cache
#
# The broker and its runtime dependencies come from Maven Central through mvn
# (org.apache.kafka:kafka_2.13 at KAFKA_VERSION below, the one place the
# version is pinned) into a cache outside the work tree. Needs Java 17+ and
# Maven. Environment:
#
#   OUTBOX_KAFKA_CACHE      jar cache       (default ~/.cache/gorm-outbox/kafka-$KAFKA_VERSION)
#   OUTBOX_KAFKA_DIR        state: data, logs (node-N/server.log, node-N/gc.log: the
#                           JVM's GC pauses, with wall-clock times), pids (default
#                           /tmp/gorm-outbox-kafka)
#   OUTBOX_KAFKA_PORT       first broker port (default 29092; controllers at +100);
#                           keep it below the kernel's ephemeral range
#                           (/proc/sys/net/ipv4/ip_local_port_range), where an
#                           outgoing connection can hold the port and the node
#                           fails to bind
#   OUTBOX_KAFKA_HEAP       JVM heap per node (default 512m)
#   OUTBOX_KAFKA_HOSTS      comma-separated address per node, each node's broker and
#                           controller listening and advertised on its own (default:
#                           every node on 127.0.0.1); kept for later commands
set -euo pipefail

KAFKA_VERSION=4.4.0
SLF4J_VERSION=2.0.17
LOG4J_VERSION=2.25.5

CACHE=${OUTBOX_KAFKA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gorm-outbox/kafka-$KAFKA_VERSION}
STATE=${OUTBOX_KAFKA_DIR:-/tmp/gorm-outbox-kafka}
PORT=${OUTBOX_KAFKA_PORT:-29092}
HEAP=${OUTBOX_KAFKA_HEAP:-512m}
HOSTS=${OUTBOX_KAFKA_HOSTS:-$(cat "$STATE/hosts" 2>/dev/null || true)}

log() { echo "kafka: $*" >&2; }
die() { echo "kafka: ERROR: $*" >&2; exit 1; }

broker_port() { echo $((PORT + $1 - 1)); }
controller_port() { echo $((PORT + 100 + $1 - 1)); }
node_count() { cat "$STATE/nodes" 2>/dev/null || echo 0; }
host() { # node: its address, the N-th of OUTBOX_KAFKA_HOSTS or 127.0.0.1
  local h
  [ -n "$HOSTS" ] || { echo 127.0.0.1; return; }
  h=$(echo "$HOSTS" | cut -d, -f"$1")
  [ -n "$h" ] || die "OUTBOX_KAFKA_HOSTS ($HOSTS) names no address for node $1"
  echo "$h"
}
bootstrap() {
  local n i out=""
  n=$(node_count)
  for i in $(seq 1 "$n"); do out="$out${out:+,}$(host "$i"):$(broker_port "$i")"; done
  echo "$out"
}

resolve() {
  [ -f "$CACHE/.complete" ] && return 0
  command -v java >/dev/null 2>&1 || die "java not found: Apache Kafka $KAFKA_VERSION needs Java 17 or newer"
  command -v mvn >/dev/null 2>&1 || die "mvn not found: Maven resolves Apache Kafka from Maven Central"
  log "resolving org.apache.kafka:kafka_2.13:$KAFKA_VERSION from Maven Central into $CACHE"
  mkdir -p "$CACHE"
  rm -rf "$CACHE/libs"
  cat >"$CACHE/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>gorm-outbox.local</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>$SLF4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>$LOG4J_VERSION</version></dependency>
  </dependencies>
</project>
EOF
  if ! (cd "$CACHE" && mvn -q -B dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory=libs >"$CACHE/mvn.log" 2>&1); then
    tail -20 "$CACHE/mvn.log" >&2
    die "could not resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION from Maven Central (log: $CACHE/mvn.log)"
  fi
  [ -f "$CACHE/libs/kafka_2.13-$KAFKA_VERSION.jar" ] || die "kafka_2.13-$KAFKA_VERSION.jar missing after resolution"
  cat >"$CACHE/log4j2.properties" <<'EOF'
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = info
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
EOF
  touch "$CACHE/.complete"
}


tool() { # main class, args... (client-side tools)
  java -Xmx256m -XX:TieredStopAtLevel=1 -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
    -Dkafka.logs.dir="$STATE" -cp "$CACHE/libs/*" "$@"
}

ephemeral_port() { # port: inside the kernel's ephemeral range?
  local lo hi
  read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || return 1
  [ "$1" -ge "$lo" ] && [ "$1" -le "$hi" ]
}
port_in_use() { (exec 3<>"/dev/tcp/${2:-127.0.0.1}/$1") 2>/dev/null; }

write_config() { # node, nodes
  local i=$1 n=$2 voters="" j rf minisr
  for j in $(seq 1 "$n"); do voters="$voters${voters:+,}$j@$(host "$j"):$(controller_port "$j")"; done
  rf=$n
  minisr=1
  [ "$n" -ge 3 ] && minisr=2
  cat >"$STATE/node-$i/server.properties" <<EOF
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=PLAINTEXT://$(host "$i"):$(broker_port "$i"),CONTROLLER://$(host "$i"):$(controller_port "$i")
advertised.listeners=PLAINTEXT://$(host "$i"):$(broker_port "$i")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$STATE/node-$i/data
num.partitions=1
auto.create.topics.enable=false
delete.topic.enable=true
default.replication.factor=$rf
min.insync.replicas=$minisr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$minisr
transaction.state.log.num.partitions=10
unclean.leader.election.enable=false
group.initial.rebalance.delay.ms=0
replica.lag.time.max.ms=10000
broker.session.timeout.ms=9000
broker.heartbeat.interval.ms=1000
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.segment.bytes=67108864
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$minisr
EOF
}

start_node() { # node
  local i=$1 pid
  if [ -f "$STATE/node-$i/pid" ] && kill -0 "$(cat "$STATE/node-$i/pid")" 2>/dev/null; then
    return 0
  fi
  for p in "$(broker_port "$i")" "$(controller_port "$i")"; do
    port_in_use "$p" "$(host "$i")" && die "port $p is in use (node $i): stop what listens there or set OUTBOX_KAFKA_PORT"
    ephemeral_port "$p" && echo "kafka: warning: port $p is in the ephemeral range ($(tr -s '\t ' ' ' </proc/sys/net/ipv4/ip_local_port_range)): an outgoing connection may hold it; set OUTBOX_KAFKA_PORT below it" >&2
  done
  setsid bash -c 'exec "$@" >>"'"$STATE/node-$i/stdout.log"'" 2>&1 </dev/null' _ \
    java -Xms128m -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError \
    -Xlog:gc:file="$STATE/node-$i/gc.log":time,uptime:filecount=2,filesize=10m \
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$CACHE/log4j2.properties" \
    -Dkafka.logs.dir="$STATE/node-$i" -Dgorm.outbox.kafka.node="$STATE/node-$i" \
    -cp "$CACHE/libs/*" kafka.Kafka "$STATE/node-$i/server.properties" &
  pid=$!
  echo "$pid" >"$STATE/node-$i/pid"
}

wait_ready() { # nodes
  local n=$1 i deadline=$((SECONDS + 120))
  for i in $(seq 1 "$n"); do
    until port_in_use "$(broker_port "$i")" "$(host "$i")"; do
      kill -0 "$(cat "$STATE/node-$i/pid")" 2>/dev/null || {
        tail -30 "$STATE/node-$i/stdout.log" "$STATE/node-$i/server.log" >&2 2>/dev/null || true
        die "node $i exited during start (logs: $STATE/node-$i/)"
      }
      [ $SECONDS -lt $deadline ] || die "node $i did not listen on $(broker_port "$i") within 120 s"
      sleep 0.5
    done
  done
  # Metadata answers and every broker is registered: a topic replicated to
  # all nodes can be created only then.
  until tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$(bootstrap)" --create --if-not-exists \
    --topic gorm-outbox-ready --partitions 1 --replication-factor "$n" >"$STATE/ready.log" 2>&1; do
    [ $SECONDS -lt $deadline ] || { cat "$STATE/ready.log" >&2; die "cluster did not answer metadata requests within 120 s"; }
    sleep 1
  done
}

cmd_start() {
  local n=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) n=$2; shift 2 ;;
      --nodes=*) n=${1#--nodes=}; shift ;;
      *) die "unknown option $1" ;;
    esac
  done
  case "$n" in 1 | 3) ;; *) die "--nodes must be 1 or 3" ;; esac
  resolve
  if [ "$(node_count)" != 0 ] && running_any; then
    if [ "$(node_count)" = "$n" ]; then
      bootstrap
      return 0
    fi
    log "stopping the $(node_count)-node cluster left running in $STATE"
    cmd_stop
  fi
  rm -rf "$STATE"
  mkdir -p "$STATE"
  HOSTS=${OUTBOX_KAFKA_HOSTS:-} # a new cluster: not the addresses of the one it replaces
  echo "$n" >"$STATE/nodes"
  [ -z "$HOSTS" ] || echo "$HOSTS" >"$STATE/hosts"
  local id i
  id=$(tool kafka.tools.StorageTool random-uuid 2>/dev/null | tail -1)
  [ -n "$id" ] || die "kafka-storage random-uuid failed"
  for i in $(seq 1 "$n"); do
    mkdir -p "$STATE/node-$i/data"
    write_config "$i" "$n"
    tool kafka.tools.StorageTool format -t "$id" -c "$STATE/node-$i/server.properties" --ignore-formatted \
      >"$STATE/node-$i/format.log" 2>&1 || { cat "$STATE/node-$i/format.log" >&2; die "formatting node $i failed"; }
  done
  log "starting Apache Kafka $KAFKA_VERSION ($n node(s), KRaft) in $STATE"
  for i in $(seq 1 "$n"); do start_node "$i"; done
  wait_ready "$n"
  log "ready: $(bootstrap)"
  bootstrap
}

running_any() {
  local i
  for i in $(seq 1 "$(node_count)"); do
    [ -f "$STATE/node-$i/pid" ] && kill -0 "$(cat "$STATE/node-$i/pid")" 2>/dev/null && return 0
  done
  return 1
}

stop_node() { # node
  local i=$1 pid t
  [ -f "$STATE/node-$i/pid" ] || return 0
  pid=$(cat "$STATE/node-$i/pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -CONT "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
    for t in $(seq 1 60); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
      # A killed JVM holds its ports until it has exited: return only then,
      # so whoever starts next (or checks the ports) finds them closed.
      for t in $(seq 1 120); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.25
      done
    fi
  fi
  rm -f "$STATE/node-$i/pid"
}

cmd_stop() {
  local i n
  n=$(node_count)
  [ "$n" = 0 ] && return 0
  # The last node standing has no quorum to shut down gracefully into; stop
  # them together.
  for i in $(seq 1 "$n"); do
    [ -f "$STATE/node-$i/pid" ] && kill -CONT "$(cat "$STATE/node-$i/pid")" 2>/dev/null && kill -TERM "$(cat "$STATE/node-$i/pid")" 2>/dev/null || true
  done
  for i in $(seq 1 "$n"); do stop_node "$i"; done
  # Nothing of ours may survive: any JVM started with this state directory.
  pkill -KILL -f "gorm.outbox.kafka.node=$STATE/" 2>/dev/null || true
  for i in $(seq 1 120); do
    pgrep -f "gorm.outbox.kafka.node=$STATE/" >/dev/null || break
    sleep 0.25
  done
  pgrep -f "gorm.outbox.kafka.node=$STATE/" >/dev/null && die "a node of $STATE survived SIGKILL for 30 s"
  log "stopped"
}

cmd_topic() { # name [partitions]
  local name=${1:-} parts=${2:-1} n out have
  [ -n "$name" ] && [ $# -le 2 ] || die "usage: scripts/kafka.sh topic NAME [PARTITIONS]"
  case "$parts" in '' | *[!0-9]* | 0*) die "PARTITIONS must be a positive whole number, not '$parts'" ;; esac
  running_any || die "no cluster running in $STATE"
  resolve
  n=$(node_count)
  if ! out=$(tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$(bootstrap)" --create --if-not-exists \
    --topic "$name" --partitions "$parts" --replication-factor "$n" 2>&1); then
    echo "$out" >&2
    die "creating topic $name failed"
  fi
  # --if-not-exists keeps an existing topic whatever its partitions: a
  # caller asking for another count must hear of it.
  out=$(tool org.apache.kafka.tools.TopicCommand --bootstrap-server "$(bootstrap)" --describe --topic "$name" 2>&1) ||
    { echo "$out" >&2; die "describing topic $name failed"; }
  have=$(echo "$out" | sed -n 's/.*PartitionCount: *\([0-9]*\).*/\1/p' | head -1)
  [ "$have" = "$parts" ] || die "topic $name exists with ${have:-an unknown number of} partitions, not $parts"
  echo "$name"
}

node_pid() {
  local i=$1
  [ -f "$STATE/node-$i/pid" ] || die "node $i is not running"
  cat "$STATE/node-$i/pid"
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  resolve) resolve; echo "$CACHE" ;;
  bootstrap) running_any || die "no cluster running"; bootstrap ;;
  topic) shift; cmd_topic "$@" ;;
  status)
    for i in $(seq 1 "$(node_count)"); do
      p=$(cat "$STATE/node-$i/pid" 2>/dev/null || echo -)
      if [ "$p" != - ] && kill -0 "$p" 2>/dev/null; then s=running; else s=down; fi
      echo "node $i $(host "$i"):$(broker_port "$i") pid $p $s"
    done ;;
  kill) kill -KILL "$(node_pid "$2")"; rm -f "$STATE/node-$2/pid" ;;
  pause) kill -STOP "$(node_pid "$2")" ;;
  resume) kill -CONT "$(node_pid "$2")" ;;
  start-node) start_node "$2" ;;
  *) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
