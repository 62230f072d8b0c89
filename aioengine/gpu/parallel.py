"""Tensor parallelism on one rank: which heads and MLP columns it holds, its view of the model config, the
slice of each checkpoint tensor it loads, and the process group its all-reduces run in.

The plan follows vLLM's: qkv and gate_up are column-parallel, o and down row-parallel (an all-reduce after
each), and so is every expert of a mixture and its shared expert (each rank holds a slice of every
expert's intermediate columns; the routers are replicated). KV heads are split between ranks, or
replicated when there are fewer of them than ranks. Heads are split along KV groups, so a rank's query
heads always share its KV heads in equal groups; a split that does not divide evenly gives some ranks one
KV head more (the default model's 3 KV heads over 2 ranks).
The embedding and the LM head are replicated: every rank samples, so every rank needs whole logit rows,
and a replicated head needs no gather (the cost is one head's memory and bandwidth per rank).
"""

from __future__ import annotations

import copy
import datetime
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from aioengine import env
from aioengine.model import gguf_codes

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend


class TensorParallelError(ValueError):
    """A model that cannot be split over the requested ranks, or a bad init method."""


@dataclass(frozen=True, slots=True)
class TPShard:
    """What rank ``rank`` of ``size`` holds: ``[start, end)`` of query heads, KV heads, MLP columns and
    each expert's columns."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_intermediate: tuple[int, int] = (0, 0)  # Qwen2-MoE's shared expert
    expert_size: int = 0  # each expert's whole intermediate size


def _balanced(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``n`` items split into ``parts`` contiguous runs whose sizes differ by at most one."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (i < extra)


def plan_shard(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    rank: int,
    size: int,
    expert_intermediate_size: int = 0,
    shared_intermediate_size: int = 0,
) -> TPShard:
    if not 0 <= rank < size:
        raise TensorParallelError(f"rank {rank} is not within a tensor-parallel size of {size}")
    if num_heads % num_kv_heads:
        raise TensorParallelError(
            f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads"
        )
    group = num_heads // num_kv_heads
    if intermediate_size < size:
        raise TensorParallelError(f"an MLP of {intermediate_size} columns cannot be split over {size} ranks")
    for what, n in (("experts", expert_intermediate_size), ("a shared expert", shared_intermediate_size)):
        if 0 < n < size:
            raise TensorParallelError(f"{what} of {n} columns cannot be split over {size} ranks")
    if num_kv_heads >= size:
        kv = _balanced(num_kv_heads, size, rank)
        q = (kv[0] * group, kv[1] * group)
    else:  # fewer KV heads than ranks: each is replicated on size // num_kv_heads ranks, as in vLLM
        if size % num_kv_heads:
            raise TensorParallelError(
                f"tensor_parallel_size {size} must divide or be a multiple of the model's {num_kv_heads} "
                "KV heads"
            )
        replicas = size // num_kv_heads
        if group < replicas:
            raise TensorParallelError(
                f"{num_heads} attention heads cannot be split over {size} ranks "
                f"({num_kv_heads} KV heads, {group} query heads each)"
            )
        head = rank // replicas
        kv = (head, head + 1)
        sub = _balanced(group, replicas, rank % replicas)
        q = (head * group + sub[0], head * group + sub[1])

    def part(n: int) -> tuple[int, int]:
        return _balanced(n, size, rank) if n else (0, 0)

    return TPShard(
        rank,
        size,
        q,
        kv,
        part(intermediate_size),
        part(expert_intermediate_size),
        part(shared_intermediate_size),
        expert_intermediate_size,
    )


def shard_of(config: Any, rank: int, size: int) -> TPShard:
    from aioengine.gpu.models.llama import num_kv_heads_of

    return plan_shard(
        config.num_attention_heads,
        num_kv_heads_of(config),
        config.intermediate_size,
        rank,
        size,
        expert_intermediate_of(config),
        int(getattr(config, "shared_expert_intermediate_size", None) or 0),
    )


def expert_intermediate_of(config: Any) -> int:
    """Each expert's intermediate size (Qwen-MoE's ``moe_intermediate_size``, Mixtral's experts are its
    ``intermediate_size``); 0 for a model without experts."""
    from aioengine.gpu.models.moe import num_experts_of

    if not num_experts_of(config):
        return 0
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def shard_config(config: Any, shard: TPShard) -> Any:
    """A copy of the HF config that describes this rank's part: the model code builds it unchanged (its
    heads, its KV cache and its MLP are the rank's), with ``head_dim`` made explicit."""
    from aioengine.gpu.models.llama import head_dim_of

    local = copy.deepcopy(config)
    local.head_dim = head_dim_of(config)
    local.num_attention_heads = shard.q_heads[1] - shard.q_heads[0]
    local.num_key_value_heads = shard.kv_heads[1] - shard.kv_heads[0]
    local.intermediate_size = shard.intermediate[1] - shard.intermediate[0]
    if getattr(config, "moe_intermediate_size", None):
        local.moe_intermediate_size = shard.expert_intermediate[1] - shard.expert_intermediate[0]
    if getattr(config, "shared_expert_intermediate_size", None):
        local.shared_expert_intermediate_size = shard.shared_intermediate[1] - shard.shared_intermediate[0]
    local.tp_shard = shard
    return local


