#!/usr/bin/env bash
# Installs (when missing) and starts the PostgreSQL and MariaDB servers the
# tests use, creates database `test` in each and sets the access the tests
# expect:
#
#   PostgreSQL  postgres@127.0.0.1:5432, trust on loopback
#   PostgreSQL  postgres@127.0.0.1:5434, a second cluster ("wal") with
#               wal_level = logical for the WAL mode tests, trust on
#               loopback for normal and replication connections
#   MariaDB     root@127.0.0.1:3306, empty password
#
# Idempotent and quiet when all three already answer; a running server is
# never restarted. A server given by OUTBOX_TEST_POSTGRES_DSN /
# OUTBOX_TEST_POSTGRES_WAL_DSN / OUTBOX_TEST_MYSQL_DSN is left alone. Installing
# needs root and Debian's apt-get; anything that cannot be installed or
# started is named and the script exits non-zero.
set -euo pipefail

log() { echo "services: $*"; }
die() { echo "services: ERROR: $*" >&2; exit 1; }

pg_ready() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }
pgwal_ready() { pg_isready -h 127.0.0.1 -p 5434 -q 2>/dev/null; }
my_client() { if command -v mariadb >/dev/null 2>&1; then mariadb "$@"; else mysql "$@"; fi; }
my_ready() { my_client -h 127.0.0.1 -P 3306 -uroot --connect-timeout=2 -e 'SELECT 1' >/dev/null 2>&1; }

apt_updated=0
apt_install() {
  [ "$(id -u)" = 0 ] || die "$* missing and not root: install it (apt-get install $*) or set the DSN variables"
  command -v apt-get >/dev/null 2>&1 || die "$* missing and no apt-get on this machine"
  if [ "$apt_updated" = 0 ]; then
    log "apt-get update"
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt_updated=1
  fi
  log "installing $*"
  # policy-rc.d may deny the package's own start; this script starts the servers itself.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
    || die "apt-get install $* failed"
}

wait_for() { # name, probe function, seconds
  local i
  for i in $(seq 1 "$3"); do
    "$2" && return 0
    sleep 1
  done
  return 1
}

# ---------------------------------------------------------------- PostgreSQL
# pg_version installs PostgreSQL when missing and prints its newest version.
pg_version() {
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql 2>/dev/null)" ]; then
    apt_install postgresql postgresql-client >&2
  fi
  ls /usr/lib/postgresql | sort -V | tail -1
}

start_postgres() {
  local v
  v=$(pg_version)
  if ! pg_lsclusters -h 2>/dev/null | awk '{print $1" "$2}' | grep -qx "$v main"; then
    log "creating PostgreSQL $v cluster"
    pg_createcluster "$v" main >/dev/null || die "pg_createcluster $v main failed"
  fi
  local conf=/etc/postgresql/$v/main
  # Trust on loopback for the tests (the first matching line wins).
  if ! grep -q '^# gorm-outbox tests' "$conf/pg_hba.conf"; then
    local tmp
    tmp=$(mktemp)
    {
      echo '# gorm-outbox tests: trust on loopback'
      echo 'host all all 127.0.0.1/32 trust'
      echo 'host all all ::1/128 trust'
      cat "$conf/pg_hba.conf"
    } >"$tmp"
    cat "$tmp" >"$conf/pg_hba.conf"
    rm -f "$tmp"
  fi
  # Enough connections for parallel test packages, several relays and the chaos suite.
  if ! grep -q '^max_connections = 500' "$conf/postgresql.conf"; then
    echo 'max_connections = 500' >>"$conf/postgresql.conf"
  fi
  if pg_lsclusters -h | awk -v v="$v" '$1==v && $2=="main" {print $4}' | grep -q online; then
    pg_ctlcluster --skip-systemctl-redirect "$v" main reload >/dev/null 2>&1 || true
  else
    log "starting PostgreSQL $v"
    pg_ctlcluster --skip-systemctl-redirect "$v" main start || die "PostgreSQL $v did not start (see /var/log/postgresql/)"
  fi
  wait_for postgres pg_ready 60 || die "PostgreSQL does not answer on 127.0.0.1:5432"
  psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE test" \
    || die "cannot create PostgreSQL database test"
}

