"""The step cost model (sched/step_cost.py): its online fit converges on synthetic step times, follows a
machine that slows down, and sizes a prefill chunk to a time limit."""

from __future__ import annotations

import random

import pytest

from aioengine.sched.step_cost import PrefillCap, StepCostModel, StepFeatures

TRUE = (4e-3, 3e-4, 6e-5, 2e-7, 4e-9)  # s: per step, decode row, prefill token, KV token read, attention unit


def _steps(n: int, seed: int, coef=TRUE, noise: float = 0.05):
    rng = random.Random(seed)
    for _ in range(n):
        f = StepFeatures(decode_rows=rng.randint(0, 64))
        f.decode_context = f.decode_rows * rng.randint(50, 2000)
        for _ in range(rng.randint(0, 2)):
            f.add_prefill(rng.randint(16, 512), rng.randint(0, 3000))
        t = sum(c * v for c, v in zip(coef, f.vector(), strict=True))
        yield f, t * (1 + rng.gauss(0, noise))


def test_the_fit_converges_on_synthetic_steps():
    model = StepCostModel()
    assert model.predict(StepFeatures(decode_rows=1)) is None  # no fit yet: no cap
    for f, t in _steps(600, 0):
        model.observe(f, t)
    got = model.coefficients()
    for name, g, want in zip("abcde", got, TRUE, strict=True):
        assert abs(g - want) <= 0.25 * want, (name, g, want)  # ~200 steps in the window, 5% noise
    errors = [abs(model.predict(f) - t) / t for f, t in _steps(200, 1, noise=0.0)]
    assert sorted(errors)[int(0.9 * len(errors))] < 0.05  # 90% of predictions within 5%


def test_the_fit_follows_a_machine_that_slows_down():
    model = StepCostModel()
    for f, t in _steps(400, 2):
        model.observe(f, t)
    slower = tuple(1.5 * c for c in TRUE)
    for f, t in _steps(1200, 3, coef=slower):
        model.observe(f, t)
    probe = StepFeatures(decode_rows=16, decode_context=16 * 500)
    probe.add_prefill(256, 0)
    want = sum(c * v for c, v in zip(slower, probe.vector(), strict=True))
    assert abs(model.predict(probe) - want) < 0.05 * want


def _planned(model: StepCostModel, base: StepFeatures, tokens: int, context: int = 100) -> float:
    """What the planner holds against a limit: the step with a chunk of ``tokens``, times the margin."""
    f = StepFeatures(base.decode_rows, base.prefill_tokens, base.decode_context, base.prefill_attention)
    f.add_prefill(tokens, context)
    return model.margin * model.predict(f)


def test_max_prefill_fills_the_time_left_and_no_more():
    model = StepCostModel()
    for f, t in _steps(600, 4, noise=0.0):
        model.observe(f, t)
    base = StepFeatures(decode_rows=16, decode_context=16 * 300)
    limit = 0.030
    n = model.max_prefill(base, context=100, seconds=limit)
    assert n is not None and n > 0
    assert _planned(model, base, n) <= limit < _planned(model, base, n + 1)
    assert model.max_prefill(StepFeatures(decode_rows=10_000), 0, limit) == 0  # decodes alone overrun it
    assert StepCostModel().max_prefill(base, 0, limit) is None  # unfitted: no cap


def test_chunks_are_planned_at_the_fits_90th_percentile_error():
    """One step in five runs 20% over the line the others lie on (a busy neighbour, say): the limit has to
    hold for those too, so a chunk is sized with the fit's recent 90th-percentile error on top."""
    rng = random.Random(11)
    model = StepCostModel()
    for f, t in _steps(800, 8, noise=0.0):
        model.observe(f, t * (1.2 if rng.random() < 0.2 else 1.0))
    assert 1.1 < model.margin < 1.25  # the slow steps over a line fitted a little above the rest
    base = StepFeatures(decode_rows=16, decode_context=16 * 300)
    limit = 0.030
    n = model.max_prefill(base, context=100, seconds=limit)
    assert n is not None and n > 0
    assert _planned(model, base, n) <= limit < _planned(model, base, n + 1)
    exact = _fitted()  # steps right on the line: no margin
    assert abs(exact.margin - 1.0) < 1e-3


