#!/usr/bin/env bash
# Starts the PostgreSQL and MariaDB servers the tests use when they are not
# already running, and waits until both answer. Safe to run repeatedly.
set -euo pipefail

pg_ready() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }
my_ready() { mariadb-admin -h 127.0.0.1 -P 3306 -uroot --connect-timeout=2 ping >/dev/null 2>&1 || mysqladmin -h 127.0.0.1 -P 3306 -uroot --connect-timeout=2 ping >/dev/null 2>&1; }

if [ -z "${OUTBOX_TEST_POSTGRES_DSN:-}" ] && ! pg_ready; then
  echo "services: starting PostgreSQL"
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    for v in $(ls /etc/postgresql); do
      pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
    done
  fi
fi
if [ -z "${OUTBOX_TEST_MYSQL_DSN:-}" ] && ! my_ready; then
  echo "services: starting MariaDB"
  if [ -x /usr/sbin/mariadbd ]; then
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
  fi
fi

for i in $(seq 1 60); do
  ok=1
  [ -n "${OUTBOX_TEST_POSTGRES_DSN:-}" ] || pg_ready || ok=0
  [ -n "${OUTBOX_TEST_MYSQL_DSN:-}" ] || my_ready || ok=0
  [ "$ok" = 1 ] && break
  sleep 1
done

# The tests create one schema or database per test inside these.
if [ -z "${OUTBOX_TEST_POSTGRES_DSN:-}" ] && pg_ready; then
  psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE test"
fi
if [ -z "${OUTBOX_TEST_MYSQL_DSN:-}" ] && my_ready; then
  mariadb -h 127.0.0.1 -P 3306 -uroot -e "CREATE DATABASE IF NOT EXISTS test" 2>/dev/null \
    || mysql -h 127.0.0.1 -P 3306 -uroot -e "CREATE DATABASE IF NOT EXISTS test"
fi
pg_ready && echo "services: PostgreSQL ready" || echo "services: PostgreSQL NOT reachable"
my_ready && echo "services: MariaDB ready" || echo "services: MariaDB NOT reachable"
