#!/usr/bin/env bash
# The Python package's tests (pytest) against a real `confed serve` they start: the binary
# CONFED_BIN names, default the debug build `cargo test` leaves. Installs the package and its test
# dependencies with pip when they are missing (into the system Python where it is externally
# managed: a throwaway CI machine; use a virtualenv elsewhere).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export CONFED_BIN=${CONFED_BIN:-$here/../../target/debug/confed}
if ! python3 -c 'import confed_client, pytest, matplotlib, tqdm' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "${here}[test]" >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "${here}[test]" >&2
fi
cd "$here"
python3 -m pytest -q -p no:cacheprovider tests
