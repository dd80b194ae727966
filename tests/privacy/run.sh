#!/usr/bin/env bash
# The enclave's privacy accounting against an independent accountant (Google's dp-accounting from
# PyPI), its BLT optimizer and sensitivity against jax_privacy (test_blt.py), and analytics'
# noise and partition-selection thresholds against OpenDP and PyDP (test_analytics.py): runs
# `confed privacy plan|analytics|threshold` (the binary CONFED_BIN names, default the debug build `cargo test` leaves) over a
# grid of budgets. Installs the pinned Python packages with pip when missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
export CONFED_BIN=${CONFED_BIN:-$root/target/debug/confed}
# jax_privacy is BLT's reference (test_blt.py); its optimizer's output depends on jax and optax,
# so they are pinned with it.
packages=("dp-accounting==0.6.0" "jax-privacy==2.0.0" "jax==0.10.2" "jaxlib==0.10.2"
    "optax==0.2.8" "opendp==0.16.0" "python-dp==1.1.5" pytest)
if ! python3 -c 'import dp_accounting, jax_privacy, opendp, pydp, pytest' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "${packages[@]}" >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
            "${packages[@]}" >&2
fi
cd "$here"
python3 -m pytest -q -p no:cacheprovider "$@" .
