"""The one owner of gc.freeze(): a count of holders (started engines, serving apps), frozen while any holds.

What startup built (torch, transformers, the model's modules) lives as long as the process serves: moved out
of the cyclic collector's reach, a full collection no longer walks it while requests wait. The last holder to
let go unfreezes, so the process exits as it would without the freeze (frozen objects are never collected:
nanobind then reports triton's as leaked at exit).
"""

from __future__ import annotations

import atexit
import gc

_holders = 0
_collected = False  # a full collection ran before a freeze in this process


def freeze(collect: bool = True) -> None:
    """Move every object alive now into the permanent generation (after a collection, unless not
    ``collect``), and count one more holder. Each holder calls unfreeze() once.

    The process's first freeze collects every generation; later ones (another engine started in the same
    process) only the young ones, where what that start built lives: a full collection walks the whole heap
    again, a quarter of a second or more in a large process, at every start."""
    global _holders, _collected
    if collect:
        gc.collect(2 if not _collected else 1)
        _collected = True
    gc.freeze()
    if _holders == 0:  # a holder that never lets go (an app never cleaned up): unfreeze at exit anyway
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
    _holders += 1


def unfreeze() -> None:
    """One holder lets go; the last one gives the frozen objects back to the collector."""
    global _holders
    if _holders == 0:
        return
    _holders -= 1
    if _holders == 0:
        gc.unfreeze()


def refreeze() -> None:
    """Something that may have been frozen died (an engine unloaded): collect it, and while anyone holds the
    freeze, freeze what is still alive again."""
    if _holders:
        gc.unfreeze()
    gc.collect()
    if _holders:
        gc.freeze()


def holders() -> int:
    return _holders
