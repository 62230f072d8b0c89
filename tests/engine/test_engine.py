"""AsyncEngine behaviour: streaming, aborts, errors, seeds, stop strings, the dead state, default model."""

from __future__ import annotations

import asyncio
import random

import pytest

from aioengine import (
    AsyncEngine,
    EngineArgs,
    EngineDeadError,
    EngineNotStartedError,
    InvalidRequestError,
    SamplingParams,
)
from aioengine.model.tokenizer import IncrementalDetokenizer


def tiny_args(path, **kw) -> EngineArgs:
    return EngineArgs(model=str(path), block_size=4, max_num_batched_tokens=64, **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_stream_deltas_add_up_to_the_final_output(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            final = await engine.generate("Hello there, how are you?", params)
            text, ids, n_deltas = "", [], 0
            async for delta in engine.generate("Hello there, how are you?", params):
                n_deltas += 1
                text += delta.outputs[0].text
                ids += delta.outputs[0].token_ids
                last = delta
            assert last.finished and last.outputs[0].finish_reason == "length"
            assert ids == final.outputs[0].token_ids and len(ids) == 12
            assert text == final.outputs[0].text == engine.tokenizer.decode(ids, skip_special_tokens=True)
            assert n_deltas >= 2

    run(main())


def test_aborts_free_every_block(tiny_llama):
    path, _ = tiny_llama
    rng = random.Random(0)

    async def consume(engine, i):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(5, 30), ignore_eos=True)
        prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(4, 60))]
        handle = engine.generate(prompt, params, request_id=f"r{i}")
        mode = rng.random()
        if mode < 0.3:  # leave the stream early: aborts
            async for _delta in handle:
                if rng.random() < 0.3:
                    break
            return "left"
        if mode < 0.6:  # abort by id at a random point
            task = asyncio.ensure_future(handle)
            await asyncio.sleep(rng.random() * 0.05)
            await engine.abort(f"r{i}")
            out = await task
            return out.outputs[0].finish_reason
        out = await handle
        assert len(out.outputs[0].token_ids) == params.max_tokens
        return "done"

    async def main():
        async with AsyncEngine(tiny_args(path, num_kv_blocks=1 + 200)) as engine:
            results = await asyncio.gather(*(consume(engine, i) for i in range(100)))
            for _ in range(100):  # aborts inside a step finish with it: let the loop drain
                if engine.num_unfinished_requests() == 0 and not engine.scheduler.has_requests():
                    break
                await asyncio.sleep(0.01)
            assert engine.kv_cache_usage() == 0.0
            assert not engine.scheduler.kv_cache_manager.req_to_blocks
            assert "abort" in results and "done" in results and "left" in results
            # The engine still serves after all that.
            out = await engine.generate(
                [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            )
            assert len(out.outputs[0].token_ids) == 3

    run(main())


def test_bad_input_raises_typed_errors_before_scheduling(tiny_llama):
    path, _ = tiny_llama

    async def main():
        engine = AsyncEngine(tiny_args(path, max_model_len=64))
        with pytest.raises(EngineNotStartedError):
            engine.generate("hi")
        async with engine:
            cases = [
                lambda: engine.generate("", SamplingParams()),
                lambda: engine.generate([], SamplingParams()),
                lambda: engine.generate([1] * 64, SamplingParams(max_tokens=1)),
                lambda: engine.generate([1] * 60, SamplingParams(max_tokens=10)),
                lambda: engine.generate([10**9], SamplingParams()),
                lambda: engine.generate([-1], SamplingParams()),
                lambda: engine.generate(None, SamplingParams()),
                lambda: engine.chat([], SamplingParams()),
                lambda: engine.chat([{"content": "no role"}], SamplingParams()),
                lambda: engine.generate("a\ud800b", SamplingParams()),  # a lone surrogate: no UTF-8
                lambda: engine.chat([{"role": "user", "content": "a\ud800b"}], SamplingParams()),
                lambda: SamplingParams(temperature=-1),
                lambda: SamplingParams(top_p=0),
                lambda: SamplingParams(max_tokens=0),
                lambda: SamplingParams(n=0),
                lambda: SamplingParams(n=2, temperature=0),
                lambda: SamplingParams(logprobs=21),
            ]
            for make in cases:
                with pytest.raises(InvalidRequestError):
                    make()
            assert engine.scheduler.get_num_unfinished_requests() == 0
            with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens"):
                engine.generate([1] * 60, SamplingParams(max_tokens=10))
            h = engine.generate([1, 2], SamplingParams(max_tokens=2), request_id="same")
            with pytest.raises(InvalidRequestError):
                engine.generate([1, 2], SamplingParams(max_tokens=2), request_id="same")
            await h

    run(main())


def test_same_seed_same_tokens_alone_or_in_a_batch(tiny_llama):
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            alone = (await engine.generate(prompt, params)).outputs[0].token_ids
            others = [
                engine.generate([20 + i] * (3 + i), SamplingParams(temperature=1.0, max_tokens=12))
                for i in range(15)
            ]
            batched = engine.generate(prompt, params)
            results = await asyncio.gather(batched, *others)
            unseeded = await engine.generate(
                prompt, SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)
            )
            return alone, results[0].outputs[0].token_ids, unseeded.outputs[0].token_ids

    alone, batched, unseeded = run(main())
    assert alone == batched
    assert unseeded != alone  # sampling is really random without the seed (12 tokens: collision ~ impossible)


