"""KV-cache events in vLLM's format: a ZMQ subscriber decoding with vLLM's schema (the structs below are
written from vLLM's field names, not imported from the engine) rebuilds the engine's cached block set
exactly after a workload that evicts, replays missed batches from the replay socket, and sees
AllBlocksCleared on a reset; bad configs are refused naming the key."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.config import KVEventsConfig


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Subscriber:
    """Collects (seq, batch) on a thread until stopped."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.got: list[tuple[int, KVEventBatch]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sub.poll(20):
                topic, seq, payload = self.sub.recv_multipart()
                self.got.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sub.close()
        self.ctx.term()


def _replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Every buffered batch from sequence ``start``, through the replay socket's protocol."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    got = []
    try:
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    finally:
        dealer.close()
        ctx.term()


def _apply(cached: set, batch: KVEventBatch, block_size: int) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored):
            assert e.block_size == block_size and len(e.token_ids) == block_size * len(e.block_hashes)
            assert e.medium == "CPU"
            cached |= {(h, e.group_idx) for h in e.block_hashes}
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                cached.remove((h, e.group_idx))  # never removed before it was stored
        else:
            cached.clear()


def test_a_subscriber_rebuilds_the_cached_blocks_and_replays_what_it_missed(tiny_llama):
    path, _ = tiny_llama
    pub, replay = _ports(2)
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
    }
    args = EngineArgs(
        model=str(path), dtype="float32", block_size=4, num_kv_blocks=1 + 24, kv_events_config=cfg
    )
    rng = random.Random(5)
    shared = [rng.randrange(3, 49152) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(rng.randint(4, 30))] for _ in range(12)]
    sub = Subscriber(f"tcp://127.0.0.1:{pub}", "kv")
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives: connect first

    async def run() -> tuple[set, int]:
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            for i in range(0, len(prompts), 3):  # waves: later ones evict earlier blocks (24 blocks in all)
                await asyncio.gather(*(engine.generate(p, params) for p in prompts[i : i + 3]))
            pool = engine.scheduler.kv_cache_manager.block_pool
            truth = set(pool.cached_block_hash_to_block)
            await asyncio.sleep(0.5)  # the publisher's thread sends what is queued
            # A subscriber misses what was sent before its connection (ZMQ's slow joiner): the replay
            # socket fills the gap, from sequence 0
            replayed.extend(await asyncio.to_thread(_replay, f"tcp://127.0.0.1:{replay}", 0))
            assert engine.reset_prefix_cache()
            await asyncio.sleep(0.5)
            dropped = engine._kv_events.dropped
            return truth, dropped

    replayed: list[tuple[int, KVEventBatch]] = []
    truth, dropped = asyncio.run(run())
    time.sleep(0.3)
    sub.close()
    live = dict(sub.got)
    assert live and list(live) == list(range(min(live), max(live) + 1)) and dropped == 0
    both = dict(replayed) | live
    assert list(both) == list(range(len(both))) and len(replayed) >= min(live)
    for seq in set(live) & set(dict(replayed)):  # the same batch either way
        assert dict(replayed)[seq] == live[seq]
    batches = [both[s] for s in range(len(both))]
    cached: set = set()
    for batch in batches[:-1]:
        _apply(cached, batch, 4)
    removed = sum(isinstance(e, BlockRemoved) for b in batches for e in b.events)
    assert removed > 0 and cached == truth and len(truth) > 0  # evictions happened; the set is exact
    assert [type(e) for e in batches[-1].events] == [AllBlocksCleared]


def test_the_replay_socket_sends_buffered_batches_then_the_end_marker():
    from aioengine.engine.kv_events import ZmqEventPublisher
    from aioengine.sched import kv_events as ev

    pub, replay = _ports(2)
    cfg = KVEventsConfig(True, "zmq", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", buffer_steps=3)
    publisher = ZmqEventPublisher(cfg, "CPU")
    try:
        for i in range(5):
            publisher.publish([ev.BlockStored([100 + i], None, [1, 2], 2, None, 0)], {})
        deadline = time.monotonic() + 5
        while publisher.published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = [(seq, b.events[0].block_hashes) for seq, b in _replay(f"tcp://127.0.0.1:{replay}", 1)]
        assert got == [(2, [102]), (3, [103]), (4, [104])]  # the buffer keeps the last 3; from seq 1 on
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be zmq or null"),
        ({"enable_kv_cache_events": True, "endpoints": "x"}, "unknown key 'endpoints'"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm must be a positive integer"),
        ("zmq", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="x", kv_events_config=cfg).validate()
