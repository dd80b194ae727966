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
if ! python3 -c 'import confed_client, pytest, selenium, tqdm' 2>/dev/null; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "$root/clients/python[test]" selenium >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
            "$root/clients/python[test]" selenium >&2
fi
# axe-core, the accessibility engine, straight from the npm registry (no node needed): pinned and
# checked against the registry's published integrity digest.
axe_version=4.14.1
axe_sha512=FHfa+lmNjQZfJz1q8wKqIDwC6DExcHt/pkjNQb09a3NPjCKg2rhu5qb2S4r76ASyFNNtuFooJpZe37OgudVGtQ==
axe_dir=${XDG_CACHE_HOME:-$HOME/.cache}/confed/axe-core-$axe_version
if [[ ! -f "$axe_dir/axe.min.js" ]]; then
    mkdir -p "$axe_dir"
    python3 - "$axe_version" "$axe_sha512" "$axe_dir" <<'PY'
import base64, hashlib, io, sys, tarfile, urllib.request
version, digest, target = sys.argv[1:]
url = f"https://registry.npmjs.org/axe-core/-/axe-core-{version}.tgz"
data = urllib.request.urlopen(url, timeout=60).read()
got = base64.b64encode(hashlib.sha512(data).digest()).decode()
if got != digest:
    sys.exit(f"axe-core {version}: the download's digest is {got}, not {digest}")
with tarfile.open(fileobj=io.BytesIO(data)) as archive:
    script = archive.extractfile("package/axe.min.js").read()
open(f"{target}/axe.min.js", "wb").write(script)
PY
fi
export AXE_JS=$axe_dir/axe.min.js
# This checkout's confed_client, whatever version pip installed earlier.
export PYTHONPATH=$root/clients/python${PYTHONPATH:+:$PYTHONPATH}
cd "$here"
python3 -m pytest -q -p no:cacheprovider --durations=5 "$@" .
