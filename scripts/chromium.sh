#!/usr/bin/env bash
# Installs (when missing) the headless browser the UI tests drive
# (test/ui): Debian's chromium package, from the distribution's own
# archive; nothing is downloaded by the tests themselves. Prints the
# browser's path and version.
#
# A browser given by OUTBOX_CHROMIUM, or already on PATH as chromium,
# chromium-browser or google-chrome, is used as it is. Installing needs
# root and apt-get; when it cannot be installed the script exits non-zero,
# and under CI=true that fails the run (the UI tests would fail anyway:
# they never skip in CI).
set -euo pipefail

log() { echo "chromium: $*"; }
die() { echo "chromium: ERROR: $*" >&2; exit 1; }

find_browser() {
  if [ -n "${OUTBOX_CHROMIUM:-}" ]; then
    [ -x "$OUTBOX_CHROMIUM" ] || die "OUTBOX_CHROMIUM=$OUTBOX_CHROMIUM is not an executable"
    echo "$OUTBOX_CHROMIUM"
    return 0
  fi
  local name
  for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
      command -v "$name"
      return 0
    fi
  done
  return 1
}

if ! browser=$(find_browser); then
  [ "$(id -u)" = 0 ] || die "no chromium and not root: install it (apt-get install chromium) or set OUTBOX_CHROMIUM"
  command -v apt-get >/dev/null 2>&1 || die "no chromium and no apt-get on this machine: install a Chromium and set OUTBOX_CHROMIUM"
  log "installing Debian package chromium"
  apt-get update -qq >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
    || die "apt-get install chromium failed"
  browser=$(find_browser) || die "chromium installed but not on PATH"
fi
log "$browser: $("$browser" --headless --no-sandbox --disable-gpu --version 2>/dev/null | head -1 || echo 'version unknown')"
