"""Engine logprobs ({token id: Logprob} per token) in the two OpenAI formats: chat and legacy completion."""

from __future__ import annotations

from typing import Any

from aioengine.engine.client import EngineClient
from aioengine.outputs import Logprob

_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way

TokenLogprobs = dict[int, Logprob]  # one token's: the chosen token first, then the top-k by rank
LegacyLogprobs = dict[str, list[Any]]  # {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


def _text(engine: EngineClient, tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else engine.tokenizer.decode([tid])


def _top(d: TokenLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k best entries by rank (the chosen token is listed first in `d` even when it ranks lower)."""
    if k <= 0:
        return []
    return sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:k]


def _chosen(d: TokenLogprobs, tid: int) -> Logprob:
    lp = d.get(tid)
    return lp if lp is not None else next(iter(d.values()))


def chat_logprobs(
    engine: EngineClient, token_ids: list[int], logprobs: list[TokenLogprobs] | None, k: int
) -> dict[str, list[dict[str, Any]]]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}, one entry per token."""
    content = []
    for tid, d in zip(token_ids, logprobs or [], strict=False):
        lp = _chosen(d, tid)
        text = _text(engine, tid, lp)
        content.append(
            {
                "token": text,
                "logprob": max(lp.logprob, _FLOOR),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _text(engine, i, p)),
                        "logprob": max(p.logprob, _FLOOR),
                        "bytes": list(t.encode()),
                    }
                    for i, p in _top(d, k)
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(engine: EngineClient, plp: list[TokenLogprobs | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}}, the prompt's own token first."""
    if plp is None:
        return None
    return [
        None
        if d is None
        else {
            str(tid): {
                "logprob": max(lp.logprob, _FLOOR),
                "rank": lp.rank,
                "decoded_token": _text(engine, tid, lp),
            }
            for tid, lp in d.items()
        }
        for d in plp
    ]


class CompletionLogprobs:
    """The legacy format for one choice; keeps the running text offset across stream chunks."""

    def __init__(self, engine: EngineClient, k: int, offset: int = 0) -> None:
        self.engine = engine
        self.k = k
        self.offset = offset

    def render(
        self, token_ids: list[int], logprobs: list[TokenLogprobs] | list[TokenLogprobs | None] | None
    ) -> LegacyLogprobs:
        """Entries for these tokens; a token without logprobs (None: the first prompt token, when `echo`
        shows the prompt) gets null, as in OpenAI's and vLLM's answers."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for tid, d in zip(token_ids, logprobs or [], strict=False):
            lp = _chosen(d, tid) if d else None
            text = _text(self.engine, tid, lp) if lp is not None else self.engine.tokenizer.decode([tid])
            tokens.append(text)
            token_logprobs.append(None if lp is None else max(lp.logprob, _FLOOR))
            top.append(
                {_text(self.engine, i, p): max(p.logprob, _FLOOR) for i, p in _top(d, self.k)}
                if self.k and d
                else None
            )
            text_offset.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        }
