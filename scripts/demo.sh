#!/usr/bin/env bash
# Sets up this machine (packages, musl target), builds the static binary and runs `ztnode demo`. Root.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
bin=$(./scripts/build-static.sh | tail -n 1)
echo "demo: using $bin ($(stat -c %s "$bin") bytes)"
exec "$bin" demo "$@"
