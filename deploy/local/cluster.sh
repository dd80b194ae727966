#!/usr/bin/env bash
# The scale-out deployment on one machine, every part its own process:
#
#   PostgreSQL (task database)          deploy/local/postgres.sh, unless CONFED_DATABASE_URL is set
#   GCS emulator (blobs, contributions) deploy/local/gcs-emulator.sh, unless CONFED_GCS_ENDPOINT is set
#   5 key services (3-of-5)             confed keyservice, each with its own share, policy, audit log;
#                                       a release needs q = 4 of them, so releases survive one lost
#                                       key service (docs/operations.md, "Availability")
#   2 API replicas                      confed serve --role api
#   1 scheduler                         confed serve --role scheduler
#   2 enclave workers                   confed-enclave --attester dev (each on its own API replica)
#   1 token issuer                      confed issuer --attester dev (devices' Privacy Pass tokens)
#
# Every process serves /metrics, /healthz and /readyz (the scheduler and the workers on a
# listener of their own); DIR/env lists them as CONFED_METRICS_TARGETS (host:port, comma-separated).
#
#   deploy/local/cluster.sh start DIR   # start everything; prints the settings (also in DIR/env)
#   deploy/local/cluster.sh stop DIR    # stop everything it started
#
# Settings (environment): CONFED_BIN, CONFED_ENCLAVE_BIN (default: cargo build --release),
# CONFED_LOCAL_BASE_PORT (18080: APIs on BASE and BASE+1, the scheduler's probes on BASE+2, the
# workers' on BASE+3 and BASE+4, the issuer on BASE+5, key services on BASE+11..15),
# CONFED_LOCAL_PG_PORT (15442), CONFED_LOCAL_GCS_PORT (4453), CONFED_DATABASE_URL and
# CONFED_GCS_ENDPOINT to use running services instead of starting them.
#
# DEV ONLY: the workers use the dev attester, which the key services' copy of policies/dev.toml
# trusts; nothing here is confidential from whoever runs the machine. It says so in its output.
set -euo pipefail

usage="usage: cluster.sh start|stop DIR"
command=${1:?$usage}
dir=${2:?$usage}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

base=${CONFED_LOCAL_BASE_PORT:-18080}
pg_port=${CONFED_LOCAL_PG_PORT:-15442}
gcs_port=${CONFED_LOCAL_GCS_PORT:-4453}
# The key-service layout: t of n shares decrypt; a release needs q = max(t, ceil((n+t)/2)) = 4
# of the 5 (the release ledgers' quorum), so one key service may be lost and rounds still
# release, while two compromised ones can neither decrypt nor release a round twice.
keyservices=5
threshold=3

binaries() {
    if [[ -z "${CONFED_BIN:-}" || -z "${CONFED_ENCLAVE_BIN:-}" ]]; then
        (cd "$repo" && cargo build --release --quiet --bin confed --bin confed-enclave)
    fi
    confed=${CONFED_BIN:-$repo/target/release/confed}
    enclave=${CONFED_ENCLAVE_BIN:-$repo/target/release/confed-enclave}
}

# Starts a background process; its pid goes to DIR/pids/NAME.pid, its output to DIR/logs/NAME.log.
spawn() {
    local name=$1
    shift
    "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$dir/pids/$name.pid"
}

wait_http() {
    local url=$1 name=$2
    for _ in $(seq 1 300); do
        if curl -fsS "$url" >/dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$(cat "$dir/pids/$name.pid")" 2>/dev/null; then
            echo "cluster.sh: $name exited; see $dir/logs/$name.log" >&2
            tail -20 "$dir/logs/$name.log" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "cluster.sh: $name did not answer on $url; see $dir/logs/$name.log" >&2
    return 1
}

