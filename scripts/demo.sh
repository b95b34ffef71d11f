#!/usr/bin/env bash
# Create/use .venv, install agentbolt, then run the main job: `agentbolt demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
exec .venv/bin/agentbolt demo "$@"
