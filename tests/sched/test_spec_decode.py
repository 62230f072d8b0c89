"""The scheduler's side of speculative decoding: drafts inside the token budget, 1 + k placeholders, rejected
drafts' slots reused, only accepted tokens cached, and the config's checks."""

from __future__ import annotations

import pytest

from aioengine.config import SpeculativeConfig
from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import ModelRunnerOutput
from aioengine.sched.request import Request
from aioengine.sched.scheduler import Scheduler, SchedulerConfig
from aioengine.sched.spec_decode import propose_ngram

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
LOOP = [1, 2, 3, 4, 5, 6, 7, 8]


BLOCK = 4


def scheduler(budget: int = 64, spec: SpeculativeConfig | None = SPEC) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_model_len=256,
            num_blocks=64,
            block_size=BLOCK,
            speculative=spec,
        )
    )


def test_propose_ngram_takes_the_latest_longest_match():
    tokens = [9, 1, 2, 3, 7, 7, 1, 2, 3, 8, 8, 1, 2, 3]
    assert propose_ngram(tokens, SPEC, 3) == [8, 8, 1]  # the latest [1, 2, 3] is followed by 8, 8, 1
    assert propose_ngram(tokens, SPEC, 3, skip=1) == [8, 1, 2]  # one token in flight: start past it
    assert propose_ngram(tokens, SPEC, 1) == [8]
    assert propose_ngram([4, 5, 6], SPEC, 3) == []  # nothing recurs


def test_drafts_count_against_the_budget_and_rejected_slots_are_reused():
    sched = scheduler()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    req = Request("r", LOOP * 3, params)
    sched.add_request(req)
    prefill = sched.schedule()
    assert prefill.num_scheduled_tokens == {"r": 24} and not prefill.scheduled_spec_decode_tokens
    sched.update_from_output(prefill, ModelRunnerOutput(["r"], [[1]]))  # it sampled 1: LOOP starts again
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (25, 24, 0)

    step = sched.schedule()
    assert step.scheduled_spec_decode_tokens == {"r": [2, 3, 4]}
    assert step.num_scheduled_tokens == {"r": 4} and step.total_num_scheduled_tokens == 4
    assert (req.num_computed_tokens, req.num_output_placeholders, req.num_drafts_in_flight) == (28, 4, 3)
    # While its drafts are in flight the request is not planned again: where it goes on is not known yet.
    assert sched.schedule().total_num_scheduled_tokens == 0
    # Two drafts hold (2, 3), the third does not: the model sampled 9 there.
    sched.update_from_output(step, ModelRunnerOutput(["r"], [[2, 3, 9]]))
    assert req.all_token_ids[-4:] == [1, 2, 3, 9]
    # The rejected draft's position is computed again by the next step: its slot is reused.
    assert (req.num_tokens, req.num_computed_tokens, req.num_output_placeholders) == (28, 27, 0)
    assert sched.spec_totals.num_drafts == 1 and sched.spec_totals.num_accepted_tokens == 2
    assert sched.spec_totals.accepted_per_pos == [1, 1, 0]
    # Only accepted tokens reach the prefix cache: 27 computed tokens fill 6 blocks of 4, not 7.
    assert sched.kv_cache_manager.num_cached_block["r"][0] == 6


def test_drafts_stop_at_max_tokens_and_the_budget():
    sched = scheduler(budget=26)
    req = Request("r", LOOP * 3, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sched.add_request(req)
    prefill = sched.schedule()
    sched.update_from_output(prefill, ModelRunnerOutput(["r"], [[1]]))
    step = sched.schedule()
    # 2 more outputs allowed: the step's own token and one draft.
    assert step.scheduled_spec_decode_tokens == {"r": [2]} and step.num_scheduled_tokens == {"r": 2}
    out = sched.update_from_output(step, ModelRunnerOutput(["r"], [[2, 3]]))
    assert out[0].finish_reason == "length" and req.num_output_tokens == 3


def test_no_drafts_for_requests_whose_sampling_depends_on_the_tokens_before():
    """Penalties, bad words, an opt-out and min_tokens (until reached) get no drafts; logprobs do."""
    import dataclasses

    sched = scheduler(budget=256, spec=dataclasses.replace(SPEC, disable_by_batch_size=64))
    cases = [
        SamplingParams(temperature=0, max_tokens=9, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=9, bad_words=["a b"]),
        SamplingParams(temperature=0, max_tokens=9, speculative=False),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, logprobs=1),
        SamplingParams(temperature=0, max_tokens=9),
    ]
    for i, params in enumerate(cases):
        sched.add_request(Request(f"r{i}", LOOP * 2, params))
    prefill = sched.schedule()
    sched.update_from_output(
        prefill, ModelRunnerOutput(list(prefill.num_scheduled_tokens), [[1]] * len(cases))
    )
    assert sorted(sched.schedule().scheduled_spec_decode_tokens) == ["r4", "r5"]


