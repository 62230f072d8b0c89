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


def freeze(collect: bool = True) -> None:
    """Move every object alive now into the permanent generation (after a collection, unless not
    ``collect``), and count one more holder. Each holder calls unfreeze() once."""
    global _holders
    if collect:
        gc.collect()
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


def holders() -> int:
    return _holders
