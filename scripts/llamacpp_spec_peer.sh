#!/usr/bin/env bash
# Alternate llama-server (n-gram speculation off, on) and aioengine serve (off, on) at 1 client on the grounded
# set, two rounds. usage: LLAMA_SERVER=path/to/llama-server scripts/llamacpp_spec_peer.sh [RESULTS_DIR]
set -u
cd "$(dirname "$0")/.."
GGUF=${GGUF:-$(python -c "from aioengine.model.files import default_gguf_path; print(default_gguf_path())")}
LS=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}
out=${1:-peer-results}; mkdir -p "$out"
bench() { python -m aioengine bench serve --base-url http://127.0.0.1:$1 --served-model $2 --tokenizer default --dataset grounded \
  --num-prompts 4 --output-len 96 --temperature 0 --ignore-eos --max-concurrency 1 --save-result $out/$3.json > $out/$3.txt 2>&1; }
wait_up() { for _ in $(seq 1 120); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
run_llama() {  # $1 tag, rest: extra args
  local tag=$1; shift
  $LS -m $GGUF -t 2 -np 1 -c 4096 --port 8131 --alias default "$@" > $out/$tag-server.log 2>&1 &
  local pid=$!; wait_up 8131 && bench 8131 default $tag; kill $pid; wait $pid 2>/dev/null
}
run_aio() {
  local tag=$1; shift
  python -m aioengine serve --port 8132 --disable-log-stats "$@" > $out/$tag-server.log 2>&1 &
  local pid=$!; wait_up 8132 && bench 8132 default $tag; kill $pid; wait $pid 2>/dev/null
}
SPEC='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
for r in 1 2; do
  run_llama llama-off-$r
  run_llama llama-on-$r --spec-type ngram-simple --spec-draft-n-max 3
  run_aio aio-off-$r
  run_aio aio-on-$r --speculative-config "$SPEC"
done
grep -H -E "Output token throughput|TPOT|output tok" $out/*.txt
