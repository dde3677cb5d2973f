#!/usr/bin/env bash
# Sets up the machine, builds the static release binary and runs `ztnode bench` (root).
# Extra arguments go to `ztnode bench` (e.g. --duration 5 --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
bin=$(./scripts/build-static.sh | tail -n 1)
exec "$bin" bench "$@"
