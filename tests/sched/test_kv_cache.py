"""Block pool, prefix caching, preemption and abort: blocks are reused, never leaked, never lost."""

import pytest

from aioengine.sampling_params import SamplingParams
from aioengine.sched.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from aioengine.sched.request import Request, RequestStatus
from aioengine.sched.scheduler import Scheduler, SchedulerConfig

from .fake import Driver, token_at


def make(num_blocks=256, budget=8192, policy="fcfs", caching=True, max_seqs=256, bs=16) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=4096,
            num_blocks=num_blocks,
            block_size=bs,
            enable_prefix_caching=caching,
            policy=policy,
        )
    )


def test_free_queue_is_intrusive_lru() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    assert q.num_free_blocks == 4


def test_block_pool_frees_in_reverse_so_the_tail_is_evicted_first() -> None:
    pool = BlockPool(8)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 7
    got = pool.get_new_blocks(3)
    pool.cache_full_blocks(got, [11, 12, 13], 0, 3)
    pool.free_blocks(reversed(got))
    assert pool.get_usage() == 0.0
    # The cached blocks are still findable (lazy eviction) until reused.
    assert pool.get_cached_block(11) is got[0]
    fresh = pool.get_new_blocks(5)  # 4 never-used blocks, then the tail of the freed prefix
    assert got[2] in fresh and got[0] not in fresh
    assert pool.get_cached_block(13) is None and pool.get_cached_block(11) is got[0]


def test_prefix_cache_hit_reuses_six_full_blocks() -> None:
    sched = make()
    drv = Driver(sched)
    prefix = list(range(500, 600))  # 100 tokens: 6 full blocks of 16
    sched.add_request(Request("first", prefix + [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    drv.run_to_completion()
    sched.make_stats()
    second = Request("second", prefix + [7, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(second)
    out = drv.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96
    assert out.num_scheduled_tokens == {"second": 104 - 96}
    assert second.num_cached_tokens == 96
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (104, 96)
    assert sched.kv_cache_manager.total_prefix_cache.hits == 96
    drv.run_to_completion()
    assert sched.kv_cache_manager.usage == 0.0


def test_cache_hit_never_covers_the_last_prompt_token() -> None:
    sched = make()
    drv = Driver(sched)
    prompt = list(range(64))  # exactly 4 blocks
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=2)))
    drv.run_to_completion()
    sched.add_request(Request("b", list(prompt), SamplingParams(max_tokens=2)))
    out = drv.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48
    assert out.num_scheduled_tokens == {"b": 16}


def test_cache_salt_separates_prefixes() -> None:
    sched = make()
    drv = Driver(sched)
    sched.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=2), cache_salt="alice"))
    drv.run_to_completion()
    sched.add_request(Request("b", list(range(40)), SamplingParams(max_tokens=2), cache_salt="bob"))
    out = drv.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_output_blocks_are_cached_for_later_requests() -> None:
    sched = make()
    drv = Driver(sched)
    sched.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=30, ignore_eos=True)))
    drv.run_to_completion()
    full = list(range(20)) + drv.outputs["a"]
    sched.add_request(Request("b", full + [1], SamplingParams(max_tokens=2)))
    out = drv.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48  # 3 full blocks of 51 tokens


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_under_a_tiny_pool_loses_nothing(policy: str) -> None:
    sched = make(num_blocks=1 + 12, budget=64, policy=policy)  # 12 usable blocks of 16 tokens
    drv = Driver(sched)
    reqs = []
    for i in range(8):
        r = Request(
            f"r{i}", [100 + i] * (30 + i), SamplingParams(max_tokens=40, ignore_eos=True), priority=i % 3
        )
        reqs.append(r)
        sched.add_request(r)
    drv.run_to_completion()
    assert sched.num_preemptions_total > 0
    for r in reqs:
        expect = [token_at(r.request_id, r.num_prompt_tokens + j) for j in range(40)]
        assert drv.outputs[r.request_id] == expect, r.request_id
        assert drv.finish_reasons[r.request_id] == "length"
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.kv_cache_manager.req_to_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks[1:])


