#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each on its corpus, seeded from
# fuzz/seeds/<target> and, read in place, the matching test data of ../shared/testdata. Needs the
# nightly toolchain and cargo-fuzz (scripts/setup.sh installs cargo-fuzz). Fails on the first
# crash (libFuzzer writes the input to fuzz/artifacts/<target>/); prints executions per target.
#
#   scripts/fuzz.sh 600            # 10 minutes per target
#   scripts/fuzz.sh 20 tls_record  # one target
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}"
shift
shared="$(cd .. && pwd)/shared/testdata"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(ls fuzz/fuzz_targets | sed 's/\.rs$//')
fi
# Extra seed dirs (read only: new inputs go to the first corpus dir).
extra_seeds() {
    case "$1" in
        cni_conf) echo "$shared/real-conflists $shared/istio-install" ;;
        local_config) echo "$shared/ztunnel" ;;
    esac
}
if ! cargo +nightly fuzz build --sanitizer none >fuzz/build.log 2>&1; then
    tail -n 40 fuzz/build.log >&2
    echo "fuzz: build failed" >&2
    exit 1
fi
summary=()
for t in "${targets[@]}"; do
    corpus="fuzz/corpus/$t"
    mkdir -p "$corpus" "fuzz/artifacts/$t"
    dirs=("$corpus" "fuzz/seeds/$t")
    for d in $(extra_seeds "$t"); do
        [ -d "$d" ] && dirs+=("$d")
    done
    log="fuzz/artifacts/$t/last-run.log"
    echo "fuzz: $t for ${seconds}s" >&2
    if ! cargo +nightly fuzz run --sanitizer none "$t" "${dirs[@]}" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzz: $t FAILED (input in fuzz/artifacts/$t/)" >&2
        exit 1
    fi
    execs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    summary+=("$t: $execs executions in ${seconds}s")
done
printf 'fuzz: %s\n' "${summary[@]}"
