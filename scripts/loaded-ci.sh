#!/usr/bin/env bash
# Runs the CI entry point (.ci/run) N times, each from a clean clone of the
# repository's committed HEAD, while the machine is kept busy: one CPU
# burner per core plus a steady pgbench write load (4 clients) on its own
# PostgreSQL database. Prints the pass count. The load is what a shared CI
# machine sees: other suites with their own databases and builds.
#
#   bash scripts/loaded-ci.sh 20
#
# The Go build cache is warmed (every test binary compiled once) before
# the load starts. Bounded and self-stopping: each run is limited to
# OUTBOX_LOADED_CI_RUN_TIMEOUT (default 45m: a run under this load took
# 14 to 15 minutes on one 2-core machine and 26 on another), the load
# and the run in progress (with its Apache Kafka nodes) stop with the
# script (also on Ctrl-C or an error), the pgbench database
# is dropped and the clones are removed. The logs of failed runs are kept
# and their paths printed; of a green run the chaos summary lines (faults,
# loss, order, resumed after) and the Apache Kafka count are printed. Exit status 0 only if
# every run passed.
#
# Environment: OUTBOX_LOADED_CI_BURNERS (CPU burners, default: the number
# of cores), OUTBOX_LOADED_CI_PGBENCH_CLIENTS (default 4),
# PGHOST/PGPORT/PGUSER (default 127.0.0.1, 5432, postgres).
set -euo pipefail

runs="${1:-}"
if ! [[ "$runs" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 N   (N >= 1 runs of .ci/run under load)" >&2
  exit 2
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
sha="$(git -C "$repo" rev-parse HEAD)"
run_timeout="${OUTBOX_LOADED_CI_RUN_TIMEOUT:-45m}"
burners="${OUTBOX_LOADED_CI_BURNERS:-$(nproc)}"
clients="${OUTBOX_LOADED_CI_PGBENCH_CLIENTS:-4}"
export PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"

log() { echo "loaded-ci: $*"; }
# clone_head DIR: a clean clone of the repository at the commit under test.
clone_head() {
  git clone -q --no-checkout "$repo" "$1"
  git -C "$1" checkout -q "$sha"
}

work="$(mktemp -d "${TMPDIR:-/tmp}/outbox-loaded-ci.XXXXXX")"
db="outbox_loaded_ci_$$"
load_pids=()
run_pid=

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  # The run in progress: timeout runs it in a process group of its own,
  # which a Ctrl-C or a kill of this script's group does not reach, and
  # passes a TERM on to it; .ci/run then stops its Apache Kafka nodes.
  # The wait is for the whole group, not timeout itself, which exits as
  # soon as .ci/run's shell does, while the test script's trap still
  # stops Kafka. A group not empty 90 s later is killed.
  if [ -n "$run_pid" ]; then
    kill -TERM "$run_pid" 2>/dev/null || true
    for _ in $(seq 90); do
      kill -0 -- "-$run_pid" 2>/dev/null || break
      sleep 1
    done
    kill -KILL -- "-$run_pid" 2>/dev/null || true
    wait "$run_pid" 2>/dev/null || true
    log "run stopped before its end; its log: $logfile"
  fi
  for pid in "${load_pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${load_pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  dropdb --if-exists "$db" >/dev/null 2>&1 || true
  rm -f "$work/pgbench.log"
  find "$work" -mindepth 1 -maxdepth 1 -type d -name 'clone-*' -exec rm -rf {} +
  if [ -z "$(find "$work" -mindepth 1 -print -quit)" ]; then
    rmdir "$work"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bash "$repo/scripts/services.sh"

# Compile every test binary once before the load starts, so that the runs
# measure the suite under load, not the first compile of a fresh machine:
# with an empty Go build cache, the example's race-instrumented SQLite
# driver (modernc.org/sqlite) alone took about 25 minutes at this load.
# The clones share the cache; their own packages still compile in every
# run.
log "warming the Go build cache (before the load; not a run)"
clone_head "$work/clone-warm"
if ! (cd "$work/clone-warm" && go test -race -count=1 -run '^$' ./... >/dev/null &&
  cd examples/gin-orders && go test -race -count=1 -run '^$' ./... >/dev/null); then
  log "warning: warming the build cache failed; the first run compiles everything"
fi
rm -rf "$work/clone-warm"

# The load. Each burner is a subshell spinning on the CPU (about 95% of a
# core) that sleeps for a millisecond every 40 ms or so, as a build or a
# test suite does; pgbench writes to its own database for as long as the
# script may run, and is stopped with it. A burner that never sleeps is
# not what a CI host runs, and on this project's 2-core machines it
# starved every process of another session (each is an autogroup of its
# own: Apache Kafka's nodes, PostgreSQL, MariaDB) of the CPU altogether
# once it had run for about five minutes: a busy loop started then got
# 0% of a core over 5 s, the one Kafka broker's controller events took
# up to 114 s and KRaft fenced the broker again and again. Burners that
# sleep leave the scheduler fair (65 to 89% of a core for that loop
# after 2 to 9 minutes).
log "load: $burners CPU burner(s), pgbench with $clients client(s) on database $db"
for _ in $(seq "$burners"); do
  ( while :; do
      for ((i = 0; i < 20000; i++)); do :; done
      sleep 0.001
    done ) &
  load_pids+=("$!")
done
createdb "$db"
pgbench -q -i -s 5 "$db" >/dev/null 2>&1
pgbench -n -c "$clients" -j 2 -T $((24 * 3600)) "$db" >"$work/pgbench.log" 2>&1 &
load_pids+=("$!")

passed=0
for i in $(seq "$runs"); do
  clone="$work/clone-$i"
  clone_head "$clone"
  logfile="$work/run-$i.log"
  start=$(date +%s)
  # In the background, so that a signal ends the wait at once and the
  # cleanup stops the run.
  (cd "$clone" && CI=true exec timeout --kill-after=30s "$run_timeout" bash .ci/run) >"$logfile" 2>&1 &
  run_pid=$!
  run_status=0
  wait "$run_pid" || run_status=$?
  run_pid=
  if [ "$run_status" = 0 ]; then
    passed=$((passed + 1))
    log "run $i of $runs: green ($(( $(date +%s) - start ))s, load average $(cut -d' ' -f1-3 /proc/loadavg))"
    # The figures of a green run (the chaos summary lines and the Apache
    # Kafka count) are printed before its log is removed.
    grep -E 'chaos summary:|^apache-kafka:' "$logfile" | sed 's/^ *\(.*\.go:[0-9]*: \)\{0,1\}/    /' || true
    rm -f "$logfile"
  else
    log "run $i of $runs: FAILED ($(( $(date +%s) - start ))s); log: $logfile"
    grep -E -- '^(--- FAIL|FAIL|panic:)|Error:' "$logfile" | head -20 | sed 's/^/    /' || true
  fi
  rm -rf "$clone"
done

log "$passed of $runs runs green at commit ${sha:0:12}"
[ "$passed" = "$runs" ]
