#!/usr/bin/env bash
# The enclave's privacy accounting against an independent accountant (Google's dp-accounting from
# PyPI): runs `confed privacy plan` (the binary CONFED_BIN names, default the debug build `cargo
# test` leaves) over a grid of budgets. Installs dp-accounting and pytest with pip when missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CONFED_BIN=${CONFED_BIN:-$root/target/debug/confed}
if ! python3 -c 'import dp_accounting, pytest' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "dp-accounting==0.6.0" pytest >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
            "dp-accounting==0.6.0" pytest >&2
fi
cd "$here"
python3 -m pytest -q -p no:cacheprovider "$@" .
