#!/usr/bin/env bash
# The console's browser tests: a real headless Chromium (Debian's chromium and chromium-driver,
# installed with apt when missing) driven by Selenium, against a real `confed serve` (the binary
# CONFED_BIN names, default the debug build `cargo test` leaves). Python dependencies come from
# pip: Selenium and the confed-client package (which trains the task's rounds).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CONFED_BIN=${CONFED_BIN:-$root/target/debug/confed}
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
if ! python3 -c 'import confed_client, pytest, selenium' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "$root/clients/python[test]" selenium >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
            "$root/clients/python[test]" selenium >&2
fi
cd "$here"
python3 -m pytest -q -p no:cacheprovider .