def test_a_fit_that_predicts_less_than_nothing_frees_no_time_for_prompts():
    """A fit on alike steps can slope below zero: a step of 16 decodes predicted at -0.16 s must not leave
    0.16 s more for prompt tokens than the limit itself."""
    model = StepCostModel()
    model.observations = model.min_observations
    # scaled: 1 ms a step, -10 ms a decode row, 60 us a prompt token
    model.theta = [1e-3, -1.0, 0.06, 0.0, 0.0]
    step = StepFeatures(decode_rows=16, decode_context=16 * 300)
    assert model.predict(step) < 0

    def limit(seconds: float, ratio: float) -> int:
        return PrefillCap(model, seconds, ratio, 16, _decodes_alone(step)).limit(512, 0)

    assert limit(0.005, 0.0) == 80  # 5 ms of prompt tokens
    assert limit(0.0, 1.5) == 16  # no relative room: the floor
    model.theta = [1e-3, -1.0, -0.06, 0.0, 0.0]  # no slope for prompt tokens at all: the floor, not no cap
    assert limit(0.005, 0.0) == 16


def _fitted(coef=TRUE) -> StepCostModel:
    model = StepCostModel()
    for f, t in _steps(600, 5, coef=coef, noise=0.0):
        model.observe(f, t)
    return model


def _decodes_alone(f: StepFeatures) -> StepFeatures:
    return StepFeatures(decode_rows=f.decode_rows, decode_context=f.decode_context)


def test_a_relative_target_is_a_multiple_of_the_decodes_alone():
    model = _fitted()
    step = StepFeatures(decode_rows=16, decode_context=16 * 300)
    decodes = model.predict(step)
    assert decodes is not None

    def predicted(tokens: int) -> float:
        return _planned(model, step, tokens, context=0)

    cap = PrefillCap(model, 0.0, 1.5, 16, _decodes_alone(step))
    n = cap.limit(4096, 0)
    assert n % 16 == 0 and predicted(n) <= 1.5 * decodes < predicted(n + 16)  # whole blocks, and no more
    # with a fixed target too, the larger limit holds
    longer = 3 * decodes
    m = PrefillCap(model, longer, 1.5, 16, _decodes_alone(step)).limit(4096, 0)
    assert m > n and predicted(m) <= longer < predicted(m + 16)
    assert PrefillCap(model, 0.001, 1.5, 16, _decodes_alone(step)).limit(4096, 0) == n
    # more decodes in the step: a longer step is allowed (a fixed target below the decodes alone would let
    # only the one-block floor through)
    big = StepFeatures(decode_rows=64, decode_context=64 * 300)
    assert PrefillCap(model, 0.0, 1.5, 16, big).limit(4096, 0) > n
    # no fit yet, or no decode in the step: not cut
    assert PrefillCap(StepCostModel(), 0.0, 1.5, 16, _decodes_alone(step)).limit(4096, 0) == 4096
    assert PrefillCap(model, 0.0, 1.5, 16, StepFeatures()).limit(4096, 0) == 4096


@pytest.mark.parametrize(("target_ms", "ratio"), [(12.0, 0.0), (0.0, 1.5), (12.0, 1.5)])
def test_the_scheduler_cuts_prompt_chunks_to_the_target_and_never_starves(target_ms, ratio):
    from aioengine.sampling_params import SamplingParams
    from aioengine.sched.request import Request
    from aioengine.sched.scheduler import Scheduler, SchedulerConfig
    from tests.sched.fake import Driver

    cfg = SchedulerConfig(
        max_num_batched_tokens=512,
        num_blocks=2048,
        block_size=16,
        max_model_len=4096,
        target_itl_ms=target_ms,
        target_itl_ratio=ratio,
    )
    sched = Scheduler(cfg)
    sched.step_cost = model = _fitted()
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(12):
        sched.add_request(Request(f"d{i}", list(range(1, 30)), params))
    for i in range(3):
        sched.add_request(Request(f"long{i}", list(range(100, 1600)), params))
    driver = Driver(sched)
    steps = []
    original = sched.schedule

    def schedule():
        ready = sum(  # requests whose next step is a decode (not all their tokens in flight already)
            1
            for r in sched.running
            if len(r.all_token_ids) + r.num_output_placeholders - r.num_computed_tokens == 1
            and r.num_computed_tokens >= r.num_prompt_tokens
            and r.num_output_tokens + r.num_output_placeholders < r.max_tokens
        )
        out = original()
        steps.append((out.step_features, model.predict(out.step_features), out, ready))
        return out

    sched.schedule = schedule
    driver.run_to_completion()
    # steps with decodes (a step without one has no inter-token gap to protect: not cut)
    prefill_steps = [(f, p) for f, p, _, _ in steps if f.prefill_tokens and f.decode_rows]
    assert len(prefill_steps) > 10 and sched.prefill_caps > 0
    for f, predicted in prefill_steps:
        limit = max(target_ms / 1e3, ratio * model.predict(_decodes_alone(f)))
        # within the target, or the one block a step that keeps prompts moving
        assert predicted <= limit * (1 + 1e-9) or f.prefill_tokens <= 16, (f, predicted, limit)
    # the token budget alone would have taken 512-token chunks: the target cut them, to more than the floor
    assert 16 < max(f.prefill_tokens for f, _ in prefill_steps) < 512
    # decodes are never starved: every request ready to decode got its token in each step; and the
    # prediction counted exactly those rows (not the requests whose last tokens are all in flight)
    for f, _, out, ready in steps:
        assert sum(1 for n in out.num_scheduled_tokens.values() if n == 1) >= ready
        assert f.decode_rows == ready
    assert all(len(driver.outputs[r]) == 40 for r in driver.outputs)


