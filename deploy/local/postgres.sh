#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on 127.0.0.1 for tests and the local deployment.
#
#   deploy/local/postgres.sh start DIR [PORT]   # initdb in DIR (if new), start; prints the URL
#   deploy/local/postgres.sh stop DIR
#
# Needs Debian's `postgresql` package (apt-get install -y postgresql). The server refuses to run
# as root, so when run as root the cluster is owned by the `postgres` user. Trust authentication
# on 127.0.0.1 only: this cluster is for one machine's tests, never for data that matters.
set -euo pipefail

command=${1:?usage: postgres.sh start|stop DIR [PORT]}
dir=${2:?usage: postgres.sh start|stop DIR [PORT]}
# Below the kernel's ephemeral port range (32768-60999), so no outgoing connection holds it.
port=${3:-15432}

bin=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -1)
if [[ -z "$bin" || ! -x "$bin/initdb" ]]; then
    echo "postgres.sh: PostgreSQL is not installed (apt-get install -y postgresql)" >&2
    exit 1
fi

as_owner() {
    if [[ $(id -u) -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

case "$command" in
start)
    mkdir -p "$dir"
    if [[ $(id -u) -eq 0 ]]; then
        chown postgres "$dir"
        if ! runuser -u postgres -- test -w "$dir"; then
            echo "postgres.sh: the postgres user cannot reach $dir (is a parent directory 0700?)" >&2
            exit 1
        fi
    fi
    if [[ ! -f "$dir/PG_VERSION" ]]; then
        as_owner "$bin/initdb" -D "$dir" -U postgres --auth=trust --no-sync -E UTF8 >/dev/null
    fi
    # fsync stays on: tests of durability must not pass by accident. A failed start shows the
    # server's log and is tried once more (a start once failed in CI without a visible cause).
    for attempt in 1 2; do
        if as_owner "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 120 \
            -o "-h 127.0.0.1 -p $port -k $dir -c max_connections=400" start >/dev/null; then
            break
        fi
        echo "postgres.sh: start attempt $attempt failed; the server's log:" >&2
        tail -n 30 "$dir/server.log" >&2 || true
        if [[ $attempt -eq 2 ]]; then
            exit 1
        fi
        sleep 2
    done
    echo "postgres://postgres@127.0.0.1:$port/postgres"
    ;;
stop)
    as_owner "$bin/pg_ctl" -D "$dir" -m fast -w stop >/dev/null
    ;;
*)
    echo "postgres.sh: unknown command $command (start|stop)" >&2
    exit 2
    ;;
esac
