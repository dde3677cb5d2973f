#!/usr/bin/env bash
# Builds the static release binary: x86_64-unknown-linux-musl (musl-gcc for ring and mimalloc),
# falling back to glibc with +crt-static. Prints the binary's path on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
if command -v musl-gcc >/dev/null 2>&1 && rustup target list --installed 2>/dev/null | grep -q x86_64-unknown-linux-musl; then
  if CC_x86_64_unknown_linux_musl=musl-gcc cargo build --release --locked --target x86_64-unknown-linux-musl >&2; then
    bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-musl/release/ztnode"
    # build.rs links with rust-lld and layout/symbol-order.txt (the code layout)
    if command -v readelf >/dev/null && ! readelf -p .comment "$bin" | grep -q LLD; then
      echo "build-static: not linked with rust-lld: the default code layout (more idle RSS)" >&2
    elif command -v nm >/dev/null && [ -f layout/symbol-order.txt ]; then
      listed="$(grep -vc '^#' layout/symbol-order.txt)"
      found="$(comm -12 <(grep -v '^#' layout/symbol-order.txt | sort -u) \
        <(nm -p --defined-only "$bin" | awk '{print $NF}' | sort -u) | wc -l)"
      if [ "$((found * 10))" -lt "$((listed * 9))" ]; then
        echo "build-static: this build has only $found of the $listed symbols layout/symbol-order.txt" \
          "orders (another toolchain, Cargo.lock or profile): run scripts/symbol-order.sh" >&2
      fi
    fi
    echo "$bin"
    exit 0
  fi
  echo "build-static: musl build failed, falling back to glibc +crt-static" >&2
fi
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --target x86_64-unknown-linux-gnu >&2
echo "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/ztnode"
