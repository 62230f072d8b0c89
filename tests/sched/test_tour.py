"""engine-step-tour.txt's worked example (stops 2, 3, 11 and the counters table), with the real classes."""

from aioengine.sampling_params import SamplingParams
from aioengine.sched.request import Request
from aioengine.sched.scheduler import Scheduler, SchedulerConfig

from .fake import Driver


def counters_b(b: Request) -> tuple[int, int, int]:
    return b.num_tokens, b.num_computed_tokens, b.num_output_placeholders


def test_tour_worked_example() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=8192,
            max_num_seqs=1024,
            max_model_len=32768,
            num_blocks=4096,
            block_size=16,
        )
    )
    drv = Driver(sched)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    b = Request("B", list(range(1000, 1500)), params)
    a = Request("A", [7 + i % 5000 for i in range(20000)], params)
    sched.add_request(b)
    # B prefills, then decodes until it knows 40 output tokens with token 41 in flight. A arrives in time
    # to get the rest of step k-1's budget: its first chunk, prompt positions 0..8190.
    for call in range(1, 42):
        if call == 41:
            sched.add_request(a)
        drv.step()
    assert counters_b(b) == (540, 540, 1)
    assert b.num_output_tokens == 40
    assert a.num_computed_tokens == 8191 and a.is_prefill_chunk
    assert sched.running == [b, a]
    assert len(sched.kv_cache_manager.req_to_blocks["A"][0]) == 512  # group 0, the only one
    assert len(sched.kv_cache_manager.req_to_blocks["B"][0]) == 34

    # S k: (B 1, A 8191); the output is built from the values before the step.
    out = drv.schedule()
    assert out.num_scheduled_tokens == {"B": 1, "A": 8191}
    assert out.total_num_scheduled_tokens == 8192
    assert out.scheduled_new_reqs == []
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["B", "A"]
    assert cached.num_computed_tokens == [540, 8191]
    assert cached.num_output_tokens == [41, 0]
    assert cached.new_block_ids[0] is None
    assert len(cached.new_block_ids[1][0]) == 512  # A: ceil(16382 / 16) = 1024 blocks, had 512
    assert len(sched.kv_cache_manager.req_to_blocks["B"][0]) == 34  # ceil(541 / 16)
    assert counters_b(b) == (540, 541, 2)
    assert a.num_computed_tokens == 16382 and a.is_prefill_chunk and a.num_output_placeholders == 0

    # U k-1: B gets t41, A (a chunk) produces nothing and gets no output.
    outputs = drv.update()
    assert [o.request_id for o in outputs] == ["B"]
    assert len(outputs[0].new_token_ids) == 1
    assert counters_b(b) == (541, 541, 1)
    assert a.num_computed_tokens == 16382 and a.is_prefill_chunk

    # S k+1: (1, 3618), 4573 tokens of budget left for waiting requests.
    out = drv.schedule()
    assert out.num_scheduled_tokens == {"B": 1, "A": 3618}
    assert 8192 - out.total_num_scheduled_tokens == 4573
    assert counters_b(b) == (541, 542, 2)
    assert a.num_computed_tokens == 20000 and not a.is_prefill_chunk and a.num_output_placeholders == 1

    # U k: B gets t42; A's step k was a chunk: still no token.
    outputs = drv.update()
    assert [o.request_id for o in outputs] == ["B"]
    assert counters_b(b) == (542, 542, 1)
    assert a.num_computed_tokens == 20000 and a.num_output_tokens == 0

    # S k+2: (1, 1): A decodes for the first time with its first token still in flight.
    out = drv.schedule()
    assert out.num_scheduled_tokens == {"B": 1, "A": 1}
    assert counters_b(b) == (542, 543, 2)
    assert a.num_computed_tokens == 20001 and a.num_output_placeholders == 2

    # U k+1: A gets its first token (sampled at the end of its last chunk).
    outputs = drv.update()
    assert sorted(o.request_id for o in outputs) == ["A", "B"]
    assert counters_b(b) == (543, 543, 1)
    assert a.num_output_tokens == 1 and a.num_tokens == 20001 and a.num_output_placeholders == 1


def test_long_prefill_threshold_caps_one_prompt() -> None:
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=8192,
            max_model_len=32768,
            num_blocks=4096,
            long_prefill_token_threshold=1000,
        )
    )
    sched.add_request(Request("A", list(range(5000)), SamplingParams(max_tokens=4)))
    sched.add_request(Request("C", list(range(100, 3100)), SamplingParams(max_tokens=4)))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 1000, "C": 1000}


def test_max_num_seqs_caps_admission() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=3, max_model_len=1024, num_blocks=256)
    )
    for i in range(5):
        sched.add_request(Request(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=4)))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert len(sched.waiting) == 2