start() {
    mkdir -p "$dir"/{logs,pids,ceremony,policy,secrets}
    chmod 700 "$dir/secrets"
    binaries

    local database=${CONFED_DATABASE_URL:-}
    if [[ -z "$database" ]]; then
        chmod 755 "$dir"
        database=$("$here/postgres.sh" start "$dir/pg" "$pg_port")
        touch "$dir/started-postgres"
    fi
    local endpoint=${CONFED_GCS_ENDPOINT:-}
    if [[ -z "$endpoint" ]]; then
        endpoint=$("$here/gcs-emulator.sh" start "$dir/gcs" "$gcs_port")
        touch "$dir/started-emulator"
    fi
    local bucket
    bucket="confed-local-$(date +%s)-$$"
    "$here/gcs-emulator.sh" bucket "$endpoint" "$bucket"

    # Keys: a 3-of-5 ceremony; the dev attester's key and key set before the key services start.
    "$confed" keys generate --shares "$keyservices" --threshold "$threshold" --out "$dir/ceremony" >/dev/null
    "$confed" keys dev-attester --key "$dir/secrets/dev-attester.pem" >/dev/null
    cp "$repo/policies/dev.toml" "$dir/policy/dev.toml"
    cp "$dir/secrets/dev-attester.jwks.json" "$dir/policy/dev-attester.jwks.json"

    # Each key service witnesses the others' signed audit heads (rollback detection,
    # docs/attestation.md): its peers file names the others with their verifying keys.
    local verifying=()
    for i in $(seq 1 "$keyservices"); do
        verifying[i]=$("$confed" keyservice signing-key "$dir/secrets/ks$i-signing.pem")
    done
    for i in $(seq 1 "$keyservices"); do
        local entries=()
        for j in $(seq 1 "$keyservices"); do
            if [[ $j != "$i" ]]; then
                entries+=("{\"id\": \"ks$j\", \"url\": \"http://127.0.0.1:$((base + 10 + j))\", \"verifying_key\": \"${verifying[j]}\"}")
            fi
        done
        local joined
        joined=$(IFS=,; echo "${entries[*]}")
        echo "{\"peers\": [$joined]}" >"$dir/policy/peers-ks$i.json"
    done

    local keyservice_args=() enclave_keyservices=()
    for i in $(seq 1 "$keyservices"); do
        local port=$((base + 10 + i))
        local share
        share=$(ls "$dir"/ceremony/*-"$i".json)
        spawn "ks$i" "$confed" keyservice --id "ks$i" --listen "127.0.0.1:$port" \
            --share "$share" --policy "$dir/policy/dev.toml" --peers "$dir/policy/peers-ks$i.json" \
            --signing-key "$dir/secrets/ks$i-signing.pem" --audit-log "$dir/logs/audit-ks$i.jsonl" \
            --masking-key "$dir/secrets/ks$i-masking.key"
        keyservice_args+=(--keyservice "http://127.0.0.1:$port")
        enclave_keyservices+=(--keyservice "ks$i=http://127.0.0.1:$port")
    done
    for i in $(seq 1 "$keyservices"); do
        wait_http "http://127.0.0.1:$((base + 10 + i))/healthz" "ks$i"
    done

    # Shared secrets, from files only.
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/secrets/worker-token"
    chmod 600 "$dir/secrets/worker-token"
    "$confed" tenant create local --database "$database" >"$dir/secrets/tenant-token"
    chmod 600 "$dir/secrets/tenant-token"

    # Upload URLs are signed with the repository's test-only key: the emulator checks no signature.
    local common=(--database "$database" --blobs "gs://$bucket/confed" --gcs-endpoint "$endpoint"
        --gcs-signing-key-file "$repo/tests/fixtures/gcs-test-signer.json"
        "${keyservice_args[@]}")
    for i in 1 2; do
        spawn "api$i" "$confed" serve --role api --data-dir "$dir/api$i" \
            --listen "127.0.0.1:$((base + i - 1))" --worker-token-file "$dir/secrets/worker-token" \
            "${common[@]}"
    done
    spawn scheduler "$confed" serve --role scheduler --data-dir "$dir/scheduler" \
        --listen "127.0.0.1:$((base + 2))" --scheduler-period-seconds 1 "${common[@]}"
    for i in 1 2; do
        wait_http "http://127.0.0.1:$((base + i - 1))/healthz" "api$i"
    done
    for i in 1 2; do
        spawn "worker$i" "$enclave" --server "http://127.0.0.1:$((base + i - 1))" \
            --worker-token-file "$dir/secrets/worker-token" --threshold "$threshold" \
            "${enclave_keyservices[@]}" --attester dev --dev-key "$dir/secrets/dev-attester.pem" \
            --id "worker$i" --lease-seconds 30 --ops-listen "127.0.0.1:$((base + 2 + i))"
    done
    "$confed" issuer generate-key "$dir/secrets/issuer.pem" >/dev/null
    spawn issuer "$confed" issuer --name local-dev --signing-key "$dir/secrets/issuer.pem" \
        --state "$dir/issuer" --attester dev --listen "127.0.0.1:$((base + 5))"
    wait_http "http://127.0.0.1:$((base + 2))/healthz" scheduler
    for i in 1 2; do
        wait_http "http://127.0.0.1:$((base + 2 + i))/healthz" "worker$i"
    done
    wait_http "http://127.0.0.1:$((base + 5))/healthz" issuer
    local targets=()
    for port in $base $((base + 1)) $((base + 2)) $((base + 3)) $((base + 4)) $((base + 5)); do
        targets+=("127.0.0.1:$port")
    done
    for i in $(seq 1 "$keyservices"); do
        targets+=("127.0.0.1:$((base + 10 + i))")
    done

    "$confed" devices trust-config --threshold "$threshold" --max-epsilon 100 --max-delta 0.01 --min-reports 1 "${keyservice_args[@]}" >"$dir/trust.json"

    cat >"$dir/env" <<EOF
CONFED_API_URLS=http://127.0.0.1:$base,http://127.0.0.1:$((base + 1))
CONFED_DATABASE_URL=$database
CONFED_BLOBS=gs://$bucket/confed
CONFED_GCS_ENDPOINT=$endpoint
CONFED_TENANT_TOKEN_FILE=$dir/secrets/tenant-token
CONFED_ISSUER_URL=http://127.0.0.1:$((base + 5))
CONFED_TRUST_FILE=$dir/trust.json
CONFED_METRICS_TARGETS=$(IFS=,; echo "${targets[*]}")
EOF
    echo "cluster.sh: DEV ONLY (dev attester, emulator, trust authentication): nothing here is confidential" >&2
    cat "$dir/env"
}

stop() {
    if [[ -d "$dir/pids" ]]; then
        for pid_file in "$dir"/pids/*.pid; do
            [[ -e "$pid_file" ]] || continue
            kill "$(cat "$pid_file")" 2>/dev/null || true
            rm -f "$pid_file"
        done
    fi
    if [[ -e "$dir/started-postgres" ]]; then
        "$here/postgres.sh" stop "$dir/pg" || true
        rm -f "$dir/started-postgres"
    fi
    if [[ -e "$dir/started-emulator" ]]; then
        "$here/gcs-emulator.sh" stop "$dir/gcs" || true
        rm -f "$dir/started-emulator"
    fi
}

case "$command" in
start) start ;;
stop) stop ;;
*)
    echo "cluster.sh: unknown command $command (start|stop)" >&2
    exit 2
    ;;
esac
