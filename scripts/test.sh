#!/usr/bin/env bash
# Runs the whole test suite: starts the databases if needed, then vets and
# tests every module of the repository with the race detector.
set -euo pipefail
cd "$(dirname "$0")/.."

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
