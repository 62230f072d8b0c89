"""A converted GGUF's block codes, searched once and kept beside it, so later starts read them back.

Finding the codes reads every float32 decoder weight and checks each block (seconds for the default model, at
every start). A converted checkpoint in aioengine's cache never changes once its marker is written, so what
the search found there (codes, or that a tensor has none) is stored in one safetensors file in the entry.
The file's name carries a version: a search that finds more or other codes gets a new name. A missing,
unreadable or inconsistent file is searched again and rewritten (atomically); a checkpoint outside the
cache, or a cache that cannot be written, is searched every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from aioengine.gpu.cpu.block_codes import KINDS, BlockCodes, float32_matrices, read_block_codes
from aioengine.model.files import MARKER

logger = logging.getLogger(__name__)

CODES_FILE = "aioengine-block-codes-v1.safetensors"  # v1: Q8_0, Q5_0, Q4_0, Q6_K, Q4_1 and Q4_K


class CheckpointCodes:
    """``read_block_codes`` over a checkpoint's float32 matrices, answered from the stored file where it has
    the same question (the same tensor names, kinds and affine flag)."""

    def __init__(self, matrices: dict[str, Any], path: Path | None) -> None:
        self.matrices = matrices
        self.path = path
        self.found: dict[str, BlockCodes | None] = _load(path) if path is not None else {}
        self.added = False

    def read(
        self, names: list[str], kinds: Iterable[tuple[int, tuple[int, ...]]] = KINDS, affine: bool = False
    ) -> BlockCodes | None:
        kinds = tuple(kinds)
        key = hashlib.sha256(repr((names, kinds, affine)).encode()).hexdigest()[:32]
        if key not in self.found:
            self.found[key] = read_block_codes(self.matrices, names, kinds, affine)
            self.added = True
        return self.found[key]

    def save(self) -> None:
        if self.path is None or not self.added:
            return
        tensors: dict[str, torch.Tensor] = {}
        blocks: dict[str, int | None] = {}
        for key, found in self.found.items():
            blocks[key] = None if found is None else found.block
            if found is not None:
                tensors[f"{key}.scales"] = found.scales
                if found.mins is None:
                    tensors[f"{key}.codes"] = found.codes
                else:  # 4-bit codes, two to a byte on disk
                    tensors[f"{key}.codes"] = found.codes[:, 0::2] | (found.codes[:, 1::2] << 4)
                    tensors[f"{key}.mins"] = found.mins
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".codes-", suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata={"blocks": json.dumps(blocks)})
            os.chmod(tmp, 0o644)  # as the checkpoint's own files: another user of the cache reads it too
            os.replace(tmp, self.path)  # a concurrent start reads a whole file or none
        except OSError as e:  # a read-only or full cache: only the next start's search is lost
            logger.info("block codes not kept beside the checkpoint (%s); the next start searches again", e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


@contextmanager
def checkpoint_codes(checkpoint: str | os.PathLike[str]) -> Iterator[CheckpointCodes]:
    """The checkpoint's codes for the duration (its files open), stored at the end where it is a complete
    entry of the cache and something new was searched."""
    root = Path(checkpoint)
    with float32_matrices(root) as matrices:
        keep = bool(matrices) and (root / MARKER).is_file()
        codes = CheckpointCodes(matrices, root / CODES_FILE if keep else None)
        yield codes
    codes.save()


def _load(path: Path) -> dict[str, BlockCodes | None]:
    """The stored answers, or none where the file is missing or does not hold what it should."""
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            blocks = json.loads((f.metadata() or {})["blocks"])
            names = set(f.keys())
            found: dict[str, BlockCodes | None] = {}
            for key, block in blocks.items():
                if block is None:
                    found[key] = None
                    continue
                codes, scales = f.get_tensor(f"{key}.codes"), f.get_tensor(f"{key}.scales")
                mins = f.get_tensor(f"{key}.mins") if f"{key}.mins" in names else None
                found[key] = _checked(codes, scales, block, mins)
        return found
    except Exception as e:  # noqa: BLE001 (a damaged file of any kind is only a cache miss)
        logger.warning("ignoring %s (%s: %s); searching the codes again", path, type(e).__name__, e)
        return {}


def _checked(codes: torch.Tensor, scales: torch.Tensor, block: int, mins: torch.Tensor | None) -> BlockCodes:
    if mins is not None and codes.dtype == torch.uint8:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)
    n, k = codes.shape
    want = torch.uint8 if mins is not None else torch.int8
    if codes.dtype != want or block not in (16, 32) or k % block:
        raise ValueError("codes of the wrong type or block")
    if scales.dtype != torch.float32 or scales.shape != (n, k // block):
        raise ValueError("scales of the wrong shape")
    if mins is not None and (mins.dtype != torch.float32 or mins.shape != scales.shape or block != 32):
        raise ValueError("offsets of the wrong shape")
    return BlockCodes(codes, scales, block, mins)
