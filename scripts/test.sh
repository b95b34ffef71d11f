#!/usr/bin/env bash
# Create/use .venv, install agentbolt with its test dependencies, then run the test suite.
#   bash scripts/test.sh           # tests
#   bash scripts/test.sh --lint    # ruff (lint + format check) and mypy first, then tests
set -euo pipefail
cd "$(dirname "$0")/.."
# the tests also need the scale-out extras (a real local Ray cluster, the Kubernetes client)
source scripts/install.sh test,ray,kubernetes,envs
if [ "${1:-}" = "--lint" ]; then
  shift
  .venv/bin/ruff check agentbolt tests benchmarks examples
  .venv/bin/ruff format --check agentbolt tests benchmarks examples
  .venv/bin/mypy agentbolt
fi
# one string-hash seed: reasoning-gym's generators then draw in-process the items every other
# process draws (agentbolt/tasks/reasoning_gym.py), not in a child interpreter per draw
export PYTHONHASHSEED=0
# 4 workers on 2 cores: most of the suite waits on servers, subprocesses and sockets; a
# worker that runs out of tests takes some of a busy one's (worksteal), so no long tail
exec .venv/bin/python -m pytest -q -n 4 --dist worksteal "$@"
