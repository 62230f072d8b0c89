"""Property test: random arrivals, aborts, budgets and pool sizes keep every scheduler invariant."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.sampling_params import SamplingParams
from aioengine.sched.kv_cache_spec import capacity_tokens, kv_cache_groups, window_blocks_bound
from aioengine.sched.request import Request, RequestStatus
from aioengine.sched.scheduler import Scheduler, SchedulerConfig

from .fake import Driver, token_at


def check_invariants(sched: Scheduler, budget: int) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    refs = Counter(
        id(b) for groups in kv.req_to_blocks.values() for blocks in groups for b in blocks if not b.is_null
    )
    free = {id(b) for b in pool.free_block_queue}
    assert len(free) == pool.get_num_free_blocks()
    for block in pool.blocks[1:]:
        assert block.ref_cnt == refs.get(id(block), 0), block
        assert (block.ref_cnt == 0) == (id(block) in free), block  # never both free and used
    assert id(pool.null_block) not in free
    for (h, g), block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == h and block.cache_group == g
    for groups in kv.req_to_blocks.values():  # a windowed group holds only what its window can reach
        for group, blocks in zip(kv.groups, groups, strict=True):
            bound = window_blocks_bound(group, kv.block_size, budget)
            assert bound is None or sum(not b.is_null for b in blocks) <= bound
    assert len(sched.running) <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        for blocks in kv.req_to_blocks[r.request_id]:  # nulls hold the places of blocks a window let go
            assert len(blocks) * kv.block_size >= r.num_computed_tokens
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running}


events = st.lists(
    st.tuples(
        st.integers(0, 3),  # new arrivals this step
        st.integers(1, 120),  # prompt length
        st.integers(1, 24),  # max tokens
        st.integers(0, 12),  # 0..: abort one random live request when 0
        st.integers(0, 40),  # shared-prefix id
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=events,
    budget=st.integers(8, 300),
    num_blocks=st.integers(12, 60),
    block_size=st.sampled_from([4, 16]),
    threshold=st.sampled_from([0, 16, 50]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    max_seqs=st.integers(1, 8),
    seed=st.integers(0, 1000),
    windows=st.sampled_from([[None], [8], [24, 24], [None, 8], [None, 24, 24, 24]]),
)
def test_random_workloads_keep_invariants(
    events, budget, num_blocks, block_size, threshold, policy, caching, max_seqs, seed, windows
) -> None:
    """Full attention, windowed layers only, and hybrid layouts (sched/kv_cache_spec.py)."""
    groups = kv_cache_groups(windows)
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=200,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=caching,
        long_prefill_token_threshold=threshold,
        policy=policy,
        kv_cache_groups=groups,
    )
    sched = Scheduler(cfg)
    drv = Driver(sched)
    usable_tokens = capacity_tokens(groups, num_blocks - 1, block_size, budget, 200)
    live: dict[str, Request] = {}
    shapes: dict[str, tuple[int, int]] = {}
    aborted: set[str] = set()
    n = 0
    for arrivals, plen, max_tokens, abort, prefix in events:
        for _ in range(arrivals):
            # A request must fit in the pool alone, or it could never run (the engine checks this).
            plen_i = min(plen, usable_tokens - max_tokens - block_size, 199 - max_tokens)
            if plen_i < 1:
                continue  # the engine refuses a request that can never fit
            prompt = ([prefix] * 20 + [n] * plen_i)[-plen_i:]
            r = Request(
                f"r{n}",
                prompt,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                priority=(n * 7 + seed) % 3,
            )
            n += 1
            sched.add_request(r)
            live[r.request_id] = r
            shapes[r.request_id] = (plen_i, max_tokens)
        if abort == 0 and live:
            victim = sorted(live)[seed % len(live)]
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
            del live[victim]
        out = drv.schedule()
        if out is not None:
            assert out.total_num_scheduled_tokens <= budget
        check_invariants(sched, budget)
        if drv.queue and (out is None or len(drv.queue) == 2):
            drv.update()
            check_invariants(sched, budget)
        live = {k: v for k, v in live.items() if not v.is_finished}
    drv.run_to_completion(max_steps=20_000)
    check_invariants(sched, budget)
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.requests
    for i in range(n):
        rid = f"r{i}"
        if rid in aborted:
            continue
        got = drv.outputs[rid]
        plen, max_tokens = shapes[rid]
        assert drv.finish_reasons[rid] == "length"
        # Tokens are a function of position: preemption never loses or duplicates one.
        assert got == [token_at(rid, plen + j) for j in range(max_tokens)]
