"""A start that fails raises the model's own error and leaves nothing behind: no tokenizer thread still
loading beside it, no future whose error is left to the event loop's logger."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import transformers

from aioengine import AsyncEngine, EngineArgs
from aioengine.engine import startup
from tests.engine.conftest import SMALL


def test_a_failed_model_load_waits_for_the_tokenizer_thread_and_raises_its_own_error(tmp_path, monkeypatch):
    transformers.LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]).save_pretrained(
        tmp_path
    )  # no weights
    done: list[float] = []

    def slow_failing_tokenizer(*_args):
        time.sleep(0.5)  # still loading when the model's load fails
        done.append(time.monotonic())
        raise ValueError("no tokenizer here")

    monkeypatch.setattr(startup, "load_engine_tokenizer", slow_failing_tokenizer)
    reports: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reports.append(ctx))
        with pytest.raises(FileNotFoundError, match="model.safetensors"):
            async with AsyncEngine(EngineArgs(model=str(tmp_path), dtype="float32")):
                pass
        assert done and done[0] <= time.monotonic(), "the start raised while its tokenizer thread still ran"

    asyncio.run(main())
    gc.collect()  # a future dropped with its error unretrieved reports it when collected
    assert reports == []


def test_an_unsupported_architecture_fails_the_start_naming_the_supported_ones(tmp_path):
    transformers.LlamaConfig(**SMALL, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(tmp_path)

    async def main():
        async with AsyncEngine(EngineArgs(model=str(tmp_path), dtype="float32")):
            pass

    with pytest.raises(ValueError, match="unsupported model architectures.*MixtralForCausalLM"):
        asyncio.run(main())
