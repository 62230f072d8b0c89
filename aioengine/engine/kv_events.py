"""vLLM's KV-cache events on ZMQ: each step's prefix-cache changes as one msgspec ``KVEventBatch``.

The format follows vLLM's ``vllm/distributed/kv_events.py`` (main as of late 2025: ``BlockStored`` with
``lora_name``, ``extra_keys`` and ``group_idx``): an ``EventBatch`` is an array ``[ts, events,
data_parallel_rank]``; each event a map tagged by its class name. The PUB socket sends
``(topic, 8-byte big-endian sequence number, payload)``; the ROUTER replay socket answers
``(identity, "", start_seq)`` with every buffered ``(seq, payload)`` from there, then ``(-1, "")``. So a
router written for vLLM's events (llm-d's precise prefix scorer, Dynamo's KV router) subscribes unchanged.
The hashes are the engine's own chained block hashes (Python ints), not vLLM's sha256.

``publish`` never blocks the step: batches go to a bounded queue that a thread encodes and sends; a full
queue drops the batch and counts it (``dropped``), and ZMQ drops past the socket's high-water mark for a
subscriber that does not keep up.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from aioengine.config import KVEventsConfig
from aioengine.sched import kv_events as sched_events

logger = logging.getLogger("aioengine.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(
    event: sched_events.KVEvent, medium: str, lora_names: dict[int, str]
) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The scheduler's record as vLLM's struct."""
    if isinstance(event, sched_events.BlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            medium,
            lora_names.get(event.lora_id) if event.lora_id else None,
            group_idx=event.group_idx,
        )
    if isinstance(event, sched_events.BlockRemoved):
        return BlockRemoved(event.block_hashes, medium, group_idx=event.group_idx)
    return AllBlocksCleared()


class ZmqEventPublisher:
    """The PUB and replay sockets and the thread that serves them (see the module's docstring)."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        self.config, self.medium = config, medium
        self.dropped = 0  # batches the queue had no room for
        self.published = 0
        self._dead = False  # the thread stopped on an error
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint}: {e}") from e
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[sched_events.KVEvent], lora_names: dict[int, str]) -> None:
        """Queue one step's events (nothing for none); never waits."""
        if not events:
            return
        if self._dead:
            self.dropped += 1
            return
        batch = KVEventBatch(time.time(), [to_wire(e, self.medium, lora_names) for e in events])
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets (the thread's own, once it is
        done: a socket is never used by two threads)."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5.0)
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            logger.warning("the KV-event publisher did not stop within 10 s; its sockets are left open")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    def _serve(self) -> None:
        try:
            self._publish_loop()
        except Exception:  # the step never depends on it: log, and drop what comes (publish still counts)
            logger.exception("the KV-event publisher stopped")
            self._dead = True

    def _publish_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:  # past the high-water mark: this subscriber misses it (replay has it)
                self.dropped += 1
            self._buffer.append((seq, payload))
            self.published += 1
            seq += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
