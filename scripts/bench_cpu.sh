#!/usr/bin/env bash
# The CPU benchmarks of docs/benchmarks.md, with the Hugging Face peer in the same run.
# usage: scripts/bench_cpu.sh [RESULTS_DIR]   (needs ../shared/bench/hf_peer.py beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
mkdir -p "$out"
model_dir=$(python -c "from aioengine.model.files import resolve_model; print(resolve_model('default'))")
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee "$out/machine.txt"
aioengine bench scheduler | tee "$out/sched.txt"
python -m aioengine bench throughput --num-prompts 64 --output-len 128 --no-progress \
    --output-json "$out/throughput.json" | tee "$out/throughput.txt"
python -m aioengine bench latency --batch-size 1 --output-len 128 --num-iters 3 \
    --output-json "$out/latency.json" | tee "$out/latency.txt"
python -m aioengine bench latency --batch-size 1 --output-len 128 --num-iters 3 --quantization int4 \
    --output-json "$out/latency_int4.json" | tee "$out/latency_int4.txt"
python ../shared/bench/hf_peer.py "$model_dir" cb 64 128 | tee "$out/hf_cb.txt"
