"""The disk tier's block files: a block written is read back byte for byte; a truncated, corrupt or
foreign file (another block's header or tokens) is refused and deleted; a new tier over the same folder
and fingerprint finds the blocks, another fingerprint does not."""

from __future__ import annotations

import os
import time

import pytest

from aioengine.engine.kv_disk import KVDiskTier, fingerprint

BLOCK_BYTES = 256
TOKENS = (5, 6, 7, 8)


@pytest.fixture
def tier(tmp_path):
    t = KVDiskTier(str(tmp_path), "model=x", BLOCK_BYTES)
    yield t
    t.close()


def _write(t: KVDiskTier, h: int, payload: bytes, tokens=TOKENS, group: int = 0) -> None:
    t.write(h, group, tokens, payload)
    t._io.submit(lambda: None).result()  # behind the write


def test_round_trip_and_restart(tmp_path, tier):
    payload = os.urandom(BLOCK_BYTES)
    _write(tier, -12345, payload)  # a negative hash, as Python's hash() gives
    _write(tier, 99, os.urandom(BLOCK_BYTES), group=2)
    assert tier.read(-12345, 0, TOKENS).result() == payload
    assert sorted(tier.scan()) == [(-12345, 0), (99, 2)]
    again = KVDiskTier(str(tmp_path), "model=x", BLOCK_BYTES)
    assert sorted(again.scan()) == [(-12345, 0), (99, 2)]
    assert again.read(-12345, 0, TOKENS).result() == payload
    other = KVDiskTier(str(tmp_path), "model=y", BLOCK_BYTES)  # another model's folder: none of these
    assert other.scan() == []
    again.close()
    other.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "tokens", "missing"])
def test_a_bad_file_is_refused_and_deleted(tier, damage):
    payload = os.urandom(BLOCK_BYTES)
    _write(tier, 7, payload)
    path = tier.path(7, 0)
    data = bytearray(path.read_bytes())
    tokens = TOKENS
    if damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "flip":
        data[100] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "tokens":  # a hash collision: the file holds other tokens
        tokens = (5, 6, 7, 9)
    else:
        path.unlink()
    assert tier.read(7, 0, tokens).result() is None
    assert not path.exists()


def test_writes_past_the_queue_are_dropped_not_queued(tmp_path):
    t = KVDiskTier(str(tmp_path), "model=x", BLOCK_BYTES, max_pending_writes=1)
    gate = t._io.submit(time.sleep, 0.3)  # hold the I/O thread
    t.write(1, 0, TOKENS, bytes(BLOCK_BYTES))
    t.write(2, 0, TOKENS, bytes(BLOCK_BYTES))
    gate.result()
    t.close()
    assert t.writes_dropped == 1 and t.written == 1


def test_fingerprint_follows_the_model_files(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"abc")
    first = fingerprint(str(model), dtype="float32", block_size=16)
    assert first == fingerprint(str(model), block_size=16, dtype="float32")
    assert first != fingerprint(str(model), dtype="bfloat16", block_size=16)
    model.write_bytes(b"abcd")  # another file under the same name
    assert fingerprint(str(model), dtype="float32", block_size=16) != first
