"""The sampler: greedy, temperature, top-k, top-p, min-p and per-request seeds, vectorised over the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-5


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the rows being sampled this step (tensors on the logits' device)."""

    all_greedy: bool
    temperature: torch.Tensor  # float32 [B]; 0 marks a greedy row
    top_k: torch.Tensor | None  # int64 [B]; 0 = off. None when no row uses it
    top_p: torch.Tensor | None  # float32 [B]; 1 = off
    min_p: torch.Tensor | None  # float32 [B]; 0 = off
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded requests)


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k / nucleus / min-p set of its row."""
    if md.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(-1, descending=True)
    if md.top_k is not None:
        k = md.top_k.clamp(min=1, max=logits.shape[-1])
        k = torch.where(md.top_k > 0, k, logits.shape[-1])
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if md.top_p is not None:
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop = (cum - probs) >= md.top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits float32 [B, V] -> sampled token ids int64 [B]."""
        greedy = logits.argmax(-1)
        if md.all_greedy:
            return greedy
        temp = md.temperature
        is_greedy = temp < _EPS
        scaled = logits / torch.where(is_greedy, 1.0, temp).unsqueeze(1)
        scaled = apply_top_k_top_p_min_p(scaled, md)
        probs = scaled.softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Seeded rows draw from their own
        # generator, so their tokens do not depend on what else is in the batch.
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(-1)
        return torch.where(is_greedy, greedy, sampled)
