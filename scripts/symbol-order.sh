#!/usr/bin/env bash
# Regenerates layout/symbol-order.txt, the code layout of the release binary (build.rs links with
# it): the functions a running proxy executes first, then those of its start-up, each group in the
# order the linker had them. A development tool (root; valgrind, python3, nm, iproute2), not CI.
#
# How: the bench's split lab (`ztnode bench --peer`, held before measuring) runs `ztnode proxy`
# under callgrind in the node netns; one dump when both enrolled pods are served (start-up), then
# connections through the mesh (connect + 1 KiB echo + close, and one bulk transfer), a second dump
# (running). Usage: scripts/symbol-order.sh [CONNECTIONS]  (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
conns="${1:-30}"
prefix=zso
lab="/tmp/ztnode-lab-$prefix"
for tool in python3 nm callgrind_control ip; do
  command -v "$tool" >/dev/null || { echo "symbol-order: needs $tool (valgrind, binutils, iproute2)" >&2; exit 1; }
done
bin="$(./scripts/build-static.sh | tail -1)"
case "$bin" in
  */x86_64-unknown-linux-musl/*) ;;
  *) echo "symbol-order: the layout is for the musl release build; got $bin" >&2; exit 1 ;;
esac
work="$(mktemp -d)"
pids=()
cleanup() {
  set +e
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  pkill -f "$work/" 2>/dev/null
  sleep 1
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  pkill -9 -f "$work/" 2>/dev/null
  for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix-"); do ip netns del "$ns"; done
  rm -rf "$lab"
  if [ -n "${KEEP:-}" ]; then echo "symbol-order: kept $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
cp "$bin" "$work/ztnode"
bin="$work/ztnode"

# the peer is never started: the run ends during the hold of its first (ztnode) round
"$bin" bench --peer "$bin" --rounds 1 --hold 3600 --lab-prefix "$prefix" --json "$work/bench.json" \
  2>"$work/bench.log" &
pids+=($!)
for _ in $(seq 900); do grep -q "holding" "$work/bench.log" 2>/dev/null && break; sleep 0.2; done
pid="$(sed -n 's/.*ztnode pid \([0-9]*\).*/\1/p' "$work/bench.log" | head -1)"
[ -n "$pid" ] || { cat "$work/bench.log"; echo "symbol-order: the lab did not come up" >&2; exit 1; }
mapfile -d '' -t args <"/proc/$pid/cmdline"
uds="$(tr '\0' '\n' <"/proc/$pid/environ" | sed -n 's/^INPOD_UDS=//p')"
kill "$pid"
# (the bench, sleeping, does not reap it: gone or a zombie)
while [ -e "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; do sleep 0.1; done

serving() {
  for pod in m-client m-server; do
    ip netns exec "$prefix-$pod" ss -ltnH sport = :15008 | grep -q . || return 1
  done
}
INPOD_UDS="$uds" RUST_LOG=warn ip netns exec "$prefix-node" valgrind --tool=callgrind \
  --dump-instr=no --callgrind-out-file="$work/cg.out" "$bin" "${args[@]:1}" 2>"$work/valgrind.log" &
vg=$! # `ip netns exec` execs valgrind: the same process
pids+=("$vg")
dump() { # $1: the dump's number
  callgrind_control -d "$vg" >/dev/null
  for _ in $(seq 100); do [ -s "$work/cg.out.$1" ] && return; sleep 0.1; done
  echo "symbol-order: callgrind wrote no dump $1" >&2
  exit 1
}
for _ in $(seq 600); do serving && break; sleep 0.2; done
serving || { tail "$work/valgrind.log"; echo "symbol-order: the proxy did not serve" >&2; exit 1; }
sleep 3
dump 1 # start-up
server_ip="$(ip netns exec "$prefix-m-server" ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)"

ip netns exec "$prefix-m-server" python3 - <<'EOF' &
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen(128)
def echo(c):
    while (d := c.recv(65536)):
        c.sendall(d)
    c.close()
while True:
    c, _ = s.accept(); threading.Thread(target=echo, args=(c,), daemon=True).start()
EOF
pids+=($!)
sleep 1
ip netns exec "$prefix-m-client" python3 - "$server_ip" "$conns" <<'EOF'
import socket, sys
host, n = sys.argv[1], int(sys.argv[2])
def exchange(size):
    c = socket.create_connection((host, 9000), timeout=30)
    c.sendall(b"x" * size); c.shutdown(socket.SHUT_WR)
    got = 0
    while (d := c.recv(65536)):
        got += len(d)
    c.close()
    assert got == size, (got, size)
for _ in range(n):
    exchange(1024)
exchange(16 << 20)
EOF
sleep 1
dump 2 # running

python3 - "$work/cg.out.1" "$work/cg.out.2" "$bin" layout/symbol-order.txt <<'EOF'
import collections, hashlib, os, re, subprocess, sys
def executed(path):
    """Function names (demangled) callgrind saw executing, in first-seen order."""
    names, order, seen = {}, [], set()
    for line in open(path):
        # a name is given once, where its id first appears, which may be a callee line (cfn=)
        m = re.match(r"(c?)fn=\((\d+)\)(?: (.*))?", line)
        if m:
            callee, i, name = m.groups()
            if name:
                names[i] = name
            n = None if callee else names.get(i)
            if n and n not in seen:
                seen.add(n); order.append(n)
    return order
startup, running = executed(sys.argv[1]), executed(sys.argv[2])
nm = lambda *f: subprocess.run(["nm", "-p", *f, "-S", "--defined-only", sys.argv[3]],
                               capture_output=True, text=True, check=True).stdout.splitlines()
by_name = collections.defaultdict(list)
for raw, dem in zip(nm(), nm("-C")):
    r, d = raw.split(" ", 3), dem.split(" ", 3)
    if len(r) == 4 and r[2] in "tTwW":
        by_name[d[3]].append((int(r[0], 16), r[3]))
out, done = [], set()
for group in (running, startup):
    syms = sorted({s for n in group for s in by_name.get(n, []) if s[1] not in done})
    done.update(m for _, m in syms)
    out += [m for _, m in syms]
with open(sys.argv[4], "w") as f:
    f.write("# Code layout of the release binary (lld --symbol-ordering-file; build.rs), made by\n"
            "# scripts/symbol-order.sh: first the functions a running proxy executed (connections\n"
            "# through the mesh), then those of its start-up. Symbols another build no longer has\n"
            "# are skipped; regenerate after large changes. A new Cargo.lock or toolchain changes every\n"
            "# symbol hash: tests/layout.rs checks the Cargo.lock line below against the checkout.\n")
    lock = hashlib.sha256(open("Cargo.lock", "rb").read()).hexdigest()
    rustc = subprocess.run([os.environ.get("RUSTC", "rustc"), "-V"], capture_output=True, text=True, check=True).stdout.strip()
    f.write(f"# Cargo.lock sha256: {lock}\n# toolchain: {rustc}\n")
    f.write("\n".join(out) + "\n")
print(f"symbol-order: {len(out)} symbols ({len(running)} running, {len(startup)} start-up functions)")
EOF
