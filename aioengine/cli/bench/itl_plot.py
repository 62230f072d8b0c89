"""`aioengine bench itl-plot`: the ITL distributions of several `bench serve` results on one chart.

usage: aioengine bench itl-plot OUT.png LABEL=RESULT.json ...

Each RESULT.json is a `bench serve --save-result X --save-detailed` run (e.g. the ITL-aware budget against
the token budget alone); the chart plots, per run, the fraction of inter-token gaps longer than each latency.
"""

from __future__ import annotations

import argparse
import json


def plot(out: str, runs: list[str]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("itl-plot needs matplotlib: pip install 'aioengine[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        label, path = run.split("=", 1)
        with open(path) as f:
            data = json.load(f)
        itl = sorted(x * 1e3 for r in data["requests"] if not r["error"] for x in r["itl_s"])
        p50, p99 = itl[len(itl) // 2], itl[int(0.99 * (len(itl) - 1))]
        tail = [1 - (i + 0.5) / len(itl) for i in range(len(itl))]
        ax.plot(itl, tail, label=f"{label}: p50 {p50:.1f}, p99 {p99:.1f} ms")
    ax.set_xlabel("inter-token latency, ms")
    ax.set_ylabel("fraction of gaps longer")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench itl-plot", description=__doc__.splitlines()[0])
    ap.add_argument("out", metavar="OUT.png", help="the chart to write")
    ap.add_argument("runs", metavar="LABEL=RESULT.json", nargs="+", help="a legend label and its result")
    args = ap.parse_args(argv)
    for run in args.runs:
        if "=" not in run:
            ap.error(f"{run!r} is not LABEL=RESULT.json")
    plot(args.out, args.runs)