def test_n_completions_share_the_prompt(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            out = await engine.generate(
                list(range(100, 140)),
                SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True),
            )
            assert [c.index for c in out.outputs] == [0, 1, 2]
            assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
            assert engine.scheduler.kv_cache_manager.total_prefix_cache.hits > 0

    run(main())


def test_exception_in_a_step_kills_the_engine_cleanly(tiny_llama):
    path, _ = tiny_llama

    async def main():
        engine = AsyncEngine(tiny_args(path))
        await engine.start()
        handles = [
            engine.generate([5 + i] * 8, SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(4)
        ]
        steps = {"n": 0}

        def hook(where, so):
            if where == "execute_model":
                steps["n"] += 1
                if steps["n"] == 5:
                    raise RuntimeError("injected fault")

        engine.runner.fault_hook = hook
        for h in handles:
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(h, 5)
        assert engine.dead_error is not None and not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.generate([1, 2, 3])
        await asyncio.wait_for(engine.shutdown(), 5)

    run(main())


def test_watchdog_marks_a_hung_step_dead(tiny_llama):
    path, _ = tiny_llama

    async def main():
        engine = AsyncEngine(tiny_args(path, step_timeout_s=0.5))
        await engine.start()
        import time

        engine.runner.fault_hook = lambda where, so: time.sleep(1.5) if where == "sample_tokens" else None
        with pytest.raises(EngineDeadError, match="watchdog"):
            await asyncio.wait_for(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)), 5)
        await asyncio.wait_for(engine.shutdown(), 5)

    run(main())


