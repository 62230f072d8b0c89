"""Sampling through the whole engine on a tiny random Llama: logprobs against the reference model, penalties
and biases against transformers' generate, seeds alone vs in a batch, dead ends, structured output."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, InvalidRequestError, SamplingParams
from aioengine.sampling_params import StructuredOutputsParams

EOS = 2
PROMPTS = [[5, 77, 901, 34, 12], [1000, 2000, 3000], [44] * 9, [7, 8, 9, 10, 11, 12, 13]]


def engine(path, **kw) -> AsyncEngine:
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("dtype", "float32")
    return AsyncEngine(EngineArgs(model=str(path), device="cpu", block_size=4, **kw))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def generate_all(path, prompts, params, **kw):
    async with engine(path, **kw) as eng:
        outs = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
        assert eng.kv_cache_usage() == 0.0
        return outs


def hf_generate(model, prompt, n, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def test_logprobs_and_prompt_logprobs_equal_the_reference_log_softmax(tiny_llama):
    path, hf = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    # chunked prefill: the 20-token prompt's logprobs come from several chunks
    prompts = PROMPTS + [list(range(300, 320))]
    outs = run(generate_all(path, prompts, params, max_num_batched_tokens=8))
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        full = prompt + c.token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full])).logits[0].float().log_softmax(-1)
        assert len(c.logprobs) == len(c.token_ids) == 6
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            row = ref[len(prompt) - 1 + j]
            assert list(lp)[0] == tok and abs(lp[tok].logprob - row[tok].item()) < 1e-4
            assert lp[tok].rank == int((row > row[tok]).sum()) + 1 == 1  # greedy: rank 1
            top = list(lp.items())
            assert [t for t, _ in top] == [tok] + [t for t in row.topk(5).indices.tolist() if t != tok][:4]
            values = [v.logprob for _, v in top]
            assert values == sorted(values, reverse=True)
            assert lp[tok].decoded_token is not None
        pl = out.prompt_logprobs
        assert pl is not None and len(pl) == len(prompt) and pl[0] is None
        for p in range(1, len(prompt)):
            row = ref[p - 1]
            entry = pl[p]
            tok = prompt[p]
            assert list(entry)[0] == tok and abs(entry[tok].logprob - row[tok].item()) < 1e-4
            assert entry[tok].rank == int((row > row[tok]).sum()) + 1
            assert len(entry) <= 4


def test_streamed_logprobs_add_up_to_the_final_ones(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with engine(path) as eng:
            params = SamplingParams(
                temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=0
            )
            final = await eng.generate(PROMPTS[0], params)
            streamed, prompt_lps = [], []
            async for d in eng.generate(PROMPTS[0], params):
                streamed += d.outputs[0].logprobs
                if d.prompt_logprobs is not None:
                    prompt_lps.append(d.prompt_logprobs)
            assert streamed == final.outputs[0].logprobs and len(streamed) == 5
            assert prompt_lps == [final.prompt_logprobs]

    run(main())


@pytest.mark.parametrize(
    "kw,hf_kw",
    [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
        (dict(logit_bias={123: 6.0, 456: 4.0}), dict(sequence_bias={(123,): 6.0, (456,): 4.0})),
        (dict(min_tokens=4, logit_bias={EOS: 100.0}), dict(min_new_tokens=4, sequence_bias={(EOS,): 100.0})),
    ],
)
def test_greedy_with_penalties_and_bias_matches_transformers(tiny_llama, kw, hf_kw):
    path, hf = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=8, **kw)
    outs = run(generate_all(path, PROMPTS, params))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = hf_generate(hf, prompt, 8, eos_token_id=EOS, **hf_kw)
        assert out.outputs[0].token_ids == expected[: len(out.outputs[0].token_ids)] and (
            len(out.outputs[0].token_ids) == len(expected)
            or expected[len(out.outputs[0].token_ids) - 1] == EOS
        )
    if "min_tokens" in kw:  # EOS is +100 once allowed: exactly min_tokens tokens, then EOS
        assert all(o.outputs[0].token_ids[4:] == [EOS] and o.outputs[0].finish_reason == "stop" for o in outs)


def test_presence_and_frequency_penalties_match_a_reference_loop(tiny_llama):
    path, hf = tiny_llama
    kw = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.2)
    prompts = PROMPTS[:2]
    outs = run(
        generate_all(path, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw))
    )
    for prompt, out in zip(prompts, outs, strict=True):
        seq, gen = list(prompt), []
        for _ in range(6):
            with torch.no_grad():
                logits = hf(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=logits.numel()).float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(seq)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / 1.2, logits * 1.2), logits)
            logits = logits - 0.7 * counts - 1.5 * (counts > 0).float()
            gen.append(int(logits.argmax()))
            seq.append(gen[-1])
        assert out.outputs[0].token_ids == gen


def test_bad_words_and_allowed_token_ids(tiny_llama):
    path, hf = tiny_llama

    async def main():
        async with engine(path) as eng:
            plain = await eng.generate(
                PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            )
            word = eng.tokenizer.decode(plain.outputs[0].token_ids[2:3])
            banned = await eng.generate(
                PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
            )
            ids = SamplingParams(bad_words=[word]).bad_words_to_token_ids(eng.tokenizer)
            allowed = await eng.generate(
                PROMPTS[1],
                SamplingParams(
                    temperature=1.0, max_tokens=10, ignore_eos=True, allowed_token_ids=[40, 41, 42]
                ),
            )
            return plain.outputs[0].token_ids, banned.outputs[0].token_ids, ids, allowed.outputs[0].token_ids

    plain, banned, ids, allowed = run(main())
    assert banned != plain and banned[:2] == plain[:2]
    assert all([t] not in ids for t in banned)
    assert banned == hf_generate(hf, PROMPTS[0], 8, bad_words_ids=[i for i in ids if len(i) == 1])
    assert set(allowed) <= {40, 41, 42}


def test_same_seed_same_tokens_alone_or_in_a_batch_of_16_with_every_knob(tiny_llama):
    """float32: batch shapes change no logit bit that matters. In bf16 the logits are rounded to 8 mantissa
    bits (0.06 at a logit of 10) and hidden states move by an ulp with the GEMM shapes, so a sampled token
    can flip between batch shapes; bf16's promise is the same tokens for the same batch (next test)."""
    path, _ = tiny_llama
    dtype = "float32"
    params = SamplingParams(
        temperature=0.8,
        seed=77,
        max_tokens=10,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={99: 3.0},
        logprobs=2,
        bad_words=["the"],
        top_k=40,
        top_p=0.95,
        min_p=0.01,
    )
    prompt = PROMPTS[0]

    async def main():
        async with engine(path, dtype=dtype) as eng:
            alone = await eng.generate(prompt, params)
            others = [
                eng.generate(
                    PROMPTS[i % 4] + [i],
                    SamplingParams(
                        temperature=1.0,
                        max_tokens=6 + i % 7,
                        presence_penalty=0.1 * (i % 3),
                        logprobs=i % 3 or None,
                        seed=i if i % 2 else None,
                    ),
                )
                for i in range(15)
            ]
            batched, *_ = await asyncio.gather(eng.generate(prompt, params), *others)
            return alone.outputs[0], batched.outputs[0]

    alone, batched = run(main())
    assert alone.token_ids == batched.token_ids
    assert [list(d) for d in alone.logprobs] == [list(d) for d in batched.logprobs]


