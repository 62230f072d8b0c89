"""The sampler, vectorised over the batch (vLLM's order of operations).

1. grammar bitmask (structured output): disallowed tokens -> -inf
2. logprobs, if any row asks: log-softmax of these logits (vLLM's default "raw_logprobs": before
   penalties, bias, temperature and top-k/top-p/min-p; after the grammar mask)
3. allowed_token_ids, bad words, min_tokens (stop tokens -> -inf), logit_bias
4. penalties: repetition (prompt + output tokens), frequency and presence (output tokens only)
5. greedy argmax, or temperature -> min-p -> top-k -> top-p -> an exponential race (per-request
   generators for seeds)

No step loops over the vocabulary in Python; the only per-row loop is over the seeded generators.
A row whose every token is masked (a dead end) samples -1: the scheduler finishes it with an error reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aioengine.gpu.backend import REFERENCE_OPS, Ops

_EPS = 1e-5
_NEG_INF = float("-inf")


@dataclass(slots=True)
class Penalties:
    batch_rows: torch.Tensor  # int64 [P]: the rows (of the batch) that have a penalty
    output_counts: torch.Tensor  # int32 [P, V]
    prompt_mask: torch.Tensor  # bool [P, V]
    presence: torch.Tensor | None  # float32 [P]; None when every row has 0
    frequency: torch.Tensor | None  # float32 [P]; None when every row has 0
    repetition: torch.Tensor | None  # float32 [P]; None when every row has 1


@dataclass(slots=True)
class BadWords:
    """Multi-token bad words: ban last_token in batch_rows where the word's prefix ends the output (match)."""

    batch_rows: torch.Tensor  # int64 [K]
    last_token: torch.Tensor  # int64 [K]
    match: torch.Tensor  # bool [K]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of the rows being sampled this step (tensors on the logits' device)."""

    all_greedy: bool
    temperature: torch.Tensor  # float32 [B]; 0 marks a greedy row
    top_k: torch.Tensor | None  # int64 [B]; 0 = off. None when no row uses it
    top_p: torch.Tensor | None  # float32 [B]; 1 = off
    min_p: torch.Tensor | None  # float32 [B]; 0 = off
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded requests)
    max_num_logprobs: int | None = None  # None: no row wants logprobs
    penalties: Penalties | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) -> -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, biases)
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (restricted rows, rows, ids)
    bad_words: BadWords | None = None
    grammar: tuple[list[int], torch.Tensor] | None = None  # (rows, int32 bitmask [B, ceil(V / 32)])

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, with nothing that changes the logits and no logprobs."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.grammar is None
            and self.penalties is None
            and self.banned is None
            and self.logit_bias is None
            and self.allowed is None
            and self.bad_words is None
        )

    @property
    def may_dead_end(self) -> bool:
        """Whether some row may have every token masked. A grammar alone always allows a token (xgrammar
        never leaves a live matcher without one); with other masks (min_tokens hiding the EOS a complete
        grammar needs) it may not. A missed dead end still ends: the grammar rejects the token."""
        return self.allowed is not None or self.banned is not None or self.bad_words is not None


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # int64 [B]; -1 where no token was allowed
    # (token ids [B, 1 + k], logprobs [B, 1 + k], rank of the sampled token [B]); column 0 is the sampled one
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [n, W] (bit j of word w: token 32 * w + j allowed) -> bool [n, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of these rows -> -inf, in place (float32 logits); bitmask row i masks logits row i.

    xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU) is faster than unpacking in torch on a CPU.
    """
    try:
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    except ImportError:
        idx = torch.tensor(rows, device=logits.device)
        allowed = unpack_bitmask(bitmask.index_select(0, idx), logits.shape[1])
        logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed, _NEG_INF))


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """vLLM's (and OpenAI's) penalties, in place on the penalised rows.

    repetition (the CTRL rule): a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when not. frequency: minus penalty * count in the output.
    presence: minus penalty if the token occurs in the output.
    """
    rows = pen.batch_rows
    x = logits.index_select(0, rows)
    counts = pen.output_counts
    in_output = counts > 0
    if pen.repetition is not None:
        rep = pen.repetition.unsqueeze(1)
        seen = pen.prompt_mask | in_output
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if pen.frequency is not None:
        x = x - pen.frequency.unsqueeze(1) * counts
    if pen.presence is not None:
        x = x - pen.presence.unsqueeze(1) * in_output
    logits.index_copy_(0, rows, x)


def apply_constraints(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Step 3 in place: allowed_token_ids, bad words, min_tokens, logit_bias."""
    if md.allowed is not None:
        restricted, rows, ids = md.allowed
        mask = torch.zeros_like(logits, dtype=torch.bool)
        mask[restricted] = True
        mask[rows, ids] = False
        logits.masked_fill_(mask, _NEG_INF)
    if md.banned is not None:
        logits.index_put_(md.banned, torch.tensor(_NEG_INF, device=logits.device))
    if md.bad_words is not None:
        bw = md.bad_words
        cur = logits[bw.batch_rows, bw.last_token]
        logits.index_put_((bw.batch_rows, bw.last_token), torch.where(bw.match, _NEG_INF, cur))
    if md.logit_bias is not None:
        rows, ids, vals = md.logit_bias
        logits.index_put_((rows, ids), vals, accumulate=True)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, md: SamplingMetadata, min_p: bool = True, top_k_top_p: bool = True
) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k / nucleus / min-p set of its row (by sorting)."""
    if min_p and md.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if not top_k_top_p or (md.top_k is None and md.top_p is None):
        return logits
    sorted_logits, sorted_idx = logits.sort(-1, descending=True)
    if md.top_k is not None:
        k = md.top_k.clamp(min=1, max=logits.shape[-1])
        k = torch.where(md.top_k > 0, k, logits.shape[-1])
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if md.top_p is not None:
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop = (cum - probs) >= md.top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, 1 + k], logprobs [N, 1 + k], ranks [N]) for token_ids [N]; columns 1.. are the top-k."""
    token_ids = token_ids.clamp(min=0).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids, top_ids], 1), torch.cat([chosen, top_lp], 1), ranks
    return token_ids, chosen, ranks