def test_stop_strings_never_reach_the_output(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            full = (await engine.generate("Once upon a time", params)).outputs[0].text
            assert len(full) > 10
            stop = full[5:9]
            out = await engine.generate(
                "Once upon a time", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
            )
            c = out.outputs[0]
            assert c.finish_reason == "stop" and c.stop_reason == stop
            assert c.text == full[: full.index(stop)]
            streamed = ""
            async for d in engine.generate(
                "Once upon a time",
                SamplingParams(
                    temperature=0,
                    max_tokens=20,
                    ignore_eos=True,
                    stop=[stop],
                    include_stop_str_in_output=True,
                ),
            ):
                streamed += d.outputs[0].text if d.outputs else ""
            assert streamed == full[: full.index(stop) + len(stop)]
            assert engine.kv_cache_usage() == 0.0

    run(main())


class _ByteTokenizer:
    """Each token is one UTF-8 byte: multi-byte characters span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_multibyte_character():
    text = "héllo → 世界 🎉!"
    data = list(text.encode())
    detok = IncrementalDetokenizer(_ByteTokenizer(), list(b"ab"), stop=[])
    pieces = [detok.add_tokens([b], finished=False) for b in data]
    pieces.append(detok.add_tokens([], finished=True))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_holds_back_a_stop_string_spanning_tokens():
    detok = IncrementalDetokenizer(_ByteTokenizer(), [], stop=["STOP"])
    out = "".join(detok.add_tokens([b], finished=False) for b in b"abcSTdefSTOPxyz")
    assert out == "abcSTdef" and detok.stop_reason == "STOP"


def test_default_model_knows_the_capital_of_france():
    async def main():
        async with AsyncEngine(EngineArgs(model="default", max_model_len=2048)) as engine:
            out = await engine.chat(
                [{"role": "user", "content": "What is the capital of France?"}],
                SamplingParams(temperature=0, max_tokens=30),
            )
            return out.outputs[0].text

    text = asyncio.run(main())
    assert "Paris" in text, text


def test_handle_abort_and_stats_count_every_scheduled_token(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            scheduled = []
            engine.stat_listeners.append(lambda stats, outputs: scheduled.append(stats.num_scheduled_tokens))
            await engine.generate(
                list(range(3, 103)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            )
            # 100 prompt tokens in chunks of 64, then 7 decodes: the last token is never fed back.
            assert sum(scheduled) == 100 + 7
            h = engine.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
            h.abort()
            out = await h
            assert out.outputs[0].finish_reason == "abort"
            assert engine.num_unfinished_requests() == 0

    run(main())


def test_chat_template_flag_replaces_the_tokenizers(tiny_llama, tmp_path):
    from aioengine.model.tokenizer import read_chat_template

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template == read_chat_template(template)
    for bad in ("{% for m in messages %}", str(tmp_path / "missing.jinja")):
        with pytest.raises(ValueError, match="chat_template"):
            read_chat_template(bad)

    async def main():
        async with AsyncEngine(
            EngineArgs(model=str(tiny_llama[0]), dtype="float32", chat_template=str(path))
        ) as eng:
            out = await eng.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))
            return out.prompt_token_ids, eng.tokenizer

    ids, tok = asyncio.run(main())
    assert ids == tok("[user] hi\n[assistant]", add_special_tokens=False)["input_ids"]


def test_generation_config_supplies_default_sampling_parameters(tiny_llama, tmp_path):
    """vLLM's --generation-config auto: the model's sampling defaults fill what a request leaves out."""
    import json
    import shutil

    from aioengine.http.openai.chat import parse_chat_request
    from aioengine.http.openai.completions import parse_completion_request

    model = tmp_path / "model"
    shutil.copytree(tiny_llama[0], model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(
        json.dumps({**gen, "temperature": 0.0, "top_k": 7, "do_sample": True, "max_length": 99})
    )

    async def main(source: str):
        async with AsyncEngine(
            EngineArgs(model=str(model), dtype="float32", generation_config=source)
        ) as eng:
            prompt = list(range(5, 25))
            outs = [await eng.generate(prompt, None) for _ in range(2)]
            return eng.default_sampling_params, [o.outputs[0].token_ids for o in outs]

    defaults, (a, b) = asyncio.run(main("auto"))
    assert defaults == {"temperature": 0.0, "top_k": 7}
    assert a == b  # greedy by default now
    assert asyncio.run(main("vllm"))[0] == {}
    chat = parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}, defaults=defaults
    )
    assert (chat.params.temperature, chat.params.top_k, chat.params.top_p) == (0.0, 7, 0.5)
    comp = parse_completion_request({"prompt": "x", "temperature": 0.8}, defaults=defaults)
    assert (comp.params.temperature, comp.params.top_k) == (0.8, 7)  # the request's own values win
    with pytest.raises(ValueError, match="generation_config"):
        asyncio.run(main(str(tmp_path / "nowhere")))


def test_a_prefix_cache_hit_gives_the_same_bits_in_bfloat16():
    """The same prompts twice on the default model in bf16: the second run reads the first's cached blocks and
    recomputes only the tail (for the 33-token prompt, its last token alone), yet every logprob is equal."""
    from aioengine.model.tokenizer import load_tokenizer

    async def main():
        async with AsyncEngine(EngineArgs(model="default", dtype="bfloat16", max_model_len=512)) as eng:
            tok = load_tokenizer(eng.model_path)
            text = (
                "The history of computing is a story of abstraction layers, from relays to transistors. " * 4
            )
            prompts = [tok.encode(text)[:33], tok.encode(text)[:45], tok.encode(text)[3:70]]
            params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
            runs = []
            for _ in range(2):
                outs = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
                runs.append(
                    [
                        (
                            o.num_cached_tokens,
                            o.outputs[0].token_ids,
                            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
                        )
                        for o in outs
                    ]
                )
            return runs

    first, second = asyncio.run(main())
    assert first[0][0] == 0 and second[0][0] == 32 and all(c > 0 for c, _, _ in second)
    assert [(ids, lps) for _, ids, lps in first] == [(ids, lps) for _, ids, lps in second]


def test_an_awaited_request_gets_one_wakeup_and_the_same_output_as_a_stream(tiny_llama):
    """Awaiting generate() (vLLM's FINAL_ONLY) buffers the deltas for the final output instead of waking the
    consumer every step; a request listener (the server's metrics) still sees every step's output, and the
    awaited consumer is still woken once."""
    path, _ = tiny_llama
    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=11,
        max_tokens=10,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
        stop=["zz"],
    )

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            puts = []

            def counting(handle):
                queue = handle._state.queue
                put = queue.put_nowait
                queue.put_nowait = lambda item: (puts.append(item), put(item))[1]
                return handle

            awaited = await counting(engine.generate("Hello there", params))
            assert len(puts) == 1
            texts, ids, lps = ["", ""], [[], []], [[], []]
            async for delta in engine.generate("Hello there", params):
                for c in delta.outputs:
                    texts[c.index] += c.text
                    ids[c.index] += c.token_ids
                    lps[c.index] += c.logprobs
            for c in awaited.outputs:
                assert (c.text, c.token_ids, c.logprobs) == (texts[c.index], ids[c.index], lps[c.index])
                assert len(c.token_ids) == 10 and c.finish_reason == "length"
            assert awaited.prompt_logprobs is not None and awaited.finished

            seen = []
            engine.request_listeners.append(lambda out, state: seen.append(out))
            puts.clear()
            again = await counting(engine.generate("Hello there", params))
            assert len(puts) == 1 and len(seen) > 2  # woken once; the listener saw each step
            assert [d.outputs for d in seen[:-1]] != [again.outputs] * (
                len(seen) - 1
            )  # deltas, not the final
            streamed = {i: "".join(c.text for d in seen for c in d.outputs if c.index == i) for i in range(2)}
            assert streamed == {c.index: c.text for c in again.outputs}
            assert [(c.text, c.token_ids) for c in again.outputs] == [
                (c.text, c.token_ids) for c in awaited.outputs
            ]

            # A listener that arrives mid-request (an app built on a running engine): the kept deltas still
            # come first, so the final text is in order.
            engine.request_listeners.clear()
            steps = []

            def arrive_after_three_steps(stats, outputs):
                steps.append(stats)
                if len(steps) == 3:
                    engine.request_listeners.append(lambda out, state: None)

            engine.stat_listeners.append(arrive_after_three_steps)
            late = await engine.generate("Hello there", params)
            assert engine.request_listeners, "the listener should have arrived during the request"
            assert [(c.text, c.token_ids) for c in late.outputs] == [
                (c.text, c.token_ids) for c in awaited.outputs
            ]

    run(main())


def test_start_moves_what_startup_built_out_of_the_collectors_reach(tiny_llama):
    """A full collection walking torch's and the model's objects paused the loop for 155 ms mid-run."""
    import gc

    path, _ = tiny_llama

    async def main():
        gc.unfreeze()
        async with AsyncEngine(tiny_args(path)):
            assert gc.get_freeze_count() > len(
                gc.get_objects()
            )  # most objects now sit in the permanent generation
        assert gc.get_freeze_count() == 0  # and go back once no engine runs: exit collects them as before

    run(main())


def test_precompile_hands_its_grammar_to_generate(tiny_llama):
    """The server compiles a request's grammar off the loop (precompile) and passes it on: generate does
    not compile (nor look up) it again; without it, generate compiles it itself (here a cache hit)."""
    from aioengine.sampling_params import StructuredOutputsParams

    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(tiny_args(path)) as engine:
            params = SamplingParams(
                temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="[ab]{3}")
            )
            assert await engine.precompile(SamplingParams(max_tokens=5)) is None  # no grammar, nothing to do
            grammar = await engine.precompile(params)
            assert grammar is not None and grammar.spec is params.structured_outputs
            manager = engine._structured_output_manager()
            lookups = manager.cache_hits + manager.cache_misses
            assert (await engine.generate("Hello", params, grammar=grammar)).finished
            assert manager.cache_hits + manager.cache_misses == lookups
            assert (await engine.generate("Hello", params)).finished
            assert manager.cache_hits + manager.cache_misses == lookups + 1

    run(main())


def test_a_failed_start_leaves_no_worker_thread(tiny_llama):
    """A start-up step that fails (here: a KV cache of one block) raises, and the worker it made is gone."""
    import threading

    path, _ = tiny_llama

    def step_threads() -> int:
        return sum(t.name.startswith("aioengine-step") and t.is_alive() for t in threading.enumerate())

    async def main():
        before = step_threads()
        with pytest.raises(ValueError, match="at least 2"):
            await AsyncEngine(tiny_args(path, num_kv_blocks=1)).start()
        return before, step_threads()

    before, after = run(main())
    assert after == before
