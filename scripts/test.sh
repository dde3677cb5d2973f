#!/usr/bin/env bash
# Runs every test (unit, in-process, and the privileged netns end-to-end tests). Root.
# Installs what the tests need first. Fails when any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo test --locked --no-fail-fast -- --test-threads=4
# Every fuzz target for a short bounded time on its corpus (scripts/fuzz.sh SECONDS for longer).
./scripts/fuzz.sh "${FUZZ_SECONDS:-10}"
