#!/usr/bin/env bash
# schemathesis --checks all against /v1/openapi.json of a fresh `confed serve`, with a task (and
# its model) and an assignment created first, so routes with ids reach their handlers. Needs the
# confed binary (CONFED_BIN, default the debug build `cargo test` leaves) and schemathesis
# (installed with pip when missing).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${CONFED_BIN:-$here/../../target/debug/confed}
# As deploy/local/gcs-emulator.sh does: pip (installed where missing), into the system Python
# where it is externally managed (a throwaway CI machine).
if ! python3 -c 'import schemathesis' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check 'schemathesis==4.32.5' >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages 'schemathesis==4.32.5' >&2
fi
dir=$(mktemp -d)
port=${CONFED_SCHEMATHESIS_PORT:-18181}
CONFED_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
export CONFED_ADMIN_TOKEN
RUST_LOG=warn "$bin" serve --listen "127.0.0.1:$port" --data-dir "$dir/data" >"$dir/out" 2>"$dir/err" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 300); do
    grep -q '^confed: serving on ' "$dir/out" 2>/dev/null && break
    sleep 0.1
done
grep -q '^confed: serving on ' "$dir/out" || { cat "$dir/err"; echo "confed did not start" >&2; exit 1; }
export CONFED_URL="http://127.0.0.1:$port"
CONFED_TOKEN=$(sed -n 's/^CONFED_DEMO_TOKEN=//p' "$dir/out")
export CONFED_TOKEN
"$bin" devices init-model --out "$dir/model.safetensors" >/dev/null
eval "$(python3 - "$dir/model.safetensors" <<'PY'
import json, sys, urllib.request, os
base, token = os.environ["CONFED_URL"], os.environ["CONFED_TOKEN"]
def call(method, path, body=None, content_type="application/json", auth=True):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    if auth:
        request.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read() or b"{}")
task = call("POST", "/v1/tasks", {"population": "schemathesis", "rounds": 3, "report_goal": 10,
    "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0}})["id"]
call("PUT", f"/v1/tasks/{task}/model", open(sys.argv[1], "rb").read(), "application/octet-stream")
assignment = call("POST", "/v1/populations/schemathesis/checkin", {"client_version": "1.0"},
    auth=False)["assignment_id"]
print(f"export CONFED_TASK={task} CONFED_ASSIGNMENT={assignment}")
PY
)"
cd "$here"
PYTHONPATH="$here" python3 -m schemathesis.cli run "$CONFED_URL/v1/openapi.json" --checks all --seed 1 --no-color "$@"
