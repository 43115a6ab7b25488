#!/usr/bin/env bash
# Runs the whole test suite: starts the databases if needed, then vets and
# tests every module of the repository with the race detector.
set -euo pipefail
cd "$(dirname "$0")/.."

# Nothing built or downloaded belongs in the repository: refuse any tracked
# file over 1 MB (binaries, jars, databases, caches) before anything else runs.
echo "== tracked files over 1 MB"
too_large=$({ git ls-files -z | xargs -0 -r stat -c '%s %n' 2>/dev/null || true; } | awk '$1 > 1048576 { printf "  %s (%.1f MB)\n", substr($0, index($0, " ") + 1), $1 / 1048576 }')
if [ -n "$too_large" ]; then
  echo "error: these tracked files are over 1 MB; build outputs and downloads must not be committed." >&2
  echo "$too_large" >&2
  echo "Remove them with 'git rm --cached <file>' and add them to .gitignore." >&2
  exit 1
fi

bash scripts/services.sh

# promtool validates and unit-tests the shipped alert rules
# (deploy/prometheus); Debian's prometheus package provides it.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "== installing promtool (Debian package prometheus)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
    || echo "warning: could not install promtool; the alert rule unit tests will be skipped"
fi
if [ "${CI:-}" = true ] && command -v promtool >/dev/null 2>&1; then
  export OUTBOX_REQUIRE_PROMTOOL=1
fi

echo "== go vet"
go vet ./...
echo "== go test (library)"
go test -race -count=1 -timeout 15m ./...
if [ -f examples/gin-orders/go.mod ]; then
  echo "== go test (examples/gin-orders)"
  (cd examples/gin-orders && go vet ./... && go test -race -count=1 -timeout 10m ./...)
fi
