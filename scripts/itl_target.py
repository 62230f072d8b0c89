"""Plot the ITL distributions of `bench serve --save-result X --save-detailed` runs on one chart (the
ITL-aware budget against the token budget alone):
python scripts/itl_target.py OUT.png LABEL=RESULT.json ..."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, runs: list[str]) -> None:
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