# HF parameter name part -> (dim to slice, which range); row-parallel biases are added by rank 0 alone.
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
# An expert's projections, by either naming (Qwen-MoE's, Mixtral's w1 gate, w3 up, w2 down)
_EXPERT_COLUMN = frozenset({"gate_proj", "up_proj", "w1", "w3"})
_EXPERT_ROW = frozenset({"down_proj", "w2"})

# Reads ``tensor[index]`` of one checkpoint tensor: a safetensors slice reads only those bytes.
Reader = Callable[[tuple[slice, ...] | None], torch.Tensor]


def weight_index(
    name: str, shape: tuple[int, ...], shard: TPShard, head_dim: int
) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor ``name`` this rank loads (None: all of it), or ``()`` for a
    row-parallel bias on a rank other than 0 (it loads zeros)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    ranges = {
        "q": tuple(h * head_dim for h in shard.q_heads),
        "kv": tuple(h * head_dim for h in shard.kv_heads),
        "mlp": shard.intermediate,
    }
    if kind == "sinks":  # gpt-oss: one logit per query head
        return (slice(*shard.q_heads),)
    if module == "experts":  # gpt-oss's stacked experts, by tensor
        return _stacked_expert_index(kind, shard)
    if ".experts." in name or ".shared_expert." in name:
        start, end = shard.expert_intermediate if ".experts." in name else shard.shared_intermediate
        if module in _EXPERT_COLUMN:
            return (slice(start, end),)
        return (slice(None), slice(start, end)) if module in _EXPERT_ROW else None
    if module in _COLUMN:
        start, end = ranges[_COLUMN[module]]
        return (slice(start, end),)
    if module in _ROW:
        if kind == "bias":
            return None if shard.rank == 0 else ()
        start, end = ranges[_ROW[module]]
        return (slice(None), slice(start, end))
    return None