def test_same_seed_same_batch_same_tokens_in_bfloat16(tiny_llama):
    path, _ = tiny_llama
    params = [
        SamplingParams(
            temperature=0.9,
            seed=100 + i,
            max_tokens=8 + i % 5,
            ignore_eos=True,
            logprobs=1,
            presence_penalty=0.1 * (i % 3),
            top_p=0.9 if i % 2 else 1.0,
        )
        for i in range(12)
    ]

    async def main():
        async with engine(path, dtype="bfloat16") as eng:
            runs = []
            for _ in range(2):
                outs = await asyncio.gather(
                    *(eng.generate(PROMPTS[i % 4] + [i], p) for i, p in enumerate(params))
                )
                runs.append([o.outputs[0].token_ids for o in outs])
            return runs

    first, second = run(main())
    assert first == second
    assert len({tuple(t) for t in first}) > 6  # the seeds differ, so do the samples


def test_a_dead_end_finishes_with_a_clear_reason_never_hangs(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with engine(path) as eng:
            out = await eng.generate(
                PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[EOS])
            )
            c = out.outputs[0]
            assert c.finish_reason == "error" and c.stop_reason == "no_allowed_tokens" and c.token_ids == []
            assert eng.kv_cache_usage() == 0.0
            ok = await eng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            assert len(ok.outputs[0].token_ids) == 3

    run(main())


