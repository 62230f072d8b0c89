#!/usr/bin/env bash
# The GPU proof of issue #6, in under 8 minutes, using no network (carried wheels aside, below):
#   1. the GPU tests (pytest -m gpu: kernels vs references, layer dispatch, CUDA events, graphs, parity),
#   2. `aioengine bench throughput` on random:llama-3.1-8b (random bf16 weights made on the device),
#      1000 sharegpt-like prompts (input mean ~220, output mean ~200, ignore_eos),
#   3. transformers' continuous batching on the first 200 of those prompts (same run, same GPU, after 2),
#      stopped after GPU_CHECK_PEER_LIMIT_S seconds with the tokens made by then,
#   4. results.json: output tok/s, mean TTFT/TPOT, GPU idle between steps, and the ratio to transformers.
# Each stage has a time budget; a stage stopped by it dumps its stacks and the next stage still runs.
# usage: scripts/gpu_check.sh RESULTS_DIR      (needs torch, triton, transformers, uvloop, aiohttp, orjson,
#                                              gguf; cuda-python for the host-function wait, else it polls)
# The device image lacks orjson and gguf: wheels found in .whl/ (carried; no network there) go on the path:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl orjson gguf psutil; pip download --no-deps -d .whl peft accelerate  # the LoRA test
# Stage budgets and extra runs: the GPU_CHECK_* variables below. What the H200 gave: docs/benchmarks.md.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
cd "$ROOT"
PY=${PYTHON:-python3}  # the GPU images' python3 holds torch; plain `python` may not exist
if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl &&
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
export PYTHONFAULTHANDLER=1  # a stage stopped by its time limit (SIGABRT) prints every thread's stack
TOTAL_S=${GPU_CHECK_TOTAL_S:-470}  # the whole script stays under 8 minutes
TESTS_S=${GPU_CHECK_TESTS_S:-200}  # the parity tests start an engine per case (graphs, drafts)
BENCH_S=${GPU_CHECK_BENCH_S:-100}      # each run of the bench: engine start, graph capture and 1000 prompts
CAPTURE_S=${GPU_CHECK_CAPTURE_S:-90}   # --cuda-graph-capture-timeout-s of each bench run (sizes not reached run eagerly)
REPEATS=${GPU_CHECK_REPEATS:-2}        # runs of the default engine (the report takes their median)
AB_FLAGS=${GPU_CHECK_AB_FLAGS:-}       # one more run with these engine flags, e.g. "--max-cudagraph-capture-size 1024"
PEER_S=${GPU_CHECK_PEER_S:-180}
PEER_LIMIT_S=${GPU_CHECK_PEER_LIMIT_S:-120}  # transformers' paged SDPA is slow: count what it made by then
T0=$SECONDS
left() { echo $(( TOTAL_S - (SECONDS - T0) )); }
budget() { local l; l=$(left); (( $1 < l )) && echo "$1" || echo $(( l > 10 ? l : 10 )); }

echo "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for m in ("triton", "transformers", "uvloop", "aiohttp", "orjson", "gguf"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "MISSING", e)
try:
    from cuda.bindings import runtime  # noqa: F401
    print("cuda-python: cuda.bindings.runtime ok")
except Exception as e:
    print("cuda-python: not usable (steps will poll CUDA events):", e)
EOF

rc_of() { echo "$1 $2" >> "$OUT/rc.txt"; }
: > "$OUT/rc.txt"

echo "== 1. GPU tests (budget $(budget "$TESTS_S") s)"
timeout -k 10 "$(budget "$TESTS_S")" "$PY" -m pytest -q -m gpu tests/kernels tests/gpu tests/engine/test_cuda_parity.py tests/engine/test_lora.py \
    -p no:cacheprovider --timeout 90 --durations 10 --junitxml "$OUT/gpu_tests.xml"
rc_of gpu_tests $?

bench() {  # bench NAME [ENGINE FLAGS...]
    local name=$1; shift
    echo "== 2. aioengine bench throughput ($name $*), random:llama-3.1-8b, 1000 sharegpt-like prompts" \
         "(budget $(budget "$BENCH_S") s)"
    timeout -s ABRT -k 10 "$(budget "$BENCH_S")" "$PY" -m aioengine bench throughput --model random:llama-3.1-8b \
        --device cuda --dataset sharegpt --num-prompts 1000 --max-model-len 2048 --no-progress \
        --cuda-graph-capture-timeout-s "$CAPTURE_S" --output-json "$OUT/$name.json" "$@"
    rc_of "$name" $?
}
for i in $(seq 1 "$REPEATS"); do
    bench "aioengine_$i"
done
if [[ -n "$AB_FLAGS" ]]; then
    # shellcheck disable=SC2086
    bench aioengine_ab $AB_FLAGS
    echo "$AB_FLAGS" > "$OUT/ab_flags.txt"
fi

echo "== 3. transformers continuous batching, first 200 prompts, stopped at $PEER_LIMIT_S s (budget $(budget "$PEER_S") s)"
timeout -s ABRT -k 10 "$(budget "$PEER_S")" "$PY" -m aioengine bench hf-peer --model random:llama-3.1-8b --device cuda \
    --dataset sharegpt --num-prompts 200 --time-limit "$PEER_LIMIT_S" --output-json "$OUT/hf_peer.json"
rc_of hf_peer $?

if [[ -n "${GPU_CHECK_PROFILE_PROMPTS:-}" ]] && (( $(left) > 40 )); then  # where the host's time goes (cProfile; its figures are not quoted)
    echo "== 2p. the same bench with --profile-host on $GPU_CHECK_PROFILE_PROMPTS prompts (budget $(budget "$BENCH_S") s)"
    timeout -s ABRT -k 10 "$(budget "$BENCH_S")" "$PY" -m aioengine bench throughput --model random:llama-3.1-8b \
        --device cuda --dataset sharegpt --num-prompts "$GPU_CHECK_PROFILE_PROMPTS" --max-model-len 2048 --no-progress \
        --cuda-graph-capture-timeout-s "$CAPTURE_S" --profile-host "$OUT/host_profile.txt"
    rc_of profile $?
fi
echo "== 4. report"
"$PY" scripts/gpu_report.py "$OUT"
rc=$?
echo "== done in $(( SECONDS - T0 )) s; results in $OUT/results.json, log in $LOG"
exit $rc
