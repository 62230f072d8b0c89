"""Embedding requests in the scheduler: prefill-only chunks inside the token budget, no placeholder and no
second step once the last chunk is planned, finished by the runner's vector; prefix-cache reads for last-token
pooling only."""

from __future__ import annotations

from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import ModelRunnerOutput, SchedulerOutput
from aioengine.sched.request import Request
from aioengine.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.fake import fake_run


def _run(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """fake_run, but an embedding whose prompt completes gets a vector (its id) and samples nothing."""
    result = fake_run(sched, out)
    pooled = {}
    for i, rid in enumerate(result.req_ids):
        request = sched.requests[rid]
        if request.pooling is not None:
            result.sampled_token_ids[i] = []
            if not request.is_prefill_chunk:
                pooled[rid] = f"vector of {rid}"
    result.pooler_output = pooled or None
    return result


def _request(rid: str, prompt: list[int], pooling: str | None) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=4, temperature=0), eos_token_id=None)
    r.pooling = pooling
    return r


def _sched(**kw) -> Scheduler:
    cfg = dict(max_num_batched_tokens=16, num_blocks=64, block_size=4, max_model_len=256)
    return Scheduler(SchedulerConfig(**{**cfg, **kw}))


def test_an_embedding_is_chunked_prefill_then_finished_by_its_vector():
    sched = _sched()
    sched.add_request(_request("e", list(range(1, 41)), "mean"))
    sched.add_request(_request("g", list(range(100, 106)), None))
    planned = []
    in_flight = []
    outputs = []
    for _ in range(8):  # a batch queue of two: schedule step k, then apply step k - 1
        if sched.has_requests():
            out = sched.schedule()
            planned.append(dict(out.num_scheduled_tokens))
            in_flight.append((out, _run(sched, out)))
        if len(in_flight) == 2 or (in_flight and not sched.has_requests()):
            out, result = in_flight.pop(0)
            outputs += sched.update_from_output(out, result)
    # The embedding's 40 tokens in chunks of the budget (first come, first served); never a step of its
    # own after the last, though that step's output lands only two steps later.
    assert [p.get("e", 0) for p in planned[:3]] == [16, 16, 8] and all("e" not in p for p in planned[3:])
    assert planned[3].get("g") == 1  # the generation decodes on
    assert sched.requests.get("e") is None
    done = [o for o in outputs if o.request_id == "e"]
    assert len(done) == 1 and done[0].finish_reason == "stop" and done[0].new_token_ids == []
    assert done[0].pooling_output == "vector of e"
    assert [o for o in outputs if o.request_id == "g"][-1].finish_reason == "length"


def test_only_last_token_pooling_reads_the_prefix_cache():
    prompt = list(range(1, 33))
    for pooling, hit in (("last", 28), ("mean", 0), ("cls", 0)):
        sched = _sched(max_num_batched_tokens=64)
        sched.add_request(_request("first", prompt, "last"))
        out = sched.schedule()
        sched.update_from_output(out, _run(sched, out))
        sched.add_request(_request("second", prompt, pooling))
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"second": len(prompt) - hit}, pooling
        assert out.scheduled_new_reqs[0].pooling == pooling
        sched.update_from_output(out, _run(sched, out))
        assert not sched.has_requests() and sched.kv_cache_manager.usage == 0.0
