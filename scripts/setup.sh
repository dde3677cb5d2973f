#!/usr/bin/env bash
# Installs what ztnode's build, demo and tests need on a Debian-like machine. Idempotent; run as root.
#   OS packages: iproute2, nftables, iptables, tcpdump, iperf3, file, the reference CNI plugins
#   (containernetworking-plugins: bridge, host-local), musl-tools (musl-gcc for the static build).
#   kubectl (tests/deploy.rs renders deploy/ with `kubectl kustomize`): the `kubectl` package this
#   machine kind ships with, not Debian's kubernetes-client (1.20, whose kustomize predates the
#   syntax deploy/ uses).
#   Python: grpcio, grpcio-tools, protobuf, cryptography, pyyaml (the fake istiod of the xDS/CA tests).
#   Rust: the x86_64-unknown-linux-musl target; the nightly toolchain and cargo-fuzz (fuzz targets).
set -euo pipefail
pkgs=(iproute2 nftables iptables tcpdump iperf3 file containernetworking-plugins musl-tools ca-certificates)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v kubectl >/dev/null 2>&1; then
  echo "setup: installing kubectl"
  # Not fatal here: the other tests need no kubectl, and tests/deploy.rs fails under CI without it.
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null; } \
    || echo "setup: could not install the kubectl package; tests/deploy.rs will fail under CI" >&2
fi
# The fake istiod (../shared/tools/fake-istiod, started by the xDS/CA tests) is Python + grpcio.
if ! python3 -c 'import grpc, grpc_tools, google.protobuf, cryptography, yaml' 2>/dev/null; then
  echo "setup: installing the fake istiod's Python packages"
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    grpcio grpcio-tools protobuf cryptography pyyaml
fi
if command -v rustup >/dev/null 2>&1; then
  rustup target list --installed | grep -q x86_64-unknown-linux-musl || rustup target add x86_64-unknown-linux-musl
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: no Rust toolchain on PATH: install rustup (Rust >= 1.90); under sudo keep your PATH: sudo env \"PATH=\$PATH\" $0" >&2
  exit 1
fi
# The fuzz targets (scripts/fuzz.sh, run briefly by scripts/test.sh) need nightly and cargo-fuzz.
if command -v rustup >/dev/null 2>&1 && ! rustup toolchain list | grep -q '^nightly'; then
  rustup toolchain install nightly --profile minimal
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "setup: installing cargo-fuzz"
  cargo +nightly install cargo-fuzz --locked --quiet
fi
echo "setup: ok"