def test_no_drafts_above_the_batch_size_limit():
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=512,
            max_model_len=256,
            num_blocks=128,
            block_size=4,
            speculative=SpeculativeConfig(disable_by_batch_size=2, prompt_lookup_min=1),
        )
    )
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    for i in range(3):
        sched.add_request(Request(f"r{i}", LOOP * 2, params))
    prefill = sched.schedule()
    sched.update_from_output(prefill, ModelRunnerOutput(list(prefill.num_scheduled_tokens), [[1]] * 3))
    assert not sched.schedule().scheduled_spec_decode_tokens


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"method": "eagle"}, "method must be one of ngram, draft_model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram", "lookahead": 3}, "unknown key 'lookahead'"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "draft_model"}, "'draft_model' needs 'model'"),
        ({"method": "draft_model", "model": 3}, "'draft_model' needs 'model'"),
        ({"method": "draft_model", "model": "/x", "prompt_lookup_max": 3}, "prompt_lookup_max applies to"),
        ({"method": "ngram", "model": "/x"}, "method 'ngram' takes no 'model'"),
        ("ngram", "must be a JSON object"),
    ],
)
def test_bad_speculative_config_names_the_problem(raw, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.from_dict(raw)


def test_a_model_alone_means_a_draft_model_as_in_vllm():
    config = SpeculativeConfig.from_dict({"model": "/draft", "num_speculative_tokens": 4})
    assert config is not None and config.uses_draft_model and config.model == "/draft"


def test_draft_model_proposals_are_asked_with_their_slots_and_used_in_the_next_step():
    """A decode asks the runner for proposals and reserves their KV slots past its own token; it is not
    planned again until they arrive; the next step verifies them, and asks for more within max_tokens."""
    spec = SpeculativeConfig.from_dict({"model": "/draft", "num_speculative_tokens": 3})
    sched = scheduler(budget=256, spec=spec)
    req = Request("r", list(range(10, 17)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sched.add_request(req)
    prefill = sched.schedule()
    sched.update_from_output(prefill, ModelRunnerOutput(["r"], [[1]]))
    step = sched.schedule()  # a plain decode of position 7: proposals for positions 8.. are asked
    assert step.num_drafts_to_propose == {"r": 3} and not step.scheduled_spec_decode_tokens
    blocks = sched.kv_cache_manager.req_to_blocks["r"][0]
    assert len(blocks) * BLOCK >= 8 + 3  # position 7's slot and the three proposals' ones
    assert sched.schedule().total_num_scheduled_tokens == 0  # waits for the proposals
    sched.update_from_output(step, ModelRunnerOutput(["r"], [[2]], draft_token_ids=[[5, 6, 7]]))
    verify = sched.schedule()
    assert verify.scheduled_spec_decode_tokens == {"r": [5, 6, 7]} and verify.num_scheduled_tokens == {"r": 4}
    # 2 outputs so far; after this step's 4, at most 2 remain: the next step's token and one draft
    assert verify.num_drafts_to_propose == {"r": 1}
    sched.update_from_output(verify, ModelRunnerOutput(["r"], [[5, 6, 9]], draft_token_ids=[[4]]))
    assert (
        req.num_computed_tokens == 7 + 1 + 3 and req.num_output_tokens == 5
    )  # the third draft's KV is stale
    last = sched.schedule()
    assert last.scheduled_spec_decode_tokens == {"r": [4]} and not last.num_drafts_to_propose


def test_a_request_whose_drafts_keep_failing_pauses_its_proposals():
    sched = scheduler(budget=256)
    req = Request("r", LOOP * 3, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    sched.add_request(req)
    prefill = sched.schedule()
    sched.update_from_output(prefill, ModelRunnerOutput(["r"], [[1]]))
    verified = plain = 0
    for _ in range(40):
        step = sched.schedule()
        drafts = step.scheduled_spec_decode_tokens.get("r")
        if drafts:
            verified += 1
            token = 999  # never the draft: every one is rejected
        else:
            plain += 1
            token = LOOP[req.num_tokens % len(LOOP)]  # keep the loop going, so matches keep being found
        sched.update_from_output(step, ModelRunnerOutput(["r"], [[token]]))
    # five rejections in a row bring the smoothed acceptance under POOR_ACCEPTANCE: 16 plain steps follow
    assert verified < 40 - 16 and plain >= 16
    assert sched.spec_totals.num_accepted_tokens == 0


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted():
    # 7 usable blocks of 4, all held: r's 23 prompt tokens take 6 (its next token still fits in the 6th),
    # o's 3 take 1. Drafts would need a 7th block for r: o would have to be preempted for them.
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_model_len=256, num_blocks=8, block_size=4, speculative=SPEC
        )
    )
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    req, other = Request("r", (LOOP * 3)[:-1], params), Request("o", [9, 9, 9], params)
    sched.add_request(req)
    sched.add_request(other)
    prefill = sched.schedule()
    sched.update_from_output(prefill, ModelRunnerOutput(list(prefill.num_scheduled_tokens), [[8], [9]]))
    assert propose_ngram(req.all_token_ids, SPEC, 3) == [1, 2, 3]  # there are drafts to propose
    step = sched.schedule()
    assert not step.preempted_req_ids and "r" not in step.scheduled_spec_decode_tokens
    assert step.num_scheduled_tokens["r"] == 1
