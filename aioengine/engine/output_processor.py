"""Stop 12: a step's EngineCoreOutputs become detokenized deltas in each live request's stream."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from aioengine.engine.client import RequestListener
from aioengine.engine.handle import RequestState
from aioengine.outputs import CompletionOutput, Logprob, RequestOutput
from aioengine.sched.output import EngineCoreOutput, TokenLogprobs
from aioengine.sched.request import RequestStatus
from aioengine.sched.scheduler import Scheduler


class OutputProcessor:
    """The live requests (``states`` by id, ``children`` by completion id) and what each step hands them.

    Listeners see every step's output of every request; the consumer's queue gets it, unless only the final
    output is awaited (vLLM's FINAL_ONLY), which then carries the deltas kept for it.
    """

    def __init__(self) -> None:
        self.tokenizer: Any = None  # set once start() has loaded it (logprobs decode single tokens)
        self.states: dict[str, RequestState] = {}
        self.children: dict[str, tuple[RequestState, int]] = {}  # completion id -> (its request, index)
        self.request_listeners: list[RequestListener] = []
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs

    # ---- the live-request registry: only these methods change it --------------------------------------
    def add(self, state: RequestState) -> None:
        """Register a new request and its completions (child ids); the id must be free."""
        assert state.request_id not in self.states, state.request_id
        self.states[state.request_id] = state
        for i, cid in enumerate(state.child_ids):
            self.children[cid] = (state, i)

    def get(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)

    def child(self, child_id: str) -> RequestState | None:
        entry = self.children.get(child_id)
        return None if entry is None else entry[0]

    def live(self) -> list[RequestState]:
        return list(self.states.values())

    def __len__(self) -> int:
        return len(self.states)

    @staticmethod
    def unfinished(state: RequestState) -> list[str]:
        """The ids of ``state``'s completions still running."""
        if state.finished:
            return []
        return [cid for cid, done in zip(state.child_ids, state.child_done, strict=True) if not done]

    def abort(self, state: RequestState, reason: str) -> None:
        """End ``state``'s unfinished completions now with finish_reason ``reason``."""
        if state.finished:
            return
        live = self.unfinished(state)
        completions = [CompletionOutput(state.child_ids.index(cid), "", [], reason) for cid in live]
        for cid in live:
            self.children.pop(cid, None)
        state.child_done = [True] * len(state.child_ids)
        self.finish(state, completions)

    def fail_all(self, err: BaseException) -> None:
        """The engine died: every live request's stream raises ``err``, and the registry empties."""
        for state in self.states.values():
            state.finished = True
            state.queue.put_nowait(err)
        self.states.clear()
        self.children.clear()

    def finish(self, state: RequestState, completions: list[CompletionOutput]) -> None:
        """The last output of ``state``: it leaves the live requests."""
        state.finished = True
        self.states.pop(state.request_id, None)
        self.emit(state, completions)

    def emit(self, state: RequestState, completions: list[CompletionOutput], keep: bool = False) -> None:
        """One step's ``completions`` of ``state``: to the listeners, then to the consumer's queue with the
        deltas kept for it before; or, with ``keep`` (only the final output is awaited), kept for it."""
        if keep and not self.request_listeners:  # nobody to show this step to: no output object
            state.buffered.extend(completions)
            return
        out = RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            state.finished,
            state.num_cached_tokens,
            {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time},
        )
        if not keep and state.pending_prompt_logprobs is not None:
            out.prompt_logprobs, state.pending_prompt_logprobs = state.pending_prompt_logprobs, None
        for listener in self.request_listeners:
            listener(out, state)
        if keep:
            state.buffered.extend(completions)
            return
        if state.buffered:
            out = replace(out, outputs=state.buffered + completions)
            state.buffered = []
        state.queue.put_nowait(out)

    def process(self, outputs: list[EngineCoreOutput], scheduler: Scheduler) -> None:
        """A step's outputs: detokenized (a stop string finishes its completion in ``scheduler``), grouped by
        request, and emitted."""
        grouped: dict[int, tuple[RequestState, list[CompletionOutput]]] = {}
        now = time.monotonic()
        for o in outputs:
            entry = self.children.get(o.request_id)
            if entry is None:
                continue
            state, idx = entry
            detok = state.detokenizers[idx]
            finish_reason, stop_reason = o.finish_reason, o.stop_reason
            token_ids = o.new_token_ids
            if len(token_ids) > 1 and detok.stop:  # verified drafts: a stop string may end before the last
                text, used = "", 0
                while used < len(token_ids) and detok.stop_reason is None:
                    used += 1
                    text += detok.add_tokens(
                        token_ids[used - 1 : used], finish_reason is not None and used == len(token_ids)
                    )
                token_ids = token_ids[:used]
            else:
                text = detok.add_tokens(token_ids, finish_reason is not None)
            if detok.stop_reason is not None:
                if finish_reason is None:  # a stop string: end this completion now
                    scheduler.finish_requests(o.request_id, RequestStatus.FINISHED_STOPPED)
                finish_reason, stop_reason = "stop", detok.stop_reason
            if state.first_token_time is None and o.new_token_ids:
                state.first_token_time = now
            if o.num_cached_tokens:
                state.num_cached_tokens = o.num_cached_tokens
            if o.pooling_output is not None:
                state.embedding = o.pooling_output
            if finish_reason is not None:
                state.child_done[idx] = True
                del self.children[o.request_id]
            logprobs = None
            if o.new_logprobs is not None:
                logprobs = [self._logprob_dict(e) for e in o.new_logprobs[: len(token_ids)]]
            elif state.params.logprobs is not None:
                logprobs = []
            if o.new_prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None] + [self._logprob_dict(e) for e in o.new_prompt_logprobs]
                state.pending_prompt_logprobs = state.prompt_logprobs
            grouped.setdefault(id(state), (state, []))[1].append(
                CompletionOutput(idx, text, token_ids, finish_reason, stop_reason, logprobs)
            )
        for state, completions in grouped.values():
            if all(state.child_done):
                self.finish(state, completions)
            else:
                # Only the final output awaited (vLLM's FINAL_ONLY): keep the deltas for it instead of waking
                # the consumer every step; the listeners still see each step.
                self.emit(state, completions, keep=state.final_only)

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        """{chosen token: its Logprob, then the top-k by rank}; ranks are 1-based."""
        ids, lps, rank = entry
        cache = self._token_text
        out: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids, lps, strict=True)):
            if tid in out:
                continue
            text = cache.get(tid)
            if text is None:
                text = cache[tid] = self.tokenizer.decode([tid])
            out[tid] = Logprob(lp, rank if j == 0 else j, text)
        return out