# ------------------------------------------- PostgreSQL for WAL mode (5434)
# A cluster of its own, so the shared server's settings never change and it
# is never restarted for WAL mode.
start_postgres_wal() {
  local v
  v=$(pg_version)
  if ! pg_lsclusters -h 2>/dev/null | awk '{print $1" "$2}' | grep -qx "$v wal"; then
    log "creating PostgreSQL $v cluster wal on port 5434"
    pg_createcluster "$v" wal --port 5434 >/dev/null || die "pg_createcluster $v wal failed"
  fi
  local conf=/etc/postgresql/$v/wal
  if ! grep -q '^# gorm-outbox tests: WAL mode' "$conf/postgresql.conf"; then
    {
      echo '# gorm-outbox tests: WAL mode'
      echo 'wal_level = logical'
      echo 'max_replication_slots = 20'
      echo 'max_wal_senders = 20'
      echo 'max_connections = 300'
    } >>"$conf/postgresql.conf"
  fi
  if ! grep -q '^# gorm-outbox tests' "$conf/pg_hba.conf"; then
    local tmp
    tmp=$(mktemp)
    {
      echo '# gorm-outbox tests: trust on loopback, replication included'
      echo 'host all all 127.0.0.1/32 trust'
      echo 'host all all ::1/128 trust'
      echo 'host replication all 127.0.0.1/32 trust'
      echo 'host replication all ::1/128 trust'
      cat "$conf/pg_hba.conf"
    } >"$tmp"
    cat "$tmp" >"$conf/pg_hba.conf"
    rm -f "$tmp"
  fi
  if pg_lsclusters -h | awk -v v="$v" '$1==v && $2=="wal" {print $4}' | grep -q online; then
    pg_ctlcluster --skip-systemctl-redirect "$v" wal reload >/dev/null 2>&1 || true
  else
    log "starting PostgreSQL $v cluster wal"
    pg_ctlcluster --skip-systemctl-redirect "$v" wal start || die "PostgreSQL $v wal did not start (see /var/log/postgresql/)"
  fi
  wait_for postgres-wal pgwal_ready 60 || die "PostgreSQL (wal) does not answer on 127.0.0.1:5434"
  [ "$(psql -h 127.0.0.1 -p 5434 -U postgres -d postgres -tAc 'SHOW wal_level')" = logical ] \
    || die "PostgreSQL on 5434 runs with wal_level other than logical: restart it (pg_ctlcluster $v wal restart)"
  psql -h 127.0.0.1 -p 5434 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || psql -h 127.0.0.1 -p 5434 -U postgres -d postgres -qc "CREATE DATABASE test" \
    || die "cannot create PostgreSQL (wal) database test"
}

# ------------------------------------------------------------------- MariaDB
mariadbd_bin() {
  local b
  for b in /usr/sbin/mariadbd /usr/sbin/mysqld; do
    [ -x "$b" ] && { echo "$b"; return 0; }
  done
  return 1
}

start_mariadb() {
  mariadbd_bin >/dev/null || apt_install mariadb-server mariadb-client
  local bin
  bin=$(mariadbd_bin) || die "mariadb-server installed but no mariadbd found"
  if [ ! -d /var/lib/mysql/mysql ]; then
    log "initialising the MariaDB data directory"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null || die "mariadb-install-db failed"
  fi
  mkdir -p /run/mysqld
  chown mysql:mysql /run/mysqld 2>/dev/null || true
  if ! my_sock_ready; then
    log "starting MariaDB"
    setsid "$bin" --user=mysql --bind-address=127.0.0.1 --port=3306 \
      --max-connections=500 --innodb-flush-log-at-trx-commit=2 \
      --log-error=/var/log/mysql-outbox-tests.err </dev/null >/dev/null 2>&1 &
    wait_for mariadb my_sock_ready 60 || die "MariaDB did not start (see /var/log/mysql-outbox-tests.err)"
  fi
  # Root over TCP on loopback with an empty password (Debian's root uses the
  # unix socket only).
  if ! my_ready; then
    my_client -uroot -e "
      CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
      GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
      ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');
      FLUSH PRIVILEGES;" || die "cannot grant root access on 127.0.0.1"
  fi
  wait_for mariadb my_ready 30 || die "MariaDB does not accept root@127.0.0.1:3306"
  my_client -h 127.0.0.1 -P 3306 -uroot -e "CREATE DATABASE IF NOT EXISTS test" \
    || die "cannot create MariaDB database test"
}
my_sock_ready() { my_client -uroot --connect-timeout=2 -e 'SELECT 1' >/dev/null 2>&1 || my_ready; }

if [ -z "${OUTBOX_TEST_POSTGRES_DSN:-}" ]; then
  if pg_ready && psql -h 127.0.0.1 -U postgres -d test -tAc 'SELECT 1' >/dev/null 2>&1; then
    :
  else
    start_postgres
    log "PostgreSQL ready on 127.0.0.1:5432"
  fi
fi
if [ -z "${OUTBOX_TEST_POSTGRES_WAL_DSN:-}" ]; then
  if pgwal_ready && [ "$(psql -h 127.0.0.1 -p 5434 -U postgres -d test -tAc 'SHOW wal_level' 2>/dev/null)" = logical ]; then
    :
  else
    start_postgres_wal
    log "PostgreSQL (wal_level=logical) ready on 127.0.0.1:5434"
  fi
fi
if [ -z "${OUTBOX_TEST_MYSQL_DSN:-}" ]; then
  if my_ready && my_client -h 127.0.0.1 -P 3306 -uroot -e 'USE test' >/dev/null 2>&1; then
    :
  else
    start_mariadb
    log "MariaDB ready on 127.0.0.1:3306"
  fi
fi
