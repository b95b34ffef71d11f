#!/usr/bin/env bash
# DSPy's own virtualenv for benchmarks/apo_dspy_side.py (issue 39, item 4): DSPy and
# reasoning-gym only, no agentbolt, so neither side's dependencies constrain the other's.
# reasoning-gym is pinned to the version in .venv, so both sides score with the same scorer.
# Installed and tested with: dspy>=3.4.1, reasoning-gym==0.1.25 (same as .venv).
# Idempotent: an existing .venv-dspy with both packages is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-dspy
RG_VERSION=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("reasoning-gym"))')
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import dspy, reasoning_gym' 2>/dev/null; then
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "dspy>=3.4.1" "reasoning-gym==$RG_VERSION"
fi
"$VENV/bin/python" -c 'import importlib.metadata as m; print("dspy", m.version("dspy"), "reasoning-gym", m.version("reasoning-gym"))'