def _stacked_expert_index(kind: str, shard: TPShard) -> tuple[slice, ...] | None:
    """gpt-oss's ``experts.<tensor>``: gate_up ``[E, H, 2I]`` (its bias ``[E, 2I]``) with gate and up columns
    alternating, so a rank's columns ``[s, e)`` are ``[2s, 2e)``; down ``[E, I, H]`` row-parallel (its
    bias on rank 0 alone); MXFP4 ``*_blocks``/``*_scales`` hold outputs, then inputs in blocks of 32."""
    start, end = shard.expert_intermediate
    both = slice(None)
    if kind in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
        return (both, slice(2 * start, 2 * end))
    if kind == "gate_up_proj":
        return (both, both, slice(2 * start, 2 * end))
    if kind == "down_proj":
        return (both, slice(start, end))
    if kind == "down_proj_bias":
        return () if shard.rank else None
    if kind in ("down_proj_blocks", "down_proj_scales"):
        if start % 32 or end % 32:
            raise TensorParallelError(
                f"MXFP4 experts split in blocks of 32 columns; this rank's {start}..{end} does not"
            )
        return (both, both, slice(start // 32, end // 32))
    raise TensorParallelError(f"unexpected gpt-oss expert tensor {kind!r}")


def _expert_codes_part(proj: str, shape: tuple[int, ...], read: Reader, shard: TPShard) -> torch.Tensor:
    """This rank's part of a layer's expert codes, scales or mins: gate_up's rows are the gate's I, then the
    up's I, and a rank reads ``[s, e)`` of each; down's inputs are I in units of 1 (int8 codes), 2 (4-bit
    codes two to a byte) or a block (scales and mins), so a rank's columns must fall on a block."""
    start, end = shard.expert_intermediate
    both = slice(None)
    if proj == "gate_up":
        half = shape[1] // 2
        gate, up = read((both, slice(start, end))), read((both, slice(half + start, half + end)))
        return torch.cat((gate, up), dim=1)
    unit = shard.expert_size // shape[2]
    if start % unit or end % unit:
        raise TensorParallelError(
            f"experts on block codes split in blocks of {unit} columns; this rank's {start}..{end} does not"
        )
    return read((both, both, slice(start // unit, end // unit)))


def shard_reader(
    name: str, shape: tuple[int, ...], read: Reader, shard: TPShard | None, head_dim: int
) -> torch.Tensor:
    """This rank's part of one checkpoint tensor, read through ``read``."""
    if shard is None or shard.size == 1:
        return read(None)
    coded = gguf_codes.EXPERT_CODES.match(name)  # a mixture's experts as block codes, stacked by layer
    if coded is not None:
        return _expert_codes_part(coded["proj"], shape, read, shard)
    index = weight_index(name, shape, shard, head_dim)
    if index == ():
        return read(None).zero_()  # a bias: small
    return read(index)


# ---- the process group --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_init_method(init_method: str | None) -> str:
    """``tcp://host:port`` as given, or from torchrun's MASTER_ADDR/MASTER_PORT, or a free local port."""
    if init_method in (None, "env://"):
        master = env.torchrun_master()
        if master:
            return f"tcp://{master[0]}:{master[1]}"
        if init_method == "env://":
            raise TensorParallelError("distributed_init_method env:// needs MASTER_ADDR and MASTER_PORT")
        return f"tcp://127.0.0.1:{free_port()}"
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise TensorParallelError(
            f"distributed_init_method must be tcp://host:port or env://, got {init_method!r}"
        )
    return init_method


class TPGroup:
    """One rank's membership of a tensor-parallel group: its own process group (never torch's default
    group, so two engines in one process keep theirs apart), of the kind the backend makes."""

    def __init__(
        self,
        init_method: str,
        rank: int,
        size: int,
        backend: Backend,
        timeout_s: float,
        name: str = "tp",
        control: bool = False,
        shm_slot_bytes: int = 0,
    ) -> None:
        """``control``: a second gloo group for rank 0's calls (the Ray executor); ``shm_slot_bytes``: on
        CPU ranks of one node, all-reduce through shared memory tensors up to this size."""
        parsed = urlparse(init_method)
        assert parsed.hostname is not None and parsed.port is not None, init_method
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.device = rank, size, backend.device
        self.all_reduce_s, self.all_reduce_calls = 0.0, 0  # this rank's, waits for the others included
        # Rank 0 hosts the store; the others connect to it (and wait for it, up to the timeout).
        self.store = dist.TCPStore(
            parsed.hostname, parsed.port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
        prefixed = dist.PrefixStore(name, self.store)
        self.pg: Any = backend.make_process_group(prefixed, rank, size, timeout)
        # Calls from rank 0 (the Ray executor's transport) travel in a gloo group of their own: a rank's
        # receiving thread must never interleave its ops with the model's all-reduces. It waits through
        # idle hours, so it has no practical timeout.
        self.control: Any = (
            dist.ProcessGroupGloo(dist.PrefixStore(name + "-control", self.store), rank, size, _IDLE)
            if control
            else None
        )
        self.shm: Any = (
            backend.make_shm_allreduce(prefixed, rank, size, shm_slot_bytes, timeout_s)
            if shm_slot_bytes
            else None
        )
        # A first all-reduce now: NCCL creates its communicator here, not inside a CUDA graph capture;
        # every rank has mapped the shared memory once it returns.
        self.barrier()
        if self.shm is not None and rank == 0:
            self.shm.unlink()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank ends with the same bits)."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            self.pg.allreduce([x]).wait()  # CUDA: the stream waits, not the host (the time is the launch's)
        self.all_reduce_s += time.perf_counter() - t0
        self.all_reduce_calls += 1
        return x

    def abort(self) -> None:
        """From any thread: a shared-memory all-reduce waiting on a rank that is gone gives up."""
        if self.shm is not None:
            self.shm.abort()

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def send_object(self, obj: Any) -> int:
        """Rank 0: broadcast ``obj`` (pickled) over the control group; returns its size in bytes."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.control.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.control.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()
        return len(data)

    def recv_object(self) -> Any:
        """Ranks 1..N-1: the next object rank 0 sent."""
        size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())


_IDLE = datetime.timedelta(days=3650)
