"""Read and check a GGUF file: its header, metadata and tensor table, and its tensors dequantized to float32
under Hugging Face names. model_files.py turns the result into a cached checkpoint.

The header is parsed here with struct (the gguf package's reader decodes every one of a vocabulary's
strings as its own field, tens of seconds for 262k tokens); the blocks are dequantized by the gguf package,
and its tensor-name map gives the GGUF name of each Hugging Face parameter.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from aioengine.model import gguf_codes

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent

# ggml type id -> (name, elements per block, bytes per block): the types this engine loads.
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    30: ("BF16", 1, 2),
    8: ("Q8_0", 32, 34),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    39: ("MXFP4", 32, 17),  # gpt-oss's experts: an E8M0 scale and 32 E2M1 codes a block
}
SUPPORTED_TYPES = ", ".join(name for name, _, _ in TENSOR_TYPES.values())

# GGUF architecture -> the transformers class it converts to (a "llama" file with experts is Mixtral's).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# the architectures whose files may hold routed experts (llama: Mixtral's files)
MIXTURE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "gpt-oss")
SUPPORTED_MIXTURES = "qwen3moe, qwen2moe, gpt-oss and llama with experts (Mixtral)"

# metadata value types: fixed-width ones by struct format; 8 is a string, 9 an array
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_KEPT_ARRAYS = frozenset({"tokenizer.ggml.tokens"})  # other arrays are skipped, kept as their length


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: corrupt, cut off, or of an unsupported architecture or type."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (ggml lists the fastest-moving dimension first)
    type_id: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES[self.type_id][0]


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # arrays not kept (read_header's keep_arrays) hold their length only
    tensors: dict[str, TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


class _Cursor:
    """Reads little-endian values from the mapped file; running off its end is a GGUFError."""

    def __init__(self, blob: mmap.mmap, path: Path) -> None:
        self.blob, self.path, self.pos = blob, path, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.blob):
            raise GGUFError(
                f"{self.path}: the header is cut off at byte {self.pos} (the file has {len(self.blob)} "
                "bytes): the file is truncated"
            )
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.blob):
            raise GGUFError(
                f"{self.path}: a {n}-byte string at byte {self.pos} runs past the end of the file "
                f"({len(self.blob)} bytes): the file is truncated or corrupt"
            )
        raw = self.blob[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int, keep: bool) -> Any:
        if type_id in _SCALARS:
            return self.take(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _SCALARS and not keep:  # skip fixed-width items without decoding them
                self.pos += count * struct.calcsize(_SCALARS[item_type])
                if self.pos > len(self.blob):
                    raise GGUFError(
                        f"{self.path}: a metadata array runs past the end of the file (truncated)"
                    )
                return count
            if keep:
                return [self.value(item_type, keep) for _ in range(count)]
            for _ in range(count):
                self.value(item_type, keep)
            return count
        raise GGUFError(
            f"{self.path}: unknown metadata value type {type_id} at byte {self.pos}: corrupt file"
        )


def write_metadata_view(path: str | Path, out: str | Path, drop: tuple[str, ...]) -> None:
    """A GGUF holding ``path``'s metadata alone (no tensors), less the keys that start with one of
    ``drop``: what transformers' config and tokenizer readers need, without keys they misread."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        cur = _Cursor(blob, path)
        cur.pos = 4
        version, _, kv_count = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
        kept = []
        for _ in range(kv_count):
            start = cur.pos
            key = cur.string()
            cur.value(cur.take("<I"), False)
            if not key.startswith(drop):
                kept.append(blob[start : cur.pos])
    Path(out).write_bytes(GGUF_MAGIC + struct.pack("<IQQ", version, 0, len(kept)) + b"".join(kept))


