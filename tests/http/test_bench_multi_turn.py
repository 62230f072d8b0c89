"""`aioengine bench multi-turn` against the live server: its figures are there, and a conversation's second
turn hits the first turn's cached blocks (one engine holds every conversation)."""

from __future__ import annotations

from aioengine.cli.bench import main as bench_main
from aioengine.cli.bench.multi_turn import main as multi_turn


def test_multi_turn_reports_ttft_throughput_and_the_hit_rate(server, capsys):
    r = multi_turn(
        ["--base-url", server.url(), "--conversations", "3", "--turns", "2", "--output-len", "4"]
        + ["--max-concurrency", "3"]
    )
    assert r["requests"] == 6 and r["output_tokens_per_s"] > 0 and r["context_tokens"] > 3 * 4
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert 0.2 < r["prefix_hit_rate"] <= 1.0  # turn 2 reuses turn 1's blocks
    # the replies' own count (what a Ray Serve ingress gives); /metrics here also counts other tests' requests
    assert 0.2 < r["usage_hit_rate"] <= 1.0
    assert r["offload_host_hit_tokens"] == r["offload_disk_read_blocks"] == 0  # no offload tier here
    assert "prefix-cache hit rate" in capsys.readouterr().out
    assert bench_main(["multi-turn", "--base-url", server.url(), "--conversations", "2", "--turns", "1"]) == 0
