"""The prefix cache's second tier: a multi-turn workload whose contexts add up to 4x the KV pool hits the
host tier (and the disk tier) on later turns, where without offload it misses; greedy outputs stay those
of the run without offload; a block file corrupted on disk is recomputed; a restarted server hits the
disk tier."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams

BLOCK = 4
# SMALL (tests/engine/conftest.py): 2 layers, 2 KV heads of 16, float32; a block holds K and V of each
BLOCK_BYTES = 2 * BLOCK * 2 * 16 * 2 * 4
POOL_BLOCKS = 56  # 224 tokens; the workload's contexts add up to about 4x that
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONVS = 8


def _conversations(n: int = CONVS, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(40)] for _ in range(n)]


async def _turns(engine: AsyncEngine, convs: list[list[int]], turns: int = 4, seed: int = 2) -> list:
    """Each conversation's turns, interleaved: its next prompt is its last prompt, the reply and new text."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        for c, prompt in enumerate(convs):
            res = await engine.generate(prompt, GREEDY)
            reply = list(res.outputs[0].token_ids)
            out.append((c, len(prompt), res.num_cached_tokens, reply))
            convs[c] = prompt + reply + [rng.randrange(3, 40000) for _ in range(20)]
    return out


def _args(path: Path, pool: int = POOL_BLOCKS, **kw) -> EngineArgs:
    return EngineArgs(
        model=str(path),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=1 + pool,
        max_num_batched_tokens=256,
        max_model_len=512,
        **kw,
    )


async def _run(path: Path, turns: int = 4, **kw) -> tuple[list, dict]:
    async with AsyncEngine(_args(path, **kw)) as engine:
        rows = await _turns(engine, _conversations(), turns)
        offload = engine.scheduler.kv_cache_manager.offload
        stats = {} if offload is None else {f: getattr(offload.stats, f) for f in offload.stats.__slots__}
        return rows, stats


def _later_hits(rows: list) -> int:
    return sum(cached for c, n, cached, _ in rows[CONVS:])  # turns after each conversation's first


def _most_hits(rows: list) -> int:
    """What later turns could hit at most: each one's previous prompt and reply, but the reply's last token
    (its KV is computed by the next turn), in whole blocks."""
    return sum((n + GREEDY.max_tokens - 1) // BLOCK * BLOCK for _, n, _, _ in rows[:-CONVS])


def test_multi_turn_hits_the_host_tier_and_keeps_the_outputs(tiny_llama):
    path, _ = tiny_llama
    base, _ = asyncio.run(_run(path))
    host, stats = asyncio.run(_run(path, kv_offload_size=4096 * BLOCK_BYTES / (1 << 30)))
    total = sum(n for _, n, _, _ in base[-CONVS:])
    assert total >= 4 * POOL_BLOCKS * BLOCK  # the last turns' contexts: 4x the pool
    assert [r[3] for r in host] == [r[3] for r in base]  # greedy, token for token
    assert stats["stored_blocks"] > 0 and stats["host_hit_tokens"] > 0
    # Without the tier, later turns find their prefix evicted; with it, they load it back.
    assert _later_hits(host) == _most_hits(host)
    assert _later_hits(base) < _most_hits(base) / 3, _later_hits(base)
    assert stats["disk_read_blocks"] == 0


def test_disk_tier_hits_survives_a_restart_and_recomputes_a_corrupt_file(tiny_llama, tmp_path):
    path, _ = tiny_llama
    base, _ = asyncio.run(_run(path))
    disk = dict(kv_offload_size=8 * BLOCK_BYTES / (1 << 30), kv_offload_dir=str(tmp_path))  # 8 host slots
    rows, stats = asyncio.run(_run(path, **disk))
    assert [r[3] for r in rows] == [r[3] for r in base]
    assert stats["disk_read_blocks"] > 0 and stats["disk_reads_failed"] == 0
    assert _later_hits(rows) > 3 * _later_hits(base)
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) > 20

    # A restart, with a pool of another size: the first turn's prompts hit the disk tier at once.
    first, stats = asyncio.run(_run(path, turns=1, pool=POOL_BLOCKS + 8, **disk))
    assert [r[3] for r in first] == [r[3] for r in base[:CONVS]]
    assert stats["disk_read_blocks"] > 0 and sum(r[2] for r in first) > 0

    # Every file corrupted (a flipped byte) or truncated: detected, deleted, recomputed; outputs unchanged.
    for i, f in enumerate(sorted(tmp_path.glob("*/*.kv"))):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 3]))
    bad, stats = asyncio.run(_run(path, turns=1, **disk))
    assert [r[3] for r in bad] == [r[3] for r in base[:CONVS]]
    assert stats["disk_reads_failed"] > 0 and stats["disk_read_blocks"] == 0
    assert sum(r[2] for r in bad) == 0


def test_the_disk_tier_keeps_to_its_size(tiny_llama, tmp_path):
    path, _ = tiny_llama
    file_bytes = 32 + 4 * BLOCK + BLOCK_BYTES + 4
    disk = dict(
        kv_offload_size=8 * BLOCK_BYTES / (1 << 30),
        kv_offload_dir=str(tmp_path),
        kv_offload_dir_size=30 * file_bytes / (1 << 30),
    )
    base, _ = asyncio.run(_run(path))
    rows, stats = asyncio.run(_run(path, **disk))
    assert [r[3] for r in rows] == [r[3] for r in base]
    assert stats["stored_blocks"] > 60 and stats["disk_reads_failed"] == 0
    assert 0 < len(list(tmp_path.glob("*/*.kv"))) <= 30


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_windowed_models_keep_their_outputs(tiny_checkpoint_of, tmp_path, kind):
    """Sliding-window groups go through the tiers too (a hit needs the window's blocks only)."""
    path = tiny_checkpoint_of(kind)
    base, _ = asyncio.run(_run(path, turns=3))
    rows, stats = asyncio.run(
        _run(path, turns=3, kv_offload_size=16 * BLOCK_BYTES / (1 << 30), kv_offload_dir=str(tmp_path))
    )
    assert [r[3] for r in rows] == [r[3] for r in base]
    assert _later_hits(rows) == _most_hits(rows) and _later_hits(base) < _most_hits(base) / 3
    assert stats["disk_read_blocks"] > 0


def test_a_folder_that_cannot_be_made_is_a_clear_start_error(tiny_llama, tmp_path):
    path, _ = tiny_llama
    (tmp_path / "file").write_text("not a folder")
    args = _args(path, kv_offload_size=0.001, kv_offload_dir=str(tmp_path / "file" / "kv"))
    with pytest.raises(ValueError, match="kv_offload_dir .* cannot hold block files"):
        asyncio.run(AsyncEngine(args).start())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(kv_offload_size=-1.0), "kv_offload_size must be a positive"),
        (dict(kv_offload_dir="/tmp/x"), "kv_offload_dir needs kv_offload_size"),
        (dict(kv_offload_size=1.0, kv_offload_dir_size=1.0), "kv_offload_dir_size needs kv_offload_dir"),
        (dict(kv_offload_size=1.0, kv_offload_dir="/tmp/x", kv_offload_dir_size=0.0), "must be a positive"),
        (dict(kv_offload_size=1.0, enable_prefix_caching=False), "needs enable_prefix_caching"),
        (dict(kv_offload_size=1.0, kv_offload_dir="/tmp/x", tensor_parallel_size=2), "tensor parallelism"),
    ],
)
def test_bad_offload_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw).validate()
