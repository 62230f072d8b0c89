#!/usr/bin/env bash
# The per-ISA defaults table of docs/benchmarks.md: for one kernel level, the decode step time (median ms) of
# the defaults and of each alternative the flags offer, at batch 1, 16 and 64, alternated ROUNDS times.
# usage: scripts/isa_defaults.sh LEVEL [RESULTS_DIR] [ROUNDS=2]
# At the avx2 level torch is capped to AVX2 as well (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), so an AVX-512
# machine measures what an AVX2-only core runs, its torch fallbacks included.
set -u
cd "$(dirname "$0")/.."
level=$1; out=${2:-isa-defaults-$level}; rounds=${3:-2}; mkdir -p "$out"
if [ "$level" = avx2 ]; then export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2; fi
alts=("" "--no-cpu-q8-linears" "--no-cpu-q8-head" "--no-cpu-kernels" "--cpu-linear torch" \
      "--quantization int8" "--quantization int4" "--dtype bfloat16" "--dtype float32" "--no-cpu-decode-stack")
for r in $(seq 1 "$rounds"); do
  for b in 1 16 64; do
    for i in "${!alts[@]}"; do
      # shellcheck disable=SC2086 (an alternative is a list of flags)
      python -m aioengine bench latency --cpu-isa "$level" --batch-size "$b" --input-len 32 --output-len 32 \
        --num-iters 2 --num-iters-warmup 1 ${alts[$i]} > "$out/b$b-alt$i-r$r.txt" 2>&1
    done
  done
done
printf '| alternative | batch 1 | batch 16 | batch 64 |\n|---|---|---|---|\n'
for i in "${!alts[@]}"; do
  printf '| %s |' "${alts[$i]:-defaults}"
  for b in 1 16 64; do
    printf ' %s |' "$(for r in $(seq 1 "$rounds"); do
      grep -oP 'decode step \K[0-9.]+' "$out/b$b-alt$i-r$r.txt" || echo nan; done \
      | sort -g | awk '{v[NR] = $1} END {m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f", m}')"
  done
  echo
done
