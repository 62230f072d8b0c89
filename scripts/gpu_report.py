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


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rc(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _tests(out: Path) -> dict:
    res: dict = {"rc": _rc(out / "gpu_tests.rc")}
    try:
        suite = ET.parse(out / "gpu_tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] = int(suite.get(k, 0))
        res["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
    except (OSError, ET.ParseError, AttributeError):
        pass
    return res


def main(out_dir: str) -> int:
    out = Path(out_dir)
    ours = _read_json(out / "aioengine.json")
    peer = _read_json(out / "hf_peer.json")
    results: dict = {"gpu_tests": _tests(out)}
    results["aioengine"] = None if ours is None else {
        **{k: ours.get(k) for k in KEYS}, "engine_start_s": ours.get("engine_start_s"),
        "gpu_idle_fraction": ours.get("gpu_idle_fraction"), "gpu_steps": ours.get("gpu_steps"),
        "input_tokens": ours.get("input_tokens")}
    results["hf_peer"] = None if peer is None else {k: peer.get(k) for k in KEYS}
    results["rc"] = {"aioengine": _rc(out / "aioengine.rc"), "hf_peer": _rc(out / "hf_peer.rc")}
    if ours and peer and peer.get("output_tokens_per_s"):
        results["output_tokens_per_s_ratio"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    t = results["gpu_tests"]
    print(f"GPU tests: rc={t.get('rc')} tests={t.get('tests')} failures={t.get('failures')} "
          f"errors={t.get('errors')} skipped={t.get('skipped')} {t.get('failed') or ''}")
    for name, r in (("aioengine (1000 prompts)", results["aioengine"]), ("transformers CB (200)", results["hf_peer"])):
        if r is None:
            print(f"{name}: no result")
            continue
        idle = r.get("gpu_idle_fraction")
        print(f"{name}: {r['output_tokens_per_s']:.0f} output tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
              f"mean TPOT {r['mean_tpot_ms']:.1f} ms" + ("" if idle is None else f", GPU idle {100 * idle:.1f}%"))
    if "output_tokens_per_s_ratio" in results:
        print(f"output tokens/s, aioengine / transformers: {results['output_tokens_per_s_ratio']:.2f}x")
    ok = t.get("rc") == 0 and ours is not None and peer is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