def test_a_step_without_decodes_is_not_cut():
    """Nobody's next token waits on it: prompts take the whole token budget (a burst of new requests)."""
    from aioengine.sampling_params import SamplingParams
    from aioengine.sched.request import Request
    from aioengine.sched.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(max_num_batched_tokens=512, num_blocks=512, block_size=16, target_itl_ms=1.0)
    sched = Scheduler(cfg)
    sched.step_cost = _fitted()
    for i in range(3):
        prompt = list(range(1000 * i + 1, 1000 * i + 301))  # distinct: no prefix hits
        sched.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=4)))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 512 and sched.prefill_caps == 0


def test_a_prompts_last_token_is_predicted_as_a_prompt_token_not_a_decode():
    """A chunk that stopped one token short of the prompt's end leaves a one-token chunk: the running pass
    plans it as a prompt chunk (no token is sampled for it), so the prediction must not count it as a
    decode row as well."""
    from aioengine.sampling_params import SamplingParams
    from aioengine.sched.request import Request
    from aioengine.sched.scheduler import Scheduler, SchedulerConfig
    from tests.sched.fake import Driver

    cfg = SchedulerConfig(max_num_batched_tokens=34, num_blocks=512, block_size=16, target_itl_ms=1e6)
    sched = Scheduler(cfg)
    sched.step_cost = _fitted()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    driver = Driver(sched, batch_queue_size=1)
    for i in range(2):  # two streams decoding
        sched.add_request(Request(f"d{i}", [1000 * i + t for t in range(1, 9)], params))
    driver.step()
    prompt = Request("p", list(range(5000, 5033)), params)  # 33 tokens: 32 fit beside the 2 decodes
    sched.add_request(prompt)
    first = driver.schedule()
    assert first is not None
    assert first.num_scheduled_tokens["p"] == 32 and first.step_features.decode_rows == 2
    driver.update()
    second = sched.schedule()
    assert second.num_scheduled_tokens["p"] == 1 and prompt.num_computed_tokens == 33
    f = second.step_features
    assert (f.decode_rows, f.prefill_tokens) == (2, 1), f


@pytest.mark.parametrize("ratio", [1.0, 0.5, -2.0])
def test_a_ratio_that_allows_no_prompt_work_is_refused(ratio):
    from aioengine.config import EngineArgs

    with pytest.raises(ValueError, match="target_itl_ratio must be > 1"):
        EngineArgs(model="default", target_itl_ratio=ratio).validate()


def test_a_fit_that_has_seen_no_prompt_work_still_caps_it():
    """Decodes only (and so no prompt slope): a prompt token is taken to cost what a decode row does,
    rather than nothing, which would lift the cap entirely."""
    rng = random.Random(7)
    model = StepCostModel()
    for _ in range(200):
        rows = rng.randint(1, 32)
        f = StepFeatures(decode_rows=rows, decode_context=rows * rng.randint(50, 500))
        model.observe(f, sum(c * v for c, v in zip(TRUE, f.vector(), strict=True)))
    _, b, c, _, e = model.coefficients()
    assert abs(c) < 1e-9 and abs(e) < 1e-12  # nothing learned about prompts
    base = StepFeatures(decode_rows=16, decode_context=16 * 300)
    limit = model.predict(base) + 0.0015
    n = model.max_prefill(base, 0, limit)
    assert n is not None and n > 0 and abs(n - 0.0015 / b) <= 1
