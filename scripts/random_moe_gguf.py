"""Write a random-weight Qwen3-MoE GGUF of a realistic shape, for benchmarks against llama.cpp on one file
(``--model random:olmoe-1b-7b-q4_k`` serves the same file from the cache: aioengine/model/random_gguf.py).

usage: python scripts/random_moe_gguf.py OUT.gguf [--layers 16 --experts 64 --top-k 8 --hidden 2048
       --expert-ffn 1024 --heads 16 --kv-heads 4 --expert-type q4_k|q8_0 --seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from aioengine.model.random_gguf import MoEShape, write_moe_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    d = MoEShape()
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--experts", type=int, default=d.experts)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--expert-ffn", type=int, default=d.expert_ffn)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-type", choices=("q4_k", "q8_0"), default=d.expert_type)
    a = ap.parse_args()
    shape = MoEShape(a.layers, a.experts, a.top_k, a.hidden, a.expert_ffn, a.heads, a.kv_heads, a.expert_type)
    write_moe_gguf(a.out, shape, a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