def test_priority_policy_preempts_the_lowest_priority() -> None:
    sched = make(num_blocks=1 + 6, budget=256, policy="priority")
    low = Request("low", [1] * 40, SamplingParams(max_tokens=100, ignore_eos=True), priority=5)
    sched.add_request(low)
    sched.schedule()  # low holds 3 blocks
    high = Request("high", [2] * 40, SamplingParams(max_tokens=100, ignore_eos=True), priority=0)
    sched.add_request(high)
    sched.schedule()  # high admitted with the remaining 3
    assert sched.running == [low, high]
    high.all_token_ids += [3] * 10  # high grows past its blocks: someone must go
    out = sched.schedule()
    assert out.preempted_req_ids == {"low"}
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert sched.waiting.peek() is low


def test_abort_in_flight_is_skipped_and_frees_blocks() -> None:
    sched = make()
    drv = Driver(sched)
    sched.add_request(Request("a", list(range(50)), SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.add_request(Request("b", list(range(60)), SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(4):
        drv.step()
    assert drv.queue  # a step is in flight
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in sched.kv_cache_manager.req_to_blocks
    outputs = drv.update()
    assert all(o.request_id != "a" for o in outputs)
    out = drv.schedule()
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    drv.run_to_completion()
    assert len(drv.outputs["b"]) == 20 and sched.kv_cache_manager.usage == 0.0


def test_stops_eos_stop_token_max_tokens_and_min_tokens() -> None:
    sched = make()
    drv = Driver(sched)
    t1 = token_at("eos", 4)  # the first token "eos" samples (prompt of 4 tokens)
    sched.add_request(Request("eos", [1, 2, 3, 4], SamplingParams(max_tokens=10), eos_token_id=t1))
    t2 = token_at("stop", 5)
    sched.add_request(Request("stop", [1, 2, 3, 4], SamplingParams(max_tokens=10, stop_token_ids=[t2])))
    t3 = token_at("min", 4)
    sched.add_request(
        Request("min", [1, 2, 3, 4], SamplingParams(max_tokens=3, min_tokens=2), eos_token_id=t3)
    )
    drv.run_to_completion()
    assert drv.outputs["eos"] == [t1] and drv.finish_reasons["eos"] == "stop"
    assert len(drv.outputs["stop"]) == 2 and drv.finish_reasons["stop"] == "stop"
    assert len(drv.outputs["min"]) == 3 and drv.finish_reasons["min"] == "length"


def test_async_scheduling_does_not_run_past_max_tokens() -> None:
    sched = make()
    drv = Driver(sched)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    steps = 0
    while sched.has_requests() or drv.queue:
        out = drv.schedule()
        steps += out is not None
        if drv.queue and (out is None or len(drv.queue) == 2):
            drv.update()
    assert steps == 3  # prefill + 2 decodes: no wasted extra step


def test_a_long_request_holds_a_bounded_number_of_windowed_blocks():
    """A 4,000-token prompt on a window-64 hybrid layout (one full, two windowed groups), 64 tokens a step:
    each windowed group never holds more than cdiv(64 - 1 + 64, 16) + 1 = 9 blocks, the full group grows
    with the request, and everything is freed at the end."""
    from aioengine.sched.kv_cache_spec import kv_cache_groups, window_blocks_bound

    from .fake import Driver

    groups = kv_cache_groups([None, 64, 64])
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=4096,
        num_blocks=400,
        block_size=16,
        kv_cache_groups=groups,
    )
    sched = Scheduler(cfg)
    drv = Driver(sched)
    sched.add_request(Request("long", list(range(4000)), SamplingParams(max_tokens=32, ignore_eos=True)))
    kv = sched.kv_cache_manager
    bound = window_blocks_bound(groups[1], 16, 64)
    assert bound == 9
    most = [0, 0, 0]
    while sched.has_requests():
        drv.step()
        if "long" in kv.req_to_blocks:
            for g in range(3):
                most[g] = max(most[g], kv.num_blocks_held("long", g))
    assert most[1] <= bound and most[2] <= bound
    assert most[0] == -(-4031 // 16)  # the full group: every block of the prompt and outputs but the last
    assert kv.usage == 0.0 and not kv.req_to_blocks
