#!/usr/bin/env bash
# Alternate two commits on this machine: offline throughput, batch-1 latency and 16-client serving, N rounds
# each, then print every figure and the medians. Each commit runs from its own git worktree.
# usage: scripts/ab_bench.sh BEFORE_REF AFTER_REF [ROUNDS=3] [RESULTS_DIR=ab-results] [MORE_REFS...]
# MORE_REFS: further commits, alternated after these two in each round (named ref3, ref4, ...).
# AB_PROMPTS / AB_OUTPUT_LEN (default 64 / 128, the issue's workload) shrink the workload on a slow machine.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 rounds=${3:-3} out=${4:-ab-results}
sides=(before after)
shift $(( $# < 4 ? $# : 4 ))
i=3
for ref in "$@"; do
    declare "ref$i=$ref"
    sides+=("ref$i")
    i=$((i + 1))
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
trees=$(mktemp -d)
trap 'for t in "$trees"/*; do git worktree remove --force "$t" 2>/dev/null || true; done; rm -rf "$trees"' EXIT
for side in "${sides[@]}"; do
    ref=${!side}
    git worktree add --detach -q "$trees/$side" "$ref"
done
port=8123
prompts=${AB_PROMPTS:-64} outlen=${AB_OUTPUT_LEN:-128}

run_side() {  # $1 side, $2 round: three benches, JSON under $out
    local side=$1 round=$2 tree="$trees/$1"
    local tag="$out/$side-$round"
    (cd "$tree" && PYTHONPATH="$tree" python -c "import aioengine; assert aioengine.__file__.startswith('$tree')")
    (cd "$tree" && PYTHONPATH="$tree" python -m aioengine bench throughput --num-prompts "$prompts" --output-len "$outlen" \
        --no-progress --output-json "$tag-throughput.json" >/dev/null)
    (cd "$tree" && PYTHONPATH="$tree" python -m aioengine bench latency --batch-size 1 \
        --output-len "$outlen" --output-json "$tag-latency.json" >/dev/null)
    (cd "$tree" && PYTHONPATH="$tree" exec python -m aioengine serve --port $port --disable-log-stats \
        >"$tag-server.log" 2>&1) &
    local pid=$!
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.5
    done
    (cd "$tree" && PYTHONPATH="$tree" python -m aioengine bench serve --base-url "http://127.0.0.1:$port" \
        --max-concurrency 16 --num-prompts "$prompts" --output-len "$outlen" --temperature 0 --ignore-eos \
        --save-result "$tag-serve.json" >/dev/null)
    kill -INT $pid
    wait $pid || true
}

for round in $(seq 1 "$rounds"); do
    for side in "${sides[@]}"; do
        echo "round $round: $side (${!side})" >&2
        run_side "$side" "$round"
    done
done

python - "$out" "$rounds" "${sides[@]}" <<'EOF'
import json, statistics, sys
out, rounds, sides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
keys = {"throughput": "output_tokens_per_s", "latency": "decode_step_ms_median", "serve": "output_tokens_per_s"}
for bench, key in keys.items():
    for side in sides:
        vals = []
        for r in range(1, rounds + 1):
            with open(f"{out}/{side}-{r}-{bench}.json") as f:
                vals.append(json.load(f)[key])
        print(f"{bench:10s} {key:24s} {side:6s} " + " ".join(f"{v:9.2f}" for v in vals)
              + f"   median {statistics.median(vals):9.2f}")
EOF
