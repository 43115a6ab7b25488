#!/usr/bin/env bash
# Runs the whole test suite: starts the databases if needed, then vets and
# tests every module of the repository with the race detector.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/services.sh

echo "== go vet"
go vet ./...
echo "== go test (library)"
go test -race -count=1 -timeout 15m ./...
if [ -f examples/gin-orders/go.mod ]; then
  echo "== go test (examples/gin-orders)"
  (cd examples/gin-orders && go vet ./... && go test -race -count=1 -timeout 10m ./...)
fi
