#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on loopback for the tests (Debian's
# postgresql package, run as the postgres user; trust auth on 127.0.0.1
# only). CI starts one and exports SANDBOX_TEST_DATABASE_URL; tests that
# restart PostgreSQL start their own with the same script.
#   cluster.sh start DIR PORT   prints the URL of database "postgres"
#   cluster.sh stop DIR         immediate shutdown
#   cluster.sh restart DIR      fast restart (kills open connections)
set -euo pipefail
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -x "$bin/initdb" ] || { echo "PostgreSQL server binaries not found (apt-get install postgresql)" >&2; exit 1; }
as_pg() { if [ "$(id -un)" = postgres ]; then "$@"; else su postgres -s /bin/sh -c "$(printf '%q ' "$@")"; fi; }
cmd=$1 dir=$2
case "$cmd" in
start)
  port=$3
  mkdir -p "$dir"
  chown postgres: "$dir" 2>/dev/null || true
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    as_pg "$bin/initdb" -D "$dir/data" -U postgres -A trust --no-sync -E UTF8 >"$dir/initdb.log" 2>&1 ||
      { cat "$dir/initdb.log" >&2; exit 1; }
  fi
  as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start >/dev/null ||
    { cat "$dir/server.log" >&2; exit 1; }
  echo "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
  ;;
stop) as_pg "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null ;;
restart) as_pg "$bin/pg_ctl" -D "$dir/data" -m fast -w restart >/dev/null ;;
*) echo "usage: $0 start DIR PORT | stop DIR | restart DIR" >&2; exit 2 ;;
esac
