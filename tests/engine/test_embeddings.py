"""engine.embed(): prefill-only requests through the same scheduler, pooled last-token, mean or CLS, against
a torch reference of the same pooling over transformers' final hidden states, on a tiny Llama in float32."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.errors import InvalidRequestError, RequestAbortedError
from tests.engine.test_parity import hf_greedy

LENGTHS = (1, 5, 17, 40, 75, 130)  # one token to several chunks of the small budget below


def _prompts(n: int = len(LENGTHS), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 49152, size=LENGTHS[i % len(LENGTHS)]).tolist() for i in range(n)]


def _reference(hf, prompt: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        states = hf.model(torch.tensor([prompt])).last_hidden_state[0].double()
    v = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    return (v / v.norm()).numpy()


def _engine(path, **kw) -> AsyncEngine:
    args = dict(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, block_size=8)
    return AsyncEngine(EngineArgs(**{**args, **kw}))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_the_reference_pooling_in_chunks(tiny_llama, pooling):
    path, hf = tiny_llama
    prompts = _prompts()

    async def run():
        async with _engine(path, pooling=pooling) as engine:
            batch = await engine.embed(prompts)
            single = [await engine.embed(p) for p in prompts]  # after the batch: prefix hits for "last"
            return batch, single

    batch, single = asyncio.run(run())
    for p, b, s in zip(prompts, batch, single, strict=True):
        want = _reference(hf, p, pooling)
        got = np.asarray(b.outputs.embedding)
        assert got.shape == want.shape and abs(np.linalg.norm(got) - 1) < 1e-5
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(s.outputs.embedding, got, atol=1e-5)  # a batch equals single requests
        assert b.prompt_token_ids == p
        # last-token pooling reads the cached prompt; mean and CLS recompute every position
        assert (s.num_cached_tokens > 0) == (pooling == "last" and len(p) > 8)


def test_equal_texts_give_identical_vectors_beside_generation(tiny_llama):
    """Embeddings and generation in the same steps: each as if alone."""
    path, hf = tiny_llama
    gen_prompts, texts = _prompts(4, seed=1), ["the same words twice", "other words"] * 3

    async def run():
        async with _engine(path, enable_prefix_caching=False) as engine:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            gens = [engine.generate(p, params) for p in gen_prompts]
            embeds = [engine.embed(t) for t in texts]
            outs = await asyncio.gather(*gens, *embeds)
            return outs[: len(gens)], outs[len(gens) :], engine.tokenizer

    gen_outs, embeds, tokenizer = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in gen_outs] == [hf_greedy(hf, p)[:8] for p in gen_prompts]
    vectors = [e.outputs.embedding for e in embeds]
    assert vectors[0] == vectors[2] == vectors[4] and vectors[1] == vectors[3] == vectors[5]
    assert vectors[0] != vectors[1]
    np.testing.assert_allclose(vectors[0], _reference(hf, tokenizer.encode(texts[0]), "last"), atol=1e-5)


def test_dimensions_truncate_and_renormalize(tiny_llama):
    path, _ = tiny_llama

    async def run():
        async with _engine(path) as engine:
            full = await engine.embed("a short text")
            cut = await engine.embed("a short text", dimensions=16)
            return full, cut, engine.embedding_size

    full, cut, size = asyncio.run(run())
    assert len(full.outputs.embedding) == size == 64 and len(cut.outputs.embedding) == 16
    head = np.asarray(full.outputs.embedding[:16])
    np.testing.assert_allclose(cut.outputs.embedding, head / np.linalg.norm(head), atol=1e-6)


def test_preempted_embeddings_still_pool_every_token(tiny_llama):
    """A pool too small for long generations beside long prompts to embed: preemption recomputes mean pools
    from their first token, and the generations stay greedy-exact."""
    path, hf = tiny_llama
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in rng.integers(90, 140, size=8)]
    gen_prompts = _prompts(4, seed=3)

    async def tokens(handle, decoding: asyncio.Event) -> list[int]:
        ids: list[int] = []
        async for delta in handle:
            ids += delta.outputs[0].token_ids
            if len(ids) >= 2:
                decoding.set()
        return ids

    async def run():
        async with _engine(path, pooling="mean", num_kv_blocks=48, max_num_batched_tokens=64) as engine:
            params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            decoding = [asyncio.Event() for _ in gen_prompts]
            gens = [
                asyncio.ensure_future(tokens(engine.generate(p, params), e))
                for p, e in zip(gen_prompts, decoding, strict=True)
            ]
            # the embeddings arrive while every generation is decoding (a wait on the clock raced a fast
            # engine, whose generations had finished by then)
            await asyncio.gather(*(e.wait() for e in decoding))
            outs = await asyncio.gather(engine.embed(prompts), *gens)
            return outs[0], outs[1:], engine.scheduler.num_preemptions_total

    outs, gen_ids, preemptions = asyncio.run(run())
    assert preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        np.testing.assert_allclose(o.outputs.embedding, _reference(hf, p, "mean"), atol=1e-5)
    want = [hf_greedy(hf, p) for p in gen_prompts]  # NEW_TOKENS of them
    assert [ids[: len(w)] for ids, w in zip(gen_ids, want, strict=True)] == want
    assert all(len(ids) == 60 for ids in gen_ids)


def test_bad_input_and_aborts_are_typed_errors(tiny_llama):
    path, _ = tiny_llama

    async def run():
        async with _engine(path, max_model_len=256) as engine:
            for bad, param in (
                ("", "input"),
                ([], "input"),
                ([[]], "input"),
                ([1, -3], "input"),
                ([1, 2**40], "input"),
                (["ok", 5], "input"),
                ({"a": 1}, "input"),
                ([7] * 300, "input"),
            ):
                with pytest.raises(InvalidRequestError) as e:
                    await engine.embed(bad)
                assert e.value.param == param, bad
            for dims in (0, 65, 2.5, "8"):
                with pytest.raises(InvalidRequestError) as e:
                    await engine.embed("text", dimensions=dims)
                assert e.value.param == "dimensions"
            task = asyncio.ensure_future(engine.embed([5] * 200, request_id="emb-abort"))
            await asyncio.sleep(0)
            assert await engine.abort("emb-abort")
            with pytest.raises(RequestAbortedError):
                await task
            assert engine.num_unfinished_requests() == 0
            return (await engine.embed("still serving")).outputs.embedding

    assert len(asyncio.run(run())) == 64


def test_pooling_comes_from_a_sentence_transformers_config(tmp_path):
    import json

    from aioengine.model.pooling import PoolingConfigError, pooling_of_checkpoint, resolve_pooling

    assert pooling_of_checkpoint(tmp_path) is None and resolve_pooling(None, str(tmp_path)) == "last"
    module = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (tmp_path / "modules.json").write_text(json.dumps([module]))
    (tmp_path / "1_Pooling").mkdir()
    config = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert resolve_pooling(None, str(tmp_path)) == "mean" and resolve_pooling("cls", str(tmp_path)) == "cls"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        pooling_of_checkpoint(tmp_path)
