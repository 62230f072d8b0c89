"""A fake model runner and an engine-like driver with a batch queue of 2, for scheduler tests."""

from __future__ import annotations

from collections import deque

from aioengine.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from aioengine.sched.scheduler import Scheduler


def token_at(req_id: str, position: int) -> int:
    """The token a deterministic 'model' samples at a position: recompute after preemption gives it again."""
    return 10 + hash((req_id, position)) % 1000


def fake_run(sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """Samples one token for every request that is not a prefill chunk, as the runner does."""
    req_ids, sampled = [], []
    before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
    before.update(
        zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens, strict=True)
    )
    for rid, n in out.num_scheduled_tokens.items():
        req_ids.append(rid)
        request = sched.requests[rid]
        sampled.append([] if request.is_prefill_chunk else [token_at(rid, before[rid] + n)])
    return ModelRunnerOutput(req_ids, sampled)


class Driver:
    """step(): schedule, enqueue step k; if the queue is full (or nothing new ran), update with step k-1."""

    def __init__(self, sched: Scheduler, batch_queue_size: int = 2) -> None:
        self.sched = sched
        self.size = batch_queue_size
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def schedule(self) -> SchedulerOutput | None:
        if not self.sched.has_requests():
            return None
        out = self.sched.schedule()
        if out.total_num_scheduled_tokens == 0:
            return None
        self.queue.appendleft((out, fake_run(self.sched, out)))
        return out

    def update(self) -> list[EngineCoreOutput]:
        out, result = self.queue.pop()
        outputs = self.sched.update_from_output(out, result)
        for o in outputs:
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                self.finish_reasons[o.request_id] = o.finish_reason
        return outputs

    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.schedule()
        if not self.queue:
            return []
        if len(self.queue) < self.size and scheduled is not None and self.sched.has_requests():
            return []
        return self.update()

    def run_to_completion(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("requests did not finish")
