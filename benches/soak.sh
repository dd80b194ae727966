#!/usr/bin/env bash
# Soak: `confed serve` (release build) under continuous honest load for MINUTES (default 30),
# with retention at RETENTION_MINUTES (default 2) so it applies within the run. Every 30 s it
# samples the server's RSS, open files, the data directory's size and, within it, the SQLite
# database's and WAL's, the contribution log's and the blob directory's, and the rounds released;
# prints a CSV and a summary. All three should level off once retention applies.
#
#   cargo build --release && benches/soak.sh [MINUTES] [RETENTION_MINUTES]
set -euo pipefail
minutes=${1:-30}
retention=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
bin=${CONFED_BIN:-$here/target/release/confed}
dir=$(mktemp -d)
out=${SOAK_CSV:-$dir/soak.csv}
RUST_LOG=warn,confed::retention=info "$bin" serve --listen 127.0.0.1:18383 --data-dir "$dir/data" \
    --retention-minutes "$retention" >"$dir/server.out" 2>"$dir/server.err" &
server=$!
url=
cleanup() {
    # The load loop and the simulator it is running, then the server.
    [[ -n "${load:-}" ]] && pkill -P "$load" 2>/dev/null
    kill "${load:-}" "$server" 2>/dev/null || true
    pkill -f "devices simulate --server $url" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 1 300); do
    grep -q '^confed: serving on ' "$dir/server.out" 2>/dev/null && break
    sleep 0.1
done
url=$(sed -n 's/^confed: serving on //p' "$dir/server.out")
token=$(sed -n 's/^CONFED_DEMO_TOKEN=//p' "$dir/server.out")
trust=$(sed -n 's/.*Device trust file: //p' "$dir/server.out")
"$bin" devices init-model --out "$dir/model.safetensors" >/dev/null
task=$(python3 - "$url" "$token" "$dir/model.safetensors" <<'PY'
import json, sys, urllib.request
url, token, model = sys.argv[1:]
def call(method, path, body, content_type):
    request = urllib.request.Request(url + path, data=body, method=method)
    request.add_header("Authorization", "Bearer " + token)
    request.add_header("Content-Type", content_type)
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())
task = call("POST", "/v1/tasks", json.dumps({"population": "soak", "rounds": 10000,
    "report_goal": 1000, "min_reports": 1,
    # A 16 KB random update takes a simulated device no time: 1 s a round keeps 10,000 rounds
    # within the demo tenant's compute budget (60 s, the default, was refused).
    "device_seconds_per_round": 1,
    "privacy": {"epsilon": 100.0, "delta": 1e-6, "clip_norm": 1.0}}).encode(), "application/json")["id"]
call("PUT", f"/v1/tasks/{task}/model", open(model, "rb").read(), "application/octet-stream")
print(task)
PY
)
# Honest devices, batch after batch, until the end.
(
    seed=1
    while true; do
        "$bin" devices simulate --server "$url" --population soak --devices 20000 \
            --concurrency 16 --trust "$trust" --no-train --seed "$seed" --forgetful \
            --max-retry-wait-ms 50 --idle-limit 1000 --settle-ms 0 >/dev/null 2>&1 || true
        seed=$((seed + 1))
    done
) &
load=$!
echo "minute,rss_mb,open_files,data_dir_mb,wal_mb,db_mb,contributions_mb,blobs_mb,rounds_released" | tee "$out"
end=$(($(date +%s) + minutes * 60))
start=$(date +%s)
while (($(date +%s) < end)); do
    sleep 30
    rss=$(awk '/^VmRSS:/ { printf "%.0f", $2 / 1024 }' "/proc/$server/status")
    fds=$(find "/proc/$server/fd" -mindepth 1 -maxdepth 1 | wc -l)
    disk=$(du -sm "$dir/data" | cut -f1)
    wal=$(($(stat -c %s "$dir/data/confed.db-wal" 2>/dev/null || echo 0) / 1048576))
    db=$(($(stat -c %s "$dir/data/confed.db" 2>/dev/null || echo 0) / 1048576))
    contributions=$(du -sm "$dir/data/contributions" 2>/dev/null | cut -f1)
    blobs=$(du -sm "$dir/data/blobs" 2>/dev/null | cut -f1)
    rounds=$(python3 -c "
import json, sys, urllib.request
r = urllib.request.Request('$url/v1/tasks/$task', headers={'Authorization': 'Bearer $token'})
print(json.loads(urllib.request.urlopen(r).read())['current_round'] - 1)")
    minute=$(awk -v s="$start" -v n="$(date +%s)" 'BEGIN { printf "%.1f", (n - s) / 60 }')
    echo "$minute,$rss,$fds,$disk,$wal,$db,$contributions,$blobs,$rounds" | tee -a "$out"
done
echo "segments at the end: $(find "$dir/data/contributions" -name 'segment-*' | wc -l)"
echo "retention passes that deleted rounds: $(grep -c 'retention deleted' "$dir/server.err" || true)"
