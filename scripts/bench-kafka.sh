#!/usr/bin/env bash
# Runs cmd/outbox-bench against Apache Kafka on loopback, started by
# scripts/kafka.sh:
#
#   scripts/bench-kafka.sh --nodes 1|3 [outbox-bench flags...]
#
# --nodes 3 is three KRaft nodes, replication factor 3 and
# min.insync.replicas 2 (kafka.sh's settings for three nodes); --nodes 1 is
# one node. The script starts the cluster, runs the bench with -brokers
# naming every node, and stops the cluster when the bench exits. A cluster
# already running in OUTBOX_KAFKA_DIR with that many nodes is used and left
# running; one of another size is an error. Environment:
#
#   OUTBOX_KAFKA_DIR, OUTBOX_KAFKA_PORT, ...   as scripts/kafka.sh reads them
#   OUTBOX_BENCH                               a built outbox-bench binary
#                                              (default: go run ./cmd/outbox-bench)
set -euo pipefail

cd "$(dirname "$0")/.."
KAFKA="$PWD/scripts/kafka.sh"
STATE=${OUTBOX_KAFKA_DIR:-/tmp/gorm-outbox-kafka}

die() { echo "bench-kafka: ERROR: $*" >&2; exit 2; }

nodes=""
case "${1:-}" in
  --nodes) nodes=${2:-}; shift 2 || die "--nodes needs 1 or 3" ;;
  --nodes=*) nodes=${1#--nodes=}; shift ;;
esac
case "$nodes" in
  1 | 3) ;;
  *) die "usage: scripts/bench-kafka.sh --nodes 1|3 [outbox-bench flags...]" ;;
esac

if bootstrap=$(bash "$KAFKA" bootstrap 2>/dev/null); then
  running=$(cat "$STATE/nodes")
  [ "$running" = "$nodes" ] || die "a $running-node cluster runs in $STATE: stop it (scripts/kafka.sh stop) or set another OUTBOX_KAFKA_DIR"
  echo "bench-kafka: using the $nodes-node cluster running in $STATE ($bootstrap)" >&2
else
  trap 'bash "$KAFKA" stop' EXIT
  bootstrap=$(bash "$KAFKA" start --nodes "$nodes")
fi

if [ -n "${OUTBOX_BENCH:-}" ]; then
  "$OUTBOX_BENCH" -brokers "$bootstrap" "$@"
else
  go run ./cmd/outbox-bench -brokers "$bootstrap" "$@"
fi
