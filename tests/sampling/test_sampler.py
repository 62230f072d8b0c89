"""The sampler on known logits: each penalty, bias and mask moves the logits exactly as its formula says
(checked against transformers' logits processors where one exists); device-side counts follow samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from aioengine.gpu.cpu.backend import CpuOps, CpuStaging
from aioengine.gpu.sampler import (
    Sampler,
    SamplingMetadata,
    apply_constraints,
    apply_grammar_bitmask,
    apply_penalties,
    apply_top_k_top_p_min_p,
    gather_logprobs,
    top_k_top_p_candidates,
    unpack_bitmask,
)
from aioengine.gpu.states import RequestStates
from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import NewRequestData

V = 64
EOS = 2
# The CPU backend's sampler: these tests cover its candidate top-p path and its grammar check.
CPU_SAMPLER = dict(ops=CpuOps(), top_p_from_candidates=True, grammar_check_argmax_first=True)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is fastest, and immune to OpenMP barriers stalling on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_states(*params: SamplingParams, prompts=None, outputs=None) -> RequestStates:
    states = RequestStates(8, 128, 32, CPU, vocab_size=V, staging=CpuStaging())
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [10, 11, 12, 10]
        out = outputs[i] if outputs else []
        states.add(NewRequestData(f"r{i}", prompt + out, p, [], 0, len(prompt), EOS))
    return states


def processed(states: RequestStates, logits: torch.Tensor) -> torch.Tensor:
    """The logits after masks, bias and penalties (what greedy takes the argmax of)."""
    md = states.sampling_metadata(np.arange(logits.shape[0]))
    x = logits.clone()
    apply_constraints(x, md)
    if md.penalties is not None:
        apply_penalties(x, md.penalties)
    return x


def feed(states: RequestStates, *tokens: int) -> None:
    """What sample_tokens does after each sampling: device state follows the sampled tokens."""
    states.update_after_sample(np.arange(len(tokens)), torch.tensor(tokens))


def logits_for(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    prompt, out = [10, 11, 12, 10], [20, 21]
    states = make_states(
        SamplingParams(temperature=0, repetition_penalty=1.7), prompts=[prompt], outputs=[out]
    )
    feed(states, 22)
    feed(states, 20)
    logits = logits_for()
    ids = torch.tensor([prompt + out + [22, 20]])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    torch.testing.assert_close(processed(states, logits), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("presence,frequency", [(0.8, 0.0), (0.0, 0.6), (-0.5, 1.5), (2.0, -2.0)])
def test_presence_and_frequency_penalties_follow_the_openai_formula_over_outputs_only(presence, frequency):
    prompt = [30, 31, 30]  # the prompt is not penalised by presence/frequency
    states = make_states(
        SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency),
        prompts=[prompt],
        outputs=[[5, 6]],
    )
    sampled = [5, 7, 5]
    for t in sampled:
        feed(states, t)
    logits = logits_for()
    counts = torch.bincount(torch.tensor([5, 6] + sampled), minlength=V).float()
    expected = logits - frequency * counts - presence * (counts > 0).float()
    torch.testing.assert_close(
        processed(states, logits), expected.unsqueeze(0) if expected.dim() == 1 else expected
    )
    assert processed(states, logits)[0, 30] == logits[0, 30]


def test_penalties_move_the_greedy_argmax_exactly_when_the_formula_says():
    logits = torch.full((1, V), -5.0)
    logits[0, 40], logits[0, 41] = 3.0, 2.5  # 40 wins by 0.5
    for penalty, winner in ((0.4, 40), (0.6, 41)):
        states = make_states(SamplingParams(temperature=0, presence_penalty=penalty))
        feed(states, 40)  # 40 was generated once: presence moves it down by `penalty`
        md = states.sampling_metadata(np.arange(1))
        assert Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), md).sampled.item() == winner


def test_logit_bias_matches_transformers_sequence_bias_and_is_clamped():
    params = SamplingParams(temperature=0, logit_bias={3: 2.5, "9": -1.25, 17: 1e9})
    assert params.logit_bias == {3: 2.5, 9: -1.25, 17: 100.0}
    states = make_states(params)
    logits = logits_for()
    expected = SequenceBiasLogitsProcessor({(3,): 2.5, (9,): -1.25, (17,): 100.0})(
        torch.tensor([[10, 11, 12, 10]]), logits.clone()
    )
    torch.testing.assert_close(processed(states, logits), expected)
    assert (
        Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), states.sampling_metadata(np.arange(1))).sampled.item()
        == 17
    )


def test_min_tokens_masks_eos_and_stop_ids_like_transformers_until_reached():
    states = make_states(
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True, stop_token_ids=[7]),
    )
    logits = logits_for(2)
    prompt_len = 4
    for step in range(5):
        x = processed(states, logits)
        ids = torch.tensor([[10, 11, 12, 10] + [1] * step])
        hf = MinNewTokensLengthLogitsProcessor(prompt_len, 3, [EOS, 7])(ids, logits[:1].clone())
        torch.testing.assert_close(x[:1], hf)
        assert (x[0, [EOS, 7]] == -np.inf).all() == (step < 3)
        assert x[1, EOS] == logits[1, EOS]  # ignore_eos: EOS is not a stop token, only 7 is masked
        assert (x[1, 7] == -np.inf) == (step < 3)
        feed(states, 1, 1)


def test_bad_words_single_and_multi_token_match_transformers_over_the_output():
    bad = [[5], [8, 9], [8, 9, 10]]
    params = SamplingParams(temperature=0, bad_words=["unused"])
    params.bad_words_token_ids = bad
    states = make_states(params)
    logits = logits_for()
    history: list[int] = []
    for t in [8, 9, 4, 8, 3, 8, 9]:
        x = processed(states, logits)
        ids = torch.tensor([history]) if history else torch.zeros((1, 0), dtype=torch.long)
        expected = NoBadWordsLogitsProcessor(bad, eos_token_id=EOS)(ids, logits.clone()) if history else None
        if expected is not None:
            torch.testing.assert_close(x, expected)
        assert x[0, 5] == -np.inf
        assert (x[0, 9] == -np.inf) == (history[-1:] == [8])
        assert (x[0, 10] == -np.inf) == (history[-2:] == [8, 9])
        feed(states, t)
        history.append(t)


def test_allowed_token_ids_leave_only_those():
    states = make_states(
        SamplingParams(temperature=0, allowed_token_ids=[4, 9, 33]), SamplingParams(temperature=0)
    )
    logits = logits_for(2)
    x = processed(states, logits)
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [4, 9, 33]
    torch.testing.assert_close(x[1], logits[1])
    md = states.sampling_metadata(np.arange(2))
    for _ in range(5):
        md = states.sampling_metadata(np.arange(2))
        md.temperature = torch.ones(2)
        md.all_greedy = False
        assert Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), md).sampled[0].item() in (4, 9, 33)


def test_grammar_bitmask_unpacks_bit_j_of_word_w_to_token_32w_plus_j():
    allowed = [0, 5, 31, 32, 63]
    words = np.zeros((1, 2), dtype=np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    bitmask = torch.from_numpy(words.view(np.int32))
    assert unpack_bitmask(bitmask, V)[0].nonzero().flatten().tolist() == allowed
    states = make_states(SamplingParams(temperature=0, logprobs=2))
    md = states.sampling_metadata(np.arange(1))
    md.grammar = ([0], bitmask)
    logits = logits_for()
    out = Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), md)
    assert out.sampled.item() == allowed[int(logits[0, allowed].argmax())]
    # logprobs are taken after the grammar mask: a disallowed token has logprob -inf
    ids, lps, _ = out.logprobs
    assert set(ids[0].tolist()) <= set(allowed)


def test_a_row_with_no_allowed_token_samples_minus_one():
    states = make_states(
        SamplingParams(temperature=0, allowed_token_ids=[EOS], min_tokens=2), SamplingParams(temperature=0.7)
    )
    md = states.sampling_metadata(np.arange(2))
    out = Sampler(0, CPU, **CPU_SAMPLER)(logits_for(2), md)
    assert out.sampled[0].item() == -1 and out.sampled[1].item() >= 0
    feed(states, *out.sampled.tolist())  # a dead-end row is finished; its state stays valid meanwhile
    assert states.last_sampled_tokens[0].item() == 0


def test_logprobs_are_the_raw_log_softmax_with_ranks():
    states = make_states(SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0, logit_bias={1: 50}))
    logits = logits_for()
    md = states.sampling_metadata(np.arange(1))
    out = Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), md)
    ref = logits.log_softmax(-1)[0]
    ids, lps, ranks = (t[0] for t in out.logprobs)
    assert ids[0].item() == 1  # the bias decided the token...
    torch.testing.assert_close(lps[0], ref[1])  # ...but its logprob is the model's own
    assert ranks.item() == int((ref > ref[1]).sum()) + 1
    top = ref.topk(3)
    assert ids[1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(lps[1:], top.values)
    ids, lps, ranks = gather_logprobs(ref.unsqueeze(0), torch.tensor([top.indices[0].item()]), 0)
    assert ranks.item() == 1 and ids.shape == (1, 1)


def test_seeded_rows_do_not_depend_on_the_batch():
    p = SamplingParams(temperature=1.0, seed=42, top_k=20, top_p=0.9)
    logits = logits_for(1)
    alone = []
    states = make_states(p)
    sampler = Sampler(0, CPU, **CPU_SAMPLER)
    for _ in range(5):
        t = sampler(logits.clone(), states.sampling_metadata(np.arange(1))).sampled
        alone.append(t.item())
    states = make_states(SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.5, seed=1))
    sampler = Sampler(123, CPU, **CPU_SAMPLER)
    batch = logits_for(3, seed=5)
    batch[1] = logits[0]
    together = [
        sampler(batch.clone(), states.sampling_metadata(np.arange(3))).sampled[1].item() for _ in range(5)
    ]
    assert alone == together


def test_temperature_draws_follow_the_softmax_and_never_pick_masked_tokens():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3)) * 2
    logits[:, 10:20] = float("-inf")
    md = make_states(SamplingParams(temperature=0.5), SamplingParams(temperature=2.0)).sampling_metadata(
        np.arange(2)
    )
    sampler = Sampler(0, CPU, **CPU_SAMPLER)
    counts = torch.zeros(2, V)
    n = 20000
    big = logits.repeat(n // 100, 1)  # 100 draws per call keep the test fast
    md.temperature = md.temperature.repeat(n // 100)
    for _ in range(100):
        t = sampler(big.clone(), md).sampled.view(-1, 2)
        counts.scatter_add_(1, t.T, torch.ones_like(t.T, dtype=torch.float))
    expected = torch.stack([(logits[0] / 0.5).softmax(-1), (logits[1] / 2.0).softmax(-1)])
    assert counts[:, 10:20].sum() == 0
    assert (counts / n - expected).abs().max() < 0.015


def test_bitmask_application_xgrammar_kernel_equals_the_torch_fallback(monkeypatch):
    rng = np.random.default_rng(0)
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, (4, 2), dtype=np.int64).astype(np.int32))
    logits = logits_for(4)
    fast, slow = logits.clone(), logits.clone()
    apply_grammar_bitmask(fast, [0, 2, 3], bitmask)
    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)  # import fails: the torch path
    apply_grammar_bitmask(slow, [0, 2, 3], bitmask)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(fast[1], logits[1])
    assert (
        torch.isneginf(fast[0]).any()
        and torch.isneginf(fast[0]).tolist() == (~unpack_bitmask(bitmask[:1], V)[0]).tolist()
    )


def test_candidate_top_k_top_p_keep_the_same_tokens_as_sorting_the_vocabulary():
    vocab = 1024
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[8.0], [8.0], [8.0], [0.1], [8.0], [3.0]])
    top_k = torch.tensor([0, 5, 300, 0, 40, 0])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.99, 0.5, 1.0])
    vals, idx, restricted, exact = top_k_top_p_candidates(logits, top_k, top_p)
    assert restricted.tolist() == [True, True, True, True, True, False]
    assert exact.tolist() == [True, True, False, False, True, False]  # k=300 > 256; flat row 3: wide nucleus
    md = SamplingMetadata(False, torch.ones(6), top_k, top_p, None, {})
    reference = apply_top_k_top_p_min_p(logits, md)
    for row in np.flatnonzero(exact.numpy()):
        kept = set(idx[row][torch.isfinite(vals[row])].tolist())
        assert kept == set(torch.isfinite(reference[row]).nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "scale,top_k,top_p", [(4.0, 0, 0.8), (4.0, 10, 1.0), (4.0, 20, 0.7), (0.05, 0, 0.95)]
)
def test_top_k_top_p_draws_follow_the_masked_softmax(scale, top_k, top_p):
    vocab, n = 512, 30000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(11)) * scale
    md = SamplingMetadata(False, torch.ones(1), torch.tensor([top_k]), torch.tensor([top_p]), None, {})
    expected = apply_top_k_top_p_min_p(logits, md).softmax(-1)[0]
    rows = 300
    batch = logits.repeat(rows, 1)
    md_b = SamplingMetadata(
        False, torch.ones(rows), torch.full((rows,), top_k), torch.full((rows,), top_p), None, {}
    )
    sampler = Sampler(0, CPU, **CPU_SAMPLER)
    counts = torch.zeros(vocab)
    for _ in range(n // rows):
        counts += torch.bincount(sampler(batch.clone(), md_b).sampled, minlength=vocab).float()
    assert counts[expected == 0].sum() == 0
    assert (counts / n - expected).abs().max() < 0.01


def test_greedy_checks_the_argmax_against_the_bitmask_before_masking():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, (6, 2), dtype=np.uint64).astype(np.uint32)
    logits = logits_for(6, seed=4)
    words[0] |= np.uint32(0xFFFFFFFF)  # row 0 allows everything: no masking needed
    words[2] = [np.uint32(1 << 3), 0]  # row 2 allows token 3 only: its argmax must be redone
    bitmask = torch.from_numpy(words.view(np.int32))
    states = make_states(*[SamplingParams(temperature=0, presence_penalty=0.3)] * 6)
    feed(states, *range(6))
    md = states.sampling_metadata(np.arange(6))
    md.grammar = ([0, 2, 3, 5], bitmask)
    got = Sampler(0, CPU, **CPU_SAMPLER)(logits.clone(), md).sampled
    expected = logits.clone()
    apply_grammar_bitmask(expected, [0, 2, 3, 5], bitmask)
    apply_penalties(expected, md.penalties)
    assert got.tolist() == expected.argmax(-1).tolist() and got[2].item() == 3
