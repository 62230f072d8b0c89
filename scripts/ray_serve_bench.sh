#!/usr/bin/env bash
# aioengine.ray_serve on a local Ray cluster (`serve run` of a YAML config), beside one plain engine:
# - the multi-turn workload (`aioengine bench multi-turn`) through three Serve applications of 2 replicas
#   each: the prefix-aware router with its defaults, the same falling back to load only past 4 requests of
#   difference (`prefix4`, the local front's setting), and Serve's power of two choices alone (`pow2`),
#   alternated ROUNDS times;
# - `aioengine bench serve` at 16 and 64 clients through the prefix application and through one engine
#   (`aioengine serve`, all cores), alternated.
# The replicas share this machine's cores (each gets --num-threads 1).
# usage: scripts/ray_serve_bench.sh [RESULTS_DIR] [ROUNDS=3]
set -u
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0
out=${1:-ray-serve-bench}; rounds=${2:-3}; mkdir -p "$out"
port=8161; single=8162
flags="--max-model-len 2048 --num-kv-blocks 1024 --disable-log-stats --num-threads 1"  # 16k tokens: the runs hold 8k
app() {  # name, routing, router settings
  printf '  - name: %s\n    route_prefix: /%s\n    import_path: aioengine.ray_serve:app_builder\n' "$1" "$1"
  printf '    args: {engine_args: "%s", num_replicas: 2, replica_cpus: 0.33, routing: %s, router_kwargs: {%s}}\n' \
    "$flags" "$2" "${3:-}"
}
{
  printf 'http_options: {host: 127.0.0.1, port: %s}\napplications:\n' "$port"
  app prefix prefix; app prefix4 prefix "balance_abs: 4"; app pow2 pow2
} > "$out/config.yaml"
# A background job starts with SIGINT ignored, and then `serve run` would never stop on it: restore it.
env --default-signal=INT serve run "$out/config.yaml" > "$out/serve.log" 2>&1 &
serve_pid=$!
python -m aioengine serve --port "$single" --max-model-len 2048 --num-kv-blocks 1024 --disable-log-stats > "$out/single.log" 2>&1 &
single_pid=$!
up() { for _ in $(seq 1 300); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
for base in "http://127.0.0.1:$port/"{prefix,prefix4,pow2} "http://127.0.0.1:$single"; do
  up "$base" || { echo "$base never came up"; kill -INT $serve_pid; kill $single_pid; exit 1; }
done
turns=(--conversations "${CONVS:-31}" --turns "${TURNS:-6}" --output-len 16 --max-concurrency 16)
for r in $(seq 1 "$rounds"); do
  for name in prefix prefix4 pow2; do
    python -m aioengine bench multi-turn --base-url "http://127.0.0.1:$port/$name" "${turns[@]}" --seed "$r" \
      > "$out/multi-turn-$name-$r.txt" 2>&1
  done
done
for r in $(seq 1 2); do
  for c in 16 64; do
    for side in prefix single; do
      base="http://127.0.0.1:$port/prefix"; [ "$side" = single ] && base="http://127.0.0.1:$single"
      python -m aioengine bench serve --base-url "$base" --num-prompts $((4 * c)) --max-concurrency "$c" \
        --output-len 64 --ignore-eos --seed "$r" > "$out/serve-$side-$c-$r.txt" 2>&1
    done
  done
done
for name in prefix prefix4; do
  curl -s "http://127.0.0.1:$port/$name/metrics" | grep "^aioengine:router_decisions" > "$out/router-decisions-$name.txt"
done
kill -INT $serve_pid; kill -TERM $single_pid; wait
for name in prefix prefix4 pow2; do echo "$name:"; grep -h "Multi-turn" "$out"/multi-turn-$name-*.txt; done
grep -H "Serving:\|TTFT\|ITL" "$out"/serve-*.txt
grep -H . "$out"/router-decisions-*.txt
