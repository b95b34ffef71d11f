#!/usr/bin/env bash
# Create/use .venv, install agentbolt with its test dependencies, then run the test suite.
#   bash scripts/test.sh           # tests
#   bash scripts/test.sh --lint    # ruff (lint + format check) and mypy first, then tests
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh test
if [ "${1:-}" = "--lint" ]; then
  shift
  .venv/bin/ruff check agentbolt tests benchmarks examples
  .venv/bin/ruff format --check agentbolt tests benchmarks examples
  .venv/bin/mypy agentbolt
fi
exec .venv/bin/python -m pytest -q "$@"
