#!/usr/bin/env bash
# The ITL-aware token budget against the token budget alone: `bench serve` (the shared workload: 64-256 token
# prompts, 64 output tokens, temperature 0) at 4, 16 and 64 clients, each against a fresh `aioengine serve`
# (the default model; a warm one would serve the prompts from its prefix cache), without a target and with
# --target-itl-ms TARGET (or --target-itl-ratio R for a TARGET written rR, e.g. r1.3), alternated ROUNDS times.
# usage: scripts/itl_target.sh TARGET_MS|rRATIO [RESULTS_DIR] [ROUNDS=2]
set -u
cd "$(dirname "$0")/.."
target=$1; out=${2:-itl-target}; rounds=${3:-2}; mkdir -p "$out"
wait_up() { for _ in $(seq 1 180); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
for r in $(seq 1 "$rounds"); do
  for c in 4 16 64; do
    for tag in none "$target"; do
      args=()
      case $tag in none) ;; r*) args=(--target-itl-ratio "${tag#r}") ;; *) args=(--target-itl-ms "$tag") ;; esac
      python -m aioengine serve --port 8150 --disable-log-stats "${args[@]}" > "$out/server-c$c-$tag-$r.log" 2>&1 &
      pid=$!; wait_up 8150
      n=$(( c > 16 ? 4 * c : 64 ))
      python -m aioengine bench serve --base-url http://127.0.0.1:8150 --max-concurrency $c --num-prompts $n \
        --output-len 64 --temperature 0 --save-result "$out/c$c-$tag-$r.json" --save-detailed \
        > "$out/c$c-$tag-$r.txt" 2>&1
      kill $pid; wait $pid 2>/dev/null
    done
  done
done
grep -H -E "Serving|ITL|TTFT" "$out"/c*.txt
