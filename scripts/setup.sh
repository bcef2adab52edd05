#!/usr/bin/env bash
# Installs everything Sightline needs on a fresh machine, and nothing twice:
# a virtual environment (.venv) with the project and its test tools, the CPU build
# of torch when there is no CUDA, and Debian's Prometheus, Alertmanager and Chromium
# when they are missing; then compiles the collector's byte walks into numba's cache.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SIGHTLINE_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.sightline-installed"

apt_install() {
    # $@: "command:package" pairs; installs the packages whose command is missing.
    local missing=()
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 && continue
        # one package may bring several missing commands: name it once
        [[ " ${missing[*]} " == *" ${pair##*:} "* ]] || missing+=("${pair##*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
        echo "setup: please install Debian packages: ${missing[*]}" >&2
        return 1
    fi
    local SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
    echo "setup: installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    # Packaged services must not start themselves: the tests start their own.
    DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

apt_install prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
    amtool:prometheus-alertmanager chromium:chromium

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PY" -m venv "$VENV"
fi
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -qq --disable-pip-version-check --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No CUDA here: the CPU build of torch, not a multi-GB CUDA one.
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check "torch==2.13.0"
fi
extras="engine,dashboards,test"
command -v nvidia-smi >/dev/null 2>&1 && extras="$extras,gpu"
"$VENV/bin/python" -m pip install -qq --disable-pip-version-check -e ".[$extras]"
# The collector's byte walks compiled into numba's cache now, not at the first start
# (a collector on a cold cache serves at once but is not ready until it has compiled them).
"$VENV/bin/sightline" collector warm || echo "setup: 'sightline collector warm' failed; the collector will compile on start" >&2
echo "$want" > "$STAMP"
echo "setup: done ($VENV)"
