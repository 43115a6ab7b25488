#!/usr/bin/env bash
# Runs one chaos run of 1,000,000 messages (OUTBOX_SOAK=1: 2,000 keys,
# 8 writers at 4,000 msg/s, 10 min drain limit), without the race detector,
# and prints its summary lines. The run is too long for the CI pass; its
# figures are in RELIABILITY.md.
#
#   bash scripts/chaos-million.sh [kind]
#
# kind: default (TestChaos: process, database and kfake broker faults,
# the default publisher), strict (TestChaosStrict), network (TestChaosNetwork,
# both modes in parallel: relays in network namespaces, partitions, delay and
# loss; needs root and iproute2), network-default or network-strict (one
# mode of it). Default: default. OUTBOX_CHAOS_SEED reruns a seed;
# OUTBOX_CHAOS_LOGDIR keeps the relays' logs.
set -euo pipefail
cd "$(dirname "$0")/.."

kind=${1:-default}
case "$kind" in
  default) run='^TestChaos$' ;;
  strict) run='^TestChaosStrict$' ;;
  network) run='^TestChaosNetwork$' ;;
  network-default) run='^TestChaosNetwork$/^default$' ;;
  network-strict) run='^TestChaosNetwork$/^strict$' ;;
  *) echo "usage: $0 [default|strict|network|network-default|network-strict]" >&2; exit 2 ;;
esac

bash scripts/services.sh
log=$(mktemp "${TMPDIR:-/tmp}/chaos-million.XXXXXX.log")
echo "== chaos, 1,000,000 messages ($kind); full output in $log"
start=$SECONDS
status=0
OUTBOX_SOAK=1 CI="${CI:-true}" go test -count=1 -run "$run" -timeout 90m -v ./test/chaos/ >"$log" 2>&1 || status=$?
grep -E 'chaos (summary|network summary|liveness)|faults by kind|--- (PASS|FAIL)' "$log" | sed 's/^ *//'
if [ "$status" != 0 ]; then
  grep -E -- '--- FAIL|Error:|panic:' -A6 "$log" | head -60
fi
echo "chaos-million: $kind exited $status after $((SECONDS - start)) s"
exit "$status"