def read_header(path: str | Path, keep_arrays: frozenset[str] = _KEPT_ARRAYS) -> GGUFHeader:
    """Parse and check the header: magic, version, metadata, tensor table, that each tensor's type is one
    this engine loads and its data lies inside the file. Raises GGUFError naming the file and the problem."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:  # an empty file cannot be mapped
        raise GGUFError(f"{path}: cannot be read as a GGUF file: {e}") from None
    with blob:
        return _parse(blob, path, keep_arrays)


def _parse(blob: mmap.mmap, path: Path, keep_arrays: frozenset[str]) -> GGUFHeader:
    if len(blob) < 24 or blob[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file: it starts with {blob[:4]!r}, not the magic {GGUF_MAGIC!r}")
    cur = _Cursor(blob, path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: 2 and 3)")
    tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"), key in keep_arrays)
    arch = metadata.get("general.architecture")
    experts = metadata.get(f"{arch}.expert_count") or 0
    if experts and arch not in MIXTURE_ARCHITECTURES:
        raise GGUFError(
            f"{path}: a mixture of experts of architecture {arch!r} ({experts} experts) is not supported; "
            f"supported mixtures: {SUPPORTED_MIXTURES}"
        )
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} "
            f"(mixtures: {SUPPORTED_MIXTURES})"
        )
    if experts or arch in ("qwen3moe", "qwen2moe"):
        need = ["expert_count", "expert_used_count"] + (
            [] if arch == "llama" else ["expert_feed_forward_length"]
        )
        missing = [f"{arch}.{k}" for k in need if not metadata.get(f"{arch}.{k}")]
        if missing:
            raise GGUFError(f"{path}: a mixture of experts without {', '.join(missing)}: corrupt metadata")
    if "tokenizer.ggml.model" not in metadata or not metadata.get("tokenizer.ggml.tokens"):
        raise GGUFError(f"{path}: the file carries no tokenizer (tokenizer.ggml.model and .tokens)")
    entries = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.take("<I")
        if not 1 <= n_dims <= 4:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions: corrupt tensor table")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        entries.append((name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in entries:
        if type_id not in TENSOR_TYPES:
            raise GGUFError(
                f"{path}: tensor {name} has ggml type {_type_name(type_id)}, which aioengine does not load; "
                f"supported: {SUPPORTED_TYPES}"
            )
        _, block, block_bytes = TENSOR_TYPES[type_id]
        numel = prod(shape)
        if numel == 0 or shape[-1] % block:
            raise GGUFError(
                f"{path}: tensor {name} has shape {list(shape)}, whose rows are not whole "
                f"{TENSOR_TYPES[type_id][0]} blocks of {block}: wrong shape"
            )
        start, nbytes = data_start + offset, numel // block * block_bytes
        if start + nbytes > len(blob):
            raise GGUFError(
                f"{path}: the data of tensor {name} is cut off: it needs bytes {start}..{start + nbytes}, "
                f"the file has {len(blob)}: the file is truncated"
            )
        tensors[name] = TensorInfo(name, shape, type_id, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"{type_id} (unknown)"


def dequantize(header: GGUFHeader, info: TensorInfo) -> np.ndarray:
    """The tensor as float32 in torch order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    if info.type_id == 0:
        return np.array(np.frombuffer(raw, dtype=np.float32).reshape(info.shape))  # off the mapping
    if info.type_id == 1:
        return np.frombuffer(raw, dtype=np.float16).reshape(info.shape).astype(np.float32)
    rows = raw.reshape(-1, info.shape[-1] // TENSOR_TYPES[info.type_id][1] * TENSOR_TYPES[info.type_id][2])
    out = gguf_dequantize(rows, GGMLQuantizationType(info.type_id))
    return out.reshape(info.shape).astype(np.float32, copy=False)


def _reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows with each head's rotary halves interleaved; undo it."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def num_hf_tensors(hf_shapes: dict[str, tuple[int, ...]], arch: str = "", codes: bool = False) -> int:
    """How many tensors ``hf_tensors`` yields for these shapes (stacked experts come one per expert, or as
    a layer's codes, scales and mins with ``codes``; gpt-oss's stay stacked)."""
    n = 0
    for name, shape in hf_shapes.items():
        fused = _FUSED_EXPERTS.match(name)
        if fused is None or arch == "gpt-oss":
            n += 1
        else:
            n += 3 if codes else shape[0] * (2 if fused["proj"] == "gate_up" else 1)
    return n


_EXPERT_TENSOR = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight$")


def expert_codes(header: GGUFHeader) -> bool:
    """Whether the file's routed experts load as block codes (``gguf_codes``): every ``ffn_*_exps`` tensor
    of a type with codes, and a layer's gate and up of one kind (they are stacked into one weight)."""
    if header.architecture == "gpt-oss":
        return False
    kinds: dict[tuple[str, str], tuple[int, bool]] = {}
    for name, info in header.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            continue
        if not gguf_codes.codes_type(info.type_id, info.shape[-1]):
            return False
        kinds[m["bid"], m["part"]] = gguf_codes.kind(info.type_id)
    gates = [bid for bid, part in kinds if part == "gate"]
    return bool(kinds) and all(kinds[bid, "gate"] == kinds.get((bid, "up")) for bid in gates)


def hf_tensors(
    header: GGUFHeader, hf_shapes: dict[str, tuple[int, ...]], config: Any, codes: bool = False
) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for each parameter in ``hf_shapes`` (a skeleton's state dict);
    raises GGUFError when the file lacks one or holds one of the wrong shape. With ``codes``
    (``expert_codes``), a layer's routed experts come as its stacked block codes (``_expert_codes``)."""
    from gguf import get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES

    arch = header.architecture
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    mixtral = getattr(config, "model_type", "") == "mixtral"
    for hf_name, shape in hf_shapes.items():
        if arch == "gpt-oss" and ".mlp.experts." in hf_name:
            yield hf_name, _gpt_oss_experts(header, hf_name, tuple(shape))
            continue
        if hf_name.endswith(".self_attn.sinks"):  # gpt-oss: a tensor without a .weight in its HF name
            hf_name_base = names.get_name(hf_name)
            info = header.tensors.get(f"{hf_name_base}.weight") if hf_name_base else None
            if info is None or info.shape != tuple(shape):
                raise GGUFError(
                    f"{header.path}: tensor {hf_name_base}.weight for {hf_name} is missing or misshapen"
                )
            yield hf_name, dequantize(header, info)
            continue
        fused = _FUSED_EXPERTS.match(hf_name)
        if fused is not None and codes:
            yield from _expert_codes(header, fused["layer"], fused["proj"], tuple(shape))
            continue
        if fused is not None:  # transformers' stacked experts: the file's [E, rows, cols] tensors, per expert
            yield from _experts(header, fused["layer"], fused["proj"], tuple(shape), mixtral)
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        gguf_name = f"{gguf_base}.{suffix}" if gguf_base else None
        if gguf_name is None or gguf_name not in header.tensors:
            raise GGUFError(f"{header.path}: tensor for {hf_name} ({gguf_name or 'no GGUF name'}) is missing")
        info = header.tensors[gguf_name]
        # llama.cpp stores Qwen2-MoE's shared-expert gate [1, H] as a vector
        vector_row = len(shape) == 2 and shape[0] == 1 and info.shape == tuple(shape[1:])
        if info.shape != tuple(shape) and not vector_row:
            raise GGUFError(
                f"{header.path}: tensor {gguf_name} has shape {list(info.shape)}, but the model's config "
                f"needs {list(shape)} for {hf_name}: wrong shape"
            )
        w = dequantize(header, info).reshape(shape)
        if mixtral and base.endswith(".mlp.gate"):
            hf_name = hf_name.replace(".mlp.", ".block_sparse_moe.")  # the Hub checkpoints' name
        if arch == "llama" and suffix == "weight" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            w = _reverse_llama_permute(w, heads)
        elif arch == "gemma3" and gguf_name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        yield hf_name, w


# transformers' skeleton stacks a layer's experts: gate_up_proj [E, 2I, H] and down_proj [E, H, I]
_FUSED_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<proj>gate_up|down)_proj$")
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
# gpt-oss's stacked expert tensors in transformers: gate_up [E, H, 2I] with gate and up columns alternating
# (its bias [E, 2I] too), down [E, I, H] (its bias [E, H]); llama.cpp splits gate and up, rows = outputs.
_GPT_OSS_EXPERTS = re.compile(
    r"^model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<proj>gate_up|down)_proj(?P<bias>_bias)?$"
)


def _gpt_oss_experts(header: GGUFHeader, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One of a gpt-oss layer's stacked expert tensors, in transformers' layout, from the file's
    ``ffn_{gate,up,down}_exps`` weights and biases."""
    m = _GPT_OSS_EXPERTS.match(hf_name)
    if m is None:
        raise GGUFError(f"{header.path}: no GGUF tensor for {hf_name}")
    suffix = "bias" if m["bias"] else "weight"
    parts = ("gate", "up") if m["proj"] == "gate_up" else ("down",)
    arrays = []
    for part in parts:
        info = header.tensors.get(f"blk.{m['bid']}.ffn_{part}_exps.{suffix}")
        if info is None:
            raise GGUFError(
                f"{header.path}: tensor blk.{m['bid']}.ffn_{part}_exps.{suffix} ({hf_name}) is missing"
            )
        arrays.append(dequantize(header, info))
    if len(parts) == 2:  # gate and up alternate along the outputs
        out = np.stack(arrays, axis=-1 if m["bias"] else 2)  # [E, I, 2, H] or [E, I, 2]
        out = (
            out.reshape(*arrays[0].shape[:1], -1)
            if m["bias"]
            else out.reshape(arrays[0].shape[0], -1, arrays[0].shape[2])
        )
    else:
        out = arrays[0]
    if not m["bias"]:
        out = out.swapaxes(1, 2)  # the file's [E, out, in] -> transformers' [E, in, out]
    if out.shape != shape:
        raise GGUFError(
            f"{header.path}: the experts of layer {m['bid']} give {list(out.shape)} for {hf_name}, but the "
            f"model's config needs {list(shape)}: wrong shape"
        )
    return np.ascontiguousarray(out)


def _expert_infos(header: GGUFHeader, layer: str, proj: str, shape: tuple[int, ...]) -> list[TensorInfo]:
    """The file's ``ffn_{gate,up}_exps`` (for a layer's gate_up ``[E, 2I, H]``) or ``ffn_down_exps``, checked
    against the shape the config gives."""
    n, rows, cols = shape
    parts = [("gate", rows // 2), ("up", rows // 2)] if proj == "gate_up" else [("down", rows)]
    blk = f"blk.{layer.rsplit('.', 1)[1]}"
    infos = []
    for part, part_rows in parts:
        gguf_name = f"{blk}.ffn_{part}_exps.weight"
        info = header.tensors.get(gguf_name)
        if info is None:
            raise GGUFError(f"{header.path}: tensor {gguf_name} (the layer's experts) is missing")
        if info.shape != (n, part_rows, cols):
            raise GGUFError(
                f"{header.path}: tensor {gguf_name} has shape {list(info.shape)}, but the model's config "
                f"needs {[n, part_rows, cols]}: wrong shape"
            )
        infos.append(info)
    return infos


def _expert_codes(
    header: GGUFHeader, layer: str, proj: str, shape: tuple[int, ...]
) -> Iterator[tuple[str, np.ndarray]]:
    """A layer's routed experts as block codes, stacked ``[E, rows, cols]`` as transformers stacks them
    (gate rows, then up rows): ``<layer>.mlp.experts.<gate_up|down>.codes`` (int8, or affine 4-bit codes
    two to a byte), ``.scales`` and, affine, ``.mins`` (float32, per block)."""
    parts = []
    for info in _expert_infos(header, layer, proj, shape):
        raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        parts.append(gguf_codes.unpack(raw, info.type_id, info.shape))
    name = f"{layer}.mlp.experts.{proj}"
    codes = np.concatenate([p.codes for p in parts], axis=1)
    yield f"{name}.codes", gguf_codes.pack_nibbles(codes) if parts[0].mins is not None else codes
    yield f"{name}.scales", np.concatenate([p.scales for p in parts], axis=1)
    if parts[0].mins is not None:
        yield f"{name}.mins", np.concatenate([p.mins for p in parts if p.mins is not None], axis=1)


def _experts(
    header: GGUFHeader, layer: str, proj: str, shape: tuple[int, ...], mixtral: bool
) -> Iterator[tuple[str, np.ndarray]]:
    """A layer's experts from the file's stacked ``ffn_{gate,up,down}_exps`` under the per-expert names of
    the Hub's checkpoints (Qwen-MoE's ``mlp.experts.<e>.gate_proj``, Mixtral's ``block_sparse_moe...w1``)."""
    n = shape[0]
    for info in _expert_infos(header, layer, proj, shape):
        part = info.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
        stacked = dequantize(header, info)
        for e in range(n):
            if mixtral:
                name = f"{layer}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[part]}.weight"
            else:
                name = f"{layer}.mlp.experts.{e}.{part}_proj.weight"
            yield name, stacked[e]
