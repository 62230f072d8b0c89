"""Persistent per-request state of the model runner: one row per live request, updated from diffs."""

from __future__ import annotations

import numpy as np
import torch

from aioengine.gpu.backend import Staging
from aioengine.gpu.sampler import BadWords, Penalties, SamplingMetadata
from aioengine.sched.output import NewRequestData

_EPS = 1e-5


class RequestStates:
    """Rows of host arrays (token ids, block table, sampling knobs) plus device state written by sampling.

    Known tokens (the prompt, or everything known at resume) live in token_ids; a decode's input is the
    token this request sampled last, read from last_sampled_tokens where the previous step wrote it.

    Sampling state that depends on token *values* lives on the device and is updated from the sampled
    tokens (with async scheduling the host does not know the last token when it plans the next step):
    output_counts (penalties), output_hist (multi-token bad words). Counts that depend only on how many
    tokens were sampled (num_output, for min_tokens) are host arrays: the worker knows which rows sampled.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device,
        vocab_size: int | None = None,
        *,
        staging: Staging,
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int64)
        # one block table per KV cache group (sched/kv_cache_spec.py)
        self.block_table = np.zeros((num_kv_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # the row's LoRA adapter (0: the base model)
        self.generators: dict[int, torch.Generator] = {}
        self.last_sampled_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.device = device
        self.staging = staging  # host arrays -> device (CUDA: without waiting for the GPU)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Penalties, min_tokens, logprobs (host knobs).
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)  # the user's prompt length
        self.num_output = np.zeros(max_num_reqs, dtype=np.int64)  # outputs known at add + one per sample
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none (or already sent)
        # Sparse per-row knobs (only rows that use them).
        self.min_tokens_stop_ids: dict[int, list[int]] = {}
        self.logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.allowed_token_ids: dict[int, torch.Tensor] = {}
        self.bad_words_single: dict[int, list[int]] = {}
        self.bad_words_multi: dict[int, list[list[int]]] = {}
        self.prompt_logprobs: dict[int, list] = {}  # row -> TokenLogprobs computed so far (chunked prefill)
        # Device state, allocated at the first request that needs it.
        self.output_counts: torch.Tensor | None = None  # int32 [R, V]: how often each token was sampled
        self.prompt_mask: torch.Tensor | None = None  # bool [R, V]: token occurs in the prompt
        self.output_hist: torch.Tensor | None = None  # int64 [R, max_model_len]: the sampled tokens

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, data: NewRequestData) -> None:
        assert data.req_id not in self.row_of, f"request {data.req_id} already has a row"
        row = self._free_rows.pop()
        self.row_of[data.req_id] = row
        n = len(data.prompt_token_ids)
        self.token_ids[row, :n] = data.prompt_token_ids
        self.prefill_len[row] = n
        self.num_blocks[:, row] = 0
        self.append_blocks(row, data.block_ids)
        p = data.sampling_params
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.lora_id[row] = data.lora_id
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed)
            self.generators[row] = gen
        num_prompt = data.num_prompt_tokens
        num_output = n - num_prompt  # > 0 for a request resumed after preemption
        self.num_prompt[row] = num_prompt
        self.num_output[row] = num_output
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        # A resumed request already sent its prompt logprobs with its first token.
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None or num_output else p.prompt_logprobs
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        pen = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        self.has_penalties[row] = pen
        if pen:
            counts, prompt_mask = self._penalty_tensors()
            tokens = self.staging.to_device(np.asarray(data.prompt_token_ids, dtype=np.int64))
            counts[row] = torch.bincount(tokens[num_prompt:], minlength=counts.shape[1]).to(torch.int32)
            prompt_mask[row] = False
            prompt_mask[row, tokens[:num_prompt]] = True
        if p.min_tokens > num_output:
            stop_ids = list(p.stop_token_ids)
            if data.eos_token_id is not None and not p.ignore_eos:
                stop_ids.append(data.eos_token_id)
            if stop_ids:
                self.min_tokens_stop_ids[row] = stop_ids
        if p.logit_bias:
            self.logit_bias[row] = (
                self.staging.to_device(np.array(list(p.logit_bias), dtype=np.int64)),
                self.staging.to_device(np.array(list(p.logit_bias.values()), dtype=np.float32)),
            )
        if p.allowed_token_ids is not None:
            self.allowed_token_ids[row] = self.staging.to_device(
                np.array(p.allowed_token_ids, dtype=np.int64)
            )
        if p.bad_words_token_ids:
            single = [ids[0] for ids in p.bad_words_token_ids if len(ids) == 1]
            multi = [list(ids) for ids in p.bad_words_token_ids if len(ids) > 1]
            if single:
                self.bad_words_single[row] = single
            if multi:
                self.bad_words_multi[row] = multi
                hist = self._output_hist()
                if num_output:
                    hist[row, :num_output] = self.staging.to_device(
                        np.asarray(data.prompt_token_ids[num_prompt:], dtype=np.int64)
                    )

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        for g, ids in enumerate(block_ids):
            start = self.num_blocks[g, row]
            self.block_table[g, row, start : start + len(ids)] = ids
            self.num_blocks[g, row] = start + len(ids)

    def slot_mappings(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> list[np.ndarray]:
        """Per KV group: the cache slot (int64) of each ``positions[i]`` of the request in row ``rows[i]``."""
        return [
            table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
            for table in self.block_table
        ]

    def block_tables(self, rows: np.ndarray, num_blocks: int) -> list[np.ndarray]:
        """Per KV group: the first ``num_blocks`` block ids of each row in ``rows`` (contiguous)."""
        return [np.ascontiguousarray(table[rows, :num_blocks]) for table in self.block_table]

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return  # e.g. preempted earlier, finished before resuming
        self.generators.pop(row, None)
        for sparse in (
            self.min_tokens_stop_ids,
            self.logit_bias,
            self.allowed_token_ids,
            self.bad_words_single,
            self.bad_words_multi,
            self.prompt_logprobs,
        ):
            sparse.pop(row, None)
        self.has_penalties[row] = False
        self.num_logprobs[row] = -1
        self.num_prompt_logprobs[row] = -1
        self._free_rows.append(row)

    def _penalty_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None:
            assert self.vocab_size is not None, "penalties need the vocabulary size"
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None  # made together with output_counts
        return self.output_counts, self.prompt_mask

    def _output_hist(self) -> torch.Tensor:
        if self.output_hist is None:
            self.output_hist = torch.zeros(
                (self.max_num_reqs, self.max_model_len), dtype=torch.int64, device=self.device
            )
        return self.output_hist

    # ---- per step --------------------------------------------------------------------------------
    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampler's view of these rows (in batch order), built from host knobs and device state."""
        to_device = self.staging.to_device
        temperature = self.temperature[rows]
        all_greedy = bool((temperature < _EPS).all())

        def opt(arr: np.ndarray, off: float) -> torch.Tensor | None:
            return to_device(arr) if (arr != off).any() else None

        gens = {}
        if self.generators:
            for j, row in enumerate(rows.tolist()):
                g = self.generators.get(row)
                if g is not None:
                    gens[j] = g
        md = SamplingMetadata(
            all_greedy=all_greedy,
            temperature=to_device(temperature),
            top_k=opt(self.top_k[rows], 0),
            top_p=opt(self.top_p[rows], 1.0),
            min_p=opt(self.min_p[rows], 0.0),
            generators=gens,
        )
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            md.max_num_logprobs = int(num_logprobs.max())
        pen = np.flatnonzero(self.has_penalties[rows])
        if pen.size:
            assert self.output_counts is not None and self.prompt_mask is not None
            state_rows = to_device(rows[pen])
            md.penalties = Penalties(
                batch_rows=to_device(pen),
                output_counts=self.output_counts.index_select(0, state_rows),
                prompt_mask=self.prompt_mask.index_select(0, state_rows),
                presence=opt(self.presence[rows[pen]], 0.0),
                frequency=opt(self.frequency[rows[pen]], 0.0),
                repetition=opt(self.repetition[rows[pen]], 1.0),
            )
        if not (
            self.min_tokens_stop_ids
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_single
            or self.bad_words_multi
        ):
            return md
        row_list = rows.tolist()
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows, bias_ids, bias_vals = [], [], []
        allowed_batch_rows, allowed_rows, allowed_ids = [], [], []
        multi: list[tuple[int, int, list[int]]] = []  # (batch row, state row, bad word)
        for j, row in enumerate(row_list):
            stop_ids = self.min_tokens_stop_ids.get(row)
            if stop_ids is not None:
                if self.num_output[row] < self.min_tokens[row]:
                    banned_rows += [j] * len(stop_ids)
                    banned_ids += stop_ids
                else:
                    del self.min_tokens_stop_ids[row]  # reached for good
            single = self.bad_words_single.get(row)
            if single is not None:
                banned_rows += [j] * len(single)
                banned_ids += single
            bias = self.logit_bias.get(row)
            if bias is not None:
                bias_rows.append(torch.full_like(bias[0], j))
                bias_ids.append(bias[0])
                bias_vals.append(bias[1])
            allowed = self.allowed_token_ids.get(row)
            if allowed is not None:
                allowed_batch_rows.append(j)
                allowed_rows.append(torch.full_like(allowed, j))
                allowed_ids.append(allowed)
            words = self.bad_words_multi.get(row)
            if words is not None:
                n_out = int(self.num_output[row])
                multi += [(j, row, w) for w in words if len(w) - 1 <= n_out]
        if banned_ids:
            md.banned = (
                to_device(np.array(banned_rows, dtype=np.int64)),
                to_device(np.array(banned_ids, dtype=np.int64)),
            )
        if bias_ids:
            md.logit_bias = (torch.cat(bias_rows), torch.cat(bias_ids), torch.cat(bias_vals))
        if allowed_ids:
            md.allowed = (
                to_device(np.array(allowed_batch_rows, dtype=np.int64)),
                torch.cat(allowed_rows),
                torch.cat(allowed_ids),
            )
        if multi:
            md.bad_words = self._bad_words(multi)
        return md

    def _bad_words(self, multi: list[tuple[int, int, list[int]]]) -> BadWords:
        """Device-side prefix match of multi-token bad words against each row's last sampled tokens."""
        hist = self.output_hist
        assert hist is not None
        width = max(len(w) - 1 for _, _, w in multi)
        prefix = np.full((len(multi), width), -1, dtype=np.int64)
        cols = np.zeros((len(multi), width), dtype=np.int64)
        for k, (_, row, w) in enumerate(multi):
            plen = len(w) - 1
            prefix[k, width - plen :] = w[:-1]
            start = int(self.num_output[row]) - plen  # the last plen outputs, right-aligned
            cols[k, width - plen :] = np.arange(start, start + plen)
        to_device = self.staging.to_device
        state_rows = to_device(np.array([r for _, r, _ in multi], dtype=np.int64))
        recent = hist[state_rows.unsqueeze(1), to_device(cols)]
        prefix_t = to_device(prefix)
        match = ((recent == prefix_t) | (prefix_t < 0)).all(1)
        return BadWords(
            batch_rows=to_device(np.array([j for j, _, _ in multi], dtype=np.int64)),
            last_token=to_device(np.array([w[-1] for _, _, w in multi], dtype=np.int64)),
            match=match,
        )

    def update_after_sample(self, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """Write what sampling produced for these rows: last tokens, penalty counts, bad-word history."""
        dev = self.device
        to_device = self.staging.to_device
        rows_t = to_device(rows)
        tokens = tokens.clamp(min=0)  # a dead-end row (-1) finishes; its next input is never used
        self.last_sampled_tokens[rows_t] = tokens
        if self.output_counts is not None:
            pen = np.flatnonzero(self.has_penalties[rows])
            if pen.size:
                pen_t = to_device(pen)
                self.output_counts.index_put_(
                    (rows_t[pen_t], tokens[pen_t]),
                    torch.ones(pen.size, dtype=torch.int32, device=dev),
                    accumulate=True,
                )
        if self.bad_words_multi:
            sel = np.fromiter((r in self.bad_words_multi for r in rows.tolist()), dtype=bool, count=rows.size)
            if sel.any():
                idx = np.flatnonzero(sel)
                cols = np.minimum(self.num_output[rows[idx]], self.max_model_len - 1)
                hist = self._output_hist()
                hist[to_device(rows[idx]), to_device(cols)] = tokens[to_device(idx)]
        self.num_output[rows] += 1
