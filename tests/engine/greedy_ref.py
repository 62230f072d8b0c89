"""transformers' greedy tokens for a prompt, and the parity rule of the real-model tests: equal token for
token, except from a position where the reference's top-2 logits are within 1e-3 (either may be taken)."""

from __future__ import annotations

import torch

NEW_TOKENS = 8


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_equal_up_to_ties(hf, prompt: list[int], want: list[int], got: list[int]) -> None:
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        if w != g:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + want[:k]])).logits[0, -1]
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) <= 1e-3, (
                f"token {k}: {g} != {w}, top-2 gap {float(top2[0] - top2[1])}"
            )
            return  # after a tie the two continuations may differ
