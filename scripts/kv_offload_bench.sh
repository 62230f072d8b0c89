#!/usr/bin/env bash
# The multi-turn workload (`aioengine bench multi-turn`) on a KV pool about a quarter of its contexts, against
# a fresh server per run: no offload, the host tier, the host tier with the disk tier (a small host tier, a new
# empty folder), and that disk server restarted on the folder it filled (the same workload again). The four
# alternate ROUNDS times; each round takes a new seed.
# usage: scripts/kv_offload_bench.sh [RESULTS_DIR] [ROUNDS=2] [aioengine serve flags]
set -u
cd "$(dirname "$0")/.."
out=${1:-kv-offload-bench}; rounds=${2:-2}; shift $(($# < 2 ? $# : 2)); mkdir -p "$out"
pool=${POOL_BLOCKS:-161}
bench=(--conversations "${CONVS:-32}" --turns "${TURNS:-6}" --output-len 32 --max-concurrency "${CONC:-8}")
wait_up() { for _ in $(seq 1 180); do curl -sf http://127.0.0.1:8151/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
run() {  # name, seed, serve flags...
  local name=$1 seed=$2; shift 2
  python -m aioengine serve --port 8151 --max-model-len 2048 --num-kv-blocks "$pool" --disable-log-stats "$@" \
    > "$out/$name-server.log" 2>&1 &
  local pid=$!
  wait_up || { kill $pid; return 1; }
  python -m aioengine bench multi-turn --base-url http://127.0.0.1:8151 "${bench[@]}" --seed "$seed" \
    > "$out/$name.txt" 2>&1
  kill -TERM $pid; wait $pid
}
for r in $(seq 1 "$rounds"); do
  dir=$(mktemp -d)
  run "none-$r" "$r" "$@"
  run "host-$r" "$r" --kv-offload-size 1 "$@"
  run "disk-$r" "$r" --kv-offload-size "${DISK_HOST_GIB:-0.02}" --kv-offload-dir "$dir" "$@"
  run "restart-$r" "$r" --kv-offload-size "${DISK_HOST_GIB:-0.02}" --kv-offload-dir "$dir" "$@"
  du -sh "$dir" > "$out/disk-$r-size.txt"; rm -rf "$dir"
done
for side in none host disk restart; do
  echo "$side:"; for r in $(seq 1 "$rounds"); do grep -h "Multi-turn" "$out/$side-$r.txt"; done
done