def test_a_complete_grammar_under_min_tokens_is_a_dead_end(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with engine(path) as eng:
            so = StructuredOutputsParams(choice=["alpha", "beta"])
            out = await eng.generate(
                PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, min_tokens=6, structured_outputs=so)
            )
            c = out.outputs[0]  # the grammar wants EOS after the word, min_tokens forbids it
            assert (c.finish_reason, c.stop_reason) == ("error", "no_allowed_tokens") and c.text in so.choice
            ok = await eng.generate(
                PROMPTS[0],
                SamplingParams(temperature=0, max_tokens=10, structured_outputs=so, ignore_eos=True),
            )
            assert ok.outputs[0].finish_reason == "stop" and ok.outputs[0].text in so.choice

    run(main())


def test_invalid_params_raise_typed_errors_at_generate(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with engine(path) as eng:
            cases = {
                "logit_bias": SamplingParams(logit_bias={10**6: 1.0}),
                "allowed_token_ids": SamplingParams(allowed_token_ids=[-1]),
                "structured_outputs": SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")),
            }
            for param, p in cases.items():
                with pytest.raises(InvalidRequestError) as e:
                    eng.generate(PROMPTS[0], p)
                assert e.value.param == param
            for bad in ({"type": "nope"}, "{not json"):
                with pytest.raises(InvalidRequestError, match="Invalid JSON schema"):
                    eng.generate(
                        PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(json=bad))
                    )
            with pytest.raises(InvalidRequestError, match='Rule "nope" is not defined'):
                eng.chat(
                    [{"role": "user", "content": "hi"}],
                    SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= nope")),
                )
            assert eng.scheduler.get_num_unfinished_requests() == 0 and eng.num_unfinished_requests() == 0

    run(main())


def test_structured_requests_defer_sampling_and_stay_valid_beside_unconstrained_ones(tiny_llama):
    """A random model only emits valid text if every bitmask saw every earlier token: with async
    scheduling that needs the deferral of stop 8. Few KV blocks also force preemptions."""
    path, _ = tiny_llama
    regex = r"[a-c]{2,4}-[0-9]{2}"
    choices = ["alpha", "beta gamma", "delta"]

    async def main():
        async with engine(path, num_kv_blocks=1 + 20) as eng:
            plain_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            alone = [(await eng.generate(p, plain_params)).outputs[0].token_ids for p in PROMPTS]
            pending = {"n": 0}
            schedule = eng.scheduler.schedule

            def counting_schedule():
                so = schedule()
                pending["n"] += so.pending_structured_output_tokens
                return so

            eng.scheduler.schedule = counting_schedule
            structured = []
            for i in range(8):
                so = (
                    StructuredOutputsParams(regex=regex) if i % 2 else StructuredOutputsParams(choice=choices)
                )
                structured.append(
                    eng.generate(
                        PROMPTS[i % 4] + [i] * 3,
                        SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=so),
                    )
                )
            plain = [eng.generate(p, plain_params) for p in PROMPTS]
            outs = await asyncio.gather(*structured, *plain)
            return alone, outs, pending["n"], eng.scheduler.num_preemptions_total

    alone, outs, num_deferred, num_preemptions = run(main())
    for i, out in enumerate(outs[:8]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.stop_reason, c.text)
        assert re.fullmatch(regex, c.text) if i % 2 else c.text in choices
    assert [o.outputs[0].token_ids for o in outs[8:]] == alone  # unconstrained requests are unaffected
    assert num_deferred > 0 and num_preemptions > 0
