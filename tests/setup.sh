#!/usr/bin/env bash
# Everything the tests need on a fresh Debian machine, each step doing nothing once its work is done. The
# README's test command and .ci/run both start here, so a newcomer's run checks what CI's checks.
# One line per step: a venv (or an engine's files) the tests need is one more `build` line (tests/test_setup.py
# reads them).
set -euo pipefail
cd "$(dirname "$0")/.."

# `system COMMAND PACKAGE`: the Debian package, unless COMMAND is already on PATH. Needs root (or sudo); where
# it cannot install, it says so and goes on - the tests that need it then skip, and the run's last line says
# which (under CI=true it stops here instead).
system() {
    command -v "$1" >/dev/null 2>&1 && return
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=$(command -v sudo || true)
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; }; then
        $sudo apt-get update -qq
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2"
    elif [ "${CI:-}" = "true" ]; then
        echo "tests/setup.sh: cannot install $2 (no apt-get, or neither root nor sudo)" >&2 && exit 1
    else
        echo "tests/setup.sh: $1 not installed and cannot install $2 here; the tests that need it will skip" >&2
    fi
}

# `build MODULE DIR`: a venv some tests run in, built by MODULE (`python -m MODULE build DIR`, which returns at
# once when DIR is built already).
build() { python -m "$1" build "$2"; }

system prometheus prometheus         # a real Prometheus scrapes the gateway; promtool (same package) checks deploy/
system systemd-analyze systemd       # verifies deploy/'s systemd units
system redis-server redis-server     # a real Redis: the cluster tests and proxybench's crossover-redis target
python -m pip install -e '.[test]'
build crossover.servers.sglang_check .venv-sglang         # SGLang 0.5.23's own parser checks every profile's argv
build tests.real_sglang.engine_env .venv-sglang-serve     # real SGLang 0.5.23 on CPU for tests/real_sglang/
build tests.uvicorn_floor .venv-uvicorn-floor             # uvicorn at pyproject's floor: the client protocol's internals
build tests.real_vllm.engine_env .venv-vllm                # real vLLM 0.32.0 on CPU (EAGLE-3) for tests/real_vllm/
build tests.servers.vllm_release_source .vllm-0.34.0       # vLLM 0.34.0's files (no CPU build): its patch series, facts
