"""The shared-memory broadcast ring: order, messages larger than a slot, a full ring, close, stats."""

from __future__ import annotations

import os
import threading

import pytest

from aioengine.executor.shm_ring import RingClosed, RingReader, RingTimeout, RingWriter


def test_every_reader_gets_every_message_in_order_across_slot_boundaries():
    writer = RingWriter(num_readers=2, num_slots=4, slot_bytes=64)
    readers = [RingReader(writer.path, i) for i in range(2)]
    writer.unlink()  # the mappings outlive the file
    assert not os.path.exists(writer.path)
    # 40 messages through 4 slots: the writer waits for the readers, and a 1 kB message spans many slots
    messages = [("execute_model", (i, b"x" * (i * 31))) for i in range(40)]
    got: list[list] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].recv(timeout_s=30))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    sizes = [writer.publish(m, timeout_s=30) for m in messages]
    for t in threads:
        t.join(30)
    assert got == [messages, messages]
    assert max(sizes) > 4 * 64  # one message needed more slots than the ring has
    readers[1].record(7, 0.25)
    assert writer.reader_stats() == [(0.0, 0.0), (7.0, 0.25)]
    writer.release()
    for r in readers:
        r.detach()


def test_a_reader_that_stops_reading_times_the_writer_out_and_close_ends_both_sides():
    writer = RingWriter(num_readers=1, num_slots=2, slot_bytes=64)
    reader = RingReader(writer.path, 0)
    writer.publish(1)
    writer.publish(2)
    with pytest.raises(RingTimeout):
        writer.publish(3, timeout_s=0.2)  # both slots are the reader's still
    assert reader.recv() == 1 and reader.recv() == 2
    with pytest.raises(RingTimeout):
        reader.recv(timeout_s=0.2)
    writer.close()
    with pytest.raises(RingClosed):
        reader.recv(timeout_s=5)
    writer.release()
    reader.detach()


def test_a_file_that_is_not_a_ring_is_refused(tmp_path):
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not an aioengine ring"):
        RingReader(str(path), 0)
