"""A step's small host-to-device copies via pinned memory, so the launching thread never waits for the GPU.

``tensor.to("cuda")`` waits for the stream to finish what is queued on it, and even a non-blocking copy from
pageable memory may (the driver stages it and "may synchronize with the stream"). Either stalls the worker
until the GPU has run the step already queued, and the GPU then idles while the worker launches the next one.
Here a step's arrays are written into one of two pinned buffers, alternating by step, and copied with
``non_blocking=True``. A buffer is written again only after an event recorded behind its copies has completed;
with a batch queue of two that has always happened already.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_ALIGN = 64


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class HostStaging:
    """``begin_step()`` once per step on the launching thread, then ``to_device(array)`` for each input."""

    def __init__(self, device: torch.device, nbytes: int = 1 << 22, slots: int = 2) -> None:
        self.device = device
        self._nbytes = nbytes
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._retired: list[list[torch.Tensor]] = [[] for _ in range(slots)]  # outgrown, maybe still copying
        self._slot = 0
        self._off = 0

    def begin_step(self) -> None:
        """Close the current buffer (an event behind every copy queued so far) and open the next one."""
        event = torch.cuda.Event()
        event.record()
        self._events[self._slot] = event
        self._slot = (self._slot + 1) % len(self._bufs)
        previous = self._events[self._slot]
        if previous is not None:
            previous.synchronize()  # complete already, unless the GPU is two steps behind
        self._retired[self._slot].clear()
        self._off = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A device tensor with ``array``'s contents (shape and dtype), copied without waiting for the GPU."""
        array = np.ascontiguousarray(array)
        n = array.nbytes
        start = -(-self._off // _ALIGN) * _ALIGN
        buf = self._bufs[self._slot]
        if buf is None or start + n > buf.numel():
            if buf is not None:
                self._retired[self._slot].append(buf)
                self._nbytes = max(self._nbytes, 2 * buf.numel())
            self._nbytes = max(self._nbytes, 2 * n)
            buf = self._bufs[self._slot] = torch.empty(self._nbytes, dtype=torch.uint8, pin_memory=True)
            start = 0
        host = buf[start : start + n]
        host.numpy()[:] = array.reshape(-1).view(np.uint8)
        self._off = start + n
        host = host.view(_torch_dtype(array.dtype)).view(array.shape)
        return host.to(self.device, non_blocking=True)
