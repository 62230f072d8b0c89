"""Combine scripts/gpu_check.sh's outputs into RESULTS_DIR/results.json and print a summary.

usage: python scripts/gpu_report.py RESULTS_DIR
Exit status: 0 when the GPU tests passed and both benchmarks produced results, else 1.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

KEYS = ("output_tokens_per_s", "mean_ttft_ms", "mean_tpot_ms", "num_requests", "output_tokens", "elapsed_s")
ENGINE_KEYS = (
    "engine_start_s",
    "input_tokens",
    "gpu_steps",
    "gpu_idle_fraction",
    "matmul_gflops",
    "fraction_of_roofline",
    "host_ms_per_step",
)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rcs(out: Path) -> dict[str, int]:
    """``rc.txt``: one ``STAGE RC`` line per stage."""
    try:
        lines = (out / "rc.txt").read_text().split("\n")
    except OSError:
        return {}
    return {name: int(rc) for name, rc in (ln.split() for ln in lines if ln.strip())}


def _tests(out: Path, rc: int | None) -> dict:
    res: dict = {"rc": rc}
    try:
        suite = ET.parse(out / "gpu_tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] = int(suite.get(k, 0))
        res["failed"] = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    except (OSError, ET.ParseError, AttributeError):
        pass
    return res


def _engine_run(r: dict) -> dict:
    kinds = {k: v for k, v in r.items() if k.startswith(("gpu_idle_fraction_", "gpu_steps_"))}
    return {**{k: r.get(k) for k in KEYS + ENGINE_KEYS}, **kinds}


def main(out_dir: str) -> int:
    out = Path(out_dir)
    rcs = _rcs(out)
    runs = [r for p in sorted(out.glob("aioengine_[0-9]*.json")) if (r := _read_json(p)) is not None]
    ab = _read_json(out / "aioengine_ab.json")
    peer = _read_json(out / "hf_peer.json")
    results: dict = {"gpu_tests": _tests(out, rcs.get("gpu_tests")), "rc": rcs}
    results["aioengine_runs"] = [_engine_run(r) for r in runs]
    ours = None
    if runs:  # the median run by output tokens/s (the lower middle one of an even count)
        ours = sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]
        results["aioengine"] = _engine_run(ours)
    if ab is not None:
        flags = (out / "ab_flags.txt").read_text().strip() if (out / "ab_flags.txt").exists() else "?"
        results["aioengine_ab"] = {"flags": flags, **_engine_run(ab)}
    results["hf_peer"] = (
        None
        if peer is None
        else {
            **{k: peer.get(k) for k in KEYS},
            "finished_requests": peer.get("finished_requests"),
            "note": peer.get("note"),
        }
    )
    if ours and peer and peer.get("output_tokens_per_s"):
        results["output_tokens_per_s_ratio"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    t = results["gpu_tests"]
    print(
        f"GPU tests: rc={t.get('rc')} tests={t.get('tests')} failures={t.get('failures')} "
        f"errors={t.get('errors')} skipped={t.get('skipped')} {t.get('failed') or ''}"
    )
    named = [(f"aioengine run {i + 1} (1000 prompts)", _engine_run(r)) for i, r in enumerate(runs)]
    if ab is not None:
        named.append((f"aioengine {results['aioengine_ab']['flags']}", results["aioengine_ab"]))
    named.append(("transformers CB (200)", results["hf_peer"]))
    for name, r in named:
        if r is None:
            print(f"{name}: no result")
            continue
        idle = r.get("gpu_idle_fraction")
        kinds = ", ".join(
            f"{k.removeprefix('gpu_idle_fraction_')} {100 * v:.1f}%"
            for k, v in sorted(r.items())
            if k.startswith("gpu_idle_fraction_")
        )
        print(
            f"{name}: {r['output_tokens_per_s']:.0f} output tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
            f"mean TPOT {r['mean_tpot_ms']:.1f} ms"
            + ("" if idle is None else f", GPU idle {100 * idle:.1f}%")
            + (f" ({kinds})" if kinds else "")
            + (f"; {r['note']}" if r.get("note") else "")
        )
    if "output_tokens_per_s_ratio" in results:
        print(
            "output tokens/s, aioengine (median run) / transformers: "
            f"{results['output_tokens_per_s_ratio']:.2f}x"
        )
    ok = t.get("rc") == 0 and ours is not None and peer is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