class Sampler:
    def __init__(
        self,
        seed: int,
        device: torch.device,
        ops: Ops = REFERENCE_OPS,
        top_p_from_candidates: bool = False,
        grammar_check_argmax_first: bool = False,
    ) -> None:
        """The two switches pay where sorting or masking the whole vocabulary is dear (the CPU backend sets
        them): ``top_p_from_candidates`` samples top-k / top-p rows among the 256 best tokens where their
        nucleus lies within them; ``grammar_check_argmax_first`` masks only the greedy rows whose argmax
        the grammar forbids."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.argmax = ops.argmax
        self.top_p_from_candidates = top_p_from_candidates
        self.grammar_check_argmax_first = grammar_check_argmax_first

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] (modified in place) -> sampled token ids int64 [B] and, if asked, logprobs."""
        if md.plain_greedy:  # nothing to apply: skip the sampler's float32 temporaries
            return SamplerOutput(self.argmax(logits))
        if logits.dtype != torch.float32:
            logits = logits.float()
        # A greedy batch without logprobs checks its argmax against the bitmask first and masks only the
        # rows whose argmax the grammar forbids (-inf commutes with bias and penalties).
        check_first = (
            self.grammar_check_argmax_first
            and md.grammar is not None
            and md.all_greedy
            and md.max_num_logprobs is None
        )
        if md.grammar is not None and not check_first:
            apply_grammar_bitmask(logits, *md.grammar)
        raw_logprobs = logits.log_softmax(-1) if md.max_num_logprobs is not None else None
        apply_constraints(logits, md)
        if md.penalties is not None:
            apply_penalties(logits, md.penalties)
        if check_first:
            assert md.grammar is not None  # check_first needs a grammar
            sampled = self._greedy_under_grammar(logits, *md.grammar)
        else:
            sampled = self._sample(logits, md)
        if md.may_dead_end:
            sampled = torch.where(torch.isneginf(logits).all(-1), -1, sampled)
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None  # raw_logprobs is computed only then
            out.logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return out

    @staticmethod
    def _greedy_under_grammar(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
        greedy = logits.argmax(-1)
        idx = torch.tensor(rows, dtype=torch.int64)
        tok = greedy.index_select(0, idx)
        words = bitmask.index_select(0, idx).gather(1, (tok // 32).unsqueeze(1)).squeeze(1)
        forbidden = ((words >> (tok % 32).to(torch.int32)) & 1) == 0
        redo = idx[forbidden].tolist()
        if redo:
            apply_grammar_bitmask(logits, redo, bitmask)
            redo_t = torch.tensor(redo, dtype=torch.int64)
            greedy[redo_t] = logits.index_select(0, redo_t).argmax(-1)
        return greedy

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(-1)
        if md.all_greedy:
            return greedy
        temp = md.temperature
        is_greedy = temp < _EPS
        scaled = logits / torch.where(is_greedy, 1.0, temp).unsqueeze(1)
        if md.min_p is not None:
            scaled = apply_top_k_top_p_min_p(scaled, md, top_k_top_p=False)
        if (md.top_k is None and md.top_p is None) or not self.top_p_from_candidates:
            scaled = apply_top_k_top_p_min_p(scaled, md, min_p=False)
            return torch.where(is_greedy, greedy, self._race(scaled, md.generators))
        # Rows whose top-k / nucleus lies within the 256 best tokens sample among those; the others as before.
        vals, idx, restricted, in_cands = top_k_top_p_candidates(scaled, md.top_k, md.top_p)
        sampled = greedy.clone()
        sampling = ~is_greedy
        groups = (in_cands & sampling, ~restricted & sampling, restricted & ~in_cands & sampling)
        for kind, mask in enumerate(groups):
            rows = mask.nonzero().flatten()
            if not rows.numel():
                continue
            gens = {j: md.generators[row] for j, row in enumerate(rows.tolist()) if row in md.generators}
            if kind == 0:  # among the candidates
                ids = idx.index_select(0, rows)
                winner = self._race(vals.index_select(0, rows), gens, ids, scaled.shape[1])
                sampled[rows] = ids.gather(1, winner.unsqueeze(1)).squeeze(1)
            elif kind == 1:  # no top-k / top-p: the whole vocabulary
                sampled[rows] = self._race(scaled.index_select(0, rows), gens)
            else:  # a nucleus wider than the candidates (a flat distribution): sort the whole rows
                sub = SamplingMetadata(
                    False, temp.index_select(0, rows), _rows(md.top_k, rows), _rows(md.top_p, rows), None, {}
                )
                sampled[rows] = self._race(apply_top_k_top_p_min_p(scaled.index_select(0, rows), sub), gens)
        return sampled

    def _race(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        token_ids: torch.Tensor | None = None,
        vocab_size: int = 0,
    ) -> torch.Tensor:
        """One draw per row from softmax(logits): the column index of the winner.

        token_ids: the token of each column when the columns are candidates. A seeded row then still draws
        one uniform per vocabulary token and each candidate takes its own token's: if another batch shape
        reorders two near-equal candidates, each keeps its noise and the winner stays.
        """
        probs = logits.softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and a small change of the logits
        # (another batch shape) rarely changes the winner. E = -log(U): uniforms are cheaper to draw on a
        # CPU than exponential_(); U = 0 gives E = inf, a lost race (probability 2^-24 per token).
        # Seeded rows draw from their own generator, so their tokens do not depend on the batch.
        noise = torch.rand(probs.shape, generator=self.generator, device=probs.device)
        for row, gen in generators.items():
            if token_ids is None:
                noise[row] = torch.rand(probs.shape[1], generator=gen, device=probs.device)
            else:
                noise[row] = torch.rand(vocab_size, generator=gen, device=probs.device)[token_ids[row]]
        noise.log_().neg_()
        return (probs / noise).argmax(-1)


def _rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, rows)


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, num_candidates: int = 256
) -> tuple[torch.Tensor, ...]:
    """The best tokens of each row, with those outside its top-k / nucleus set to -inf.

    Returns (values [B, K] sorted, token ids [B, K], restricted [B], in_candidates [B]): restricted where
    top-k or top-p applies to the row; in_candidates where, besides, its whole kept set lies among the K
    candidates, so sampling among them is exact. Tokens tied with the k-th are all kept.
    """
    num_rows, vocab = logits.shape
    k_max = min(vocab, num_candidates)
    vals, idx = logits.topk(k_max, dim=-1)
    keep = torch.full((num_rows,), k_max, dtype=torch.int64, device=logits.device)
    restricted = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    exact = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    confined = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)  # top-k within the candidates
    if top_k is not None:
        has_k = (top_k > 0) & (top_k < vocab)
        restricted |= has_k
        kth = vals.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
        # Every token tied with the k-th is kept, as when sorting the vocabulary (bf16 logits tie often;
        # keeping some of the tied tokens by position would depend on the batch shape).
        n_k = (vals >= kth).sum(-1)
        confined = has_k & (top_k <= k_max) & ((n_k < k_max) | (k_max == vocab))
        exact &= ~has_k | confined
        keep = torch.where(confined, n_k, keep)
    pos = torch.arange(k_max, device=logits.device)
    vals = vals.masked_fill(pos >= keep.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        has_p = top_p < 1.0
        restricted |= has_p
        # Probabilities under the top-k-masked distribution: over the candidates when top-k confines the
        # row to them, else over the whole row.
        norm = torch.where(confined, vals.logsumexp(-1), logits.logsumexp(-1))
        probs = (vals - norm.unsqueeze(1)).exp()
        cum = probs.cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        n_p = ((cum - probs) < top_p.unsqueeze(1)).sum(-1)
        exact &= ~has_p | confined | (cum[:, -1] >= top_p)  # the nucleus ends among the candidates
        keep = torch.where(has_p, torch.minimum(keep, n_p), keep)
        vals = vals.masked_fill(pos >= keep.unsqueeze(1), _NEG_INF)
    return vals, idx, restricted, restricted & exact
