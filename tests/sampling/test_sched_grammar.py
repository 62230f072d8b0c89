"""The scheduler side of structured output and logprobs, without a model: the deferral flag of stop 8,
grammar advance in update_from_output, dead ends, logprobs passing through, no prefix-cache reads for
prompt logprobs."""

from __future__ import annotations

from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import GrammarOutput, ModelRunnerOutput
from aioengine.sched.request import Request
from aioengine.sched.scheduler import Scheduler, SchedulerConfig

EOS = 2


class FakeGrammar:
    """Accepts tokens from `allowed`; terminated after `length` tokens."""

    def __init__(self, allowed=range(100, 200), length=1000) -> None:
        self.allowed, self.length, self.accepted = set(allowed), length, []

    def accept_token(self, token: int) -> bool:
        if token not in self.allowed:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeManager:
    def grammar_bitmask(self, req_ids, grammars):
        return GrammarOutput(req_ids, [list(g.accepted) for g in grammars])


def scheduler(**kw) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, num_blocks=64, block_size=4, **kw))
    s.structured_output_manager = FakeManager()
    return s


def add(s: Scheduler, rid: str, grammar=None, **params) -> Request:
    r = Request(
        rid, list(range(10, 18)), SamplingParams(max_tokens=params.pop("max_tokens", 20), **params), EOS
    )
    r.structured_output = grammar
    s.add_request(r)
    return r


def sample(so, tokens: dict[str, int], **extra) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[tokens[r]] if r in tokens else [] for r in ids], **extra)


def test_pending_flag_only_for_structured_requests_with_a_token_in_flight():
    s = scheduler()
    g = FakeGrammar()
    add(s, "g", g)
    add(s, "plain")
    so1 = s.schedule()  # prefills: both sample, nothing in flight yet
    assert so1.structured_output_request_ids == ["g"] and not so1.pending_structured_output_tokens
    assert s.get_grammar_bitmask(so1).req_ids == ["g"]
    so2 = s.schedule()  # both decode with their first token in flight
    assert so2.pending_structured_output_tokens
    # the engine defers step 2's sampling until step 1 is processed: then the grammar knows token 100
    s.update_from_output(so1, sample(so1, {"g": 100, "plain": 5}))
    assert s.get_grammar_bitmask(so2).bitmask == [[100]]
    s.update_from_output(so2, sample(so2, {"g": 101, "plain": 6}))
    assert g.accepted == [100, 101]

    s2 = scheduler()
    add(s2, "a")
    add(s2, "b")
    s2.schedule()
    so = s2.schedule()
    assert not so.pending_structured_output_tokens and s2.get_grammar_bitmask(so) is None


def test_grammar_rejection_dead_end_and_termination_finish_with_reasons():
    s = scheduler()
    add(s, "rejected", FakeGrammar())
    add(s, "dead", FakeGrammar())
    add(s, "done", FakeGrammar(length=1), ignore_eos=True)
    add(s, "plain-dead")
    so = s.schedule()
    outs = {
        o.request_id: o
        for o in s.update_from_output(
            so, sample(so, {"rejected": 7, "dead": -1, "done": 150, "plain-dead": -1})
        )
    }
    assert (outs["rejected"].finish_reason, outs["rejected"].stop_reason) == (
        "error",
        "grammar_rejected_token",
    )
    assert outs["rejected"].new_token_ids == []
    assert (outs["dead"].finish_reason, outs["dead"].stop_reason) == ("error", "no_allowed_tokens")
    assert (outs["plain-dead"].finish_reason, outs["plain-dead"].stop_reason) == (
        "error",
        "no_allowed_tokens",
    )
    assert outs["done"].finish_reason == "stop" and outs["done"].new_token_ids == [150]
    assert not s.has_requests() and s.kv_cache_manager.usage == 0.0


def test_logprobs_pass_through_to_the_outputs():
    s = scheduler()
    add(s, "a", logprobs=1, prompt_logprobs=1)
    add(s, "b")
    so = s.schedule()
    lp = ([5, 6], [-0.1, -2.5], 1)
    prompt = [([11], [-3.0], 7)] * 7
    outs = {
        o.request_id: o
        for o in s.update_from_output(
            so, sample(so, {"a": 5, "b": 9}, logprobs=[[lp], None], prompt_logprobs={"a": prompt})
        )
    }
    assert outs["a"].new_logprobs == [lp] and outs["a"].new_prompt_logprobs == prompt
    assert outs["b"].new_logprobs is None and outs["b"].new_prompt_logprobs is None


def test_prompt_logprobs_requests_do_not_read_the_prefix_cache():
    s = scheduler()
    add(s, "first", max_tokens=1)
    so = s.schedule()
    s.update_from_output(so, sample(so, {"first": 5}))
    add(s, "cached", max_tokens=1)
    add(s, "with-prompt-logprobs", max_tokens=1, prompt_logprobs=0)
    so = s.schedule()
    new = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
    assert new == {"cached": 4, "with-prompt-logprobs": 0}
