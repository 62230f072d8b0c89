"""The model runner: applies the scheduler's diffs, builds the flat batch, runs the model and samples."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from aioengine.gpu.backend import Backend
from aioengine.gpu.drafter import Drafter
from aioengine.gpu.kv_offload import HostKVTier
from aioengine.gpu.loader import kv_cache_bytes_per_block, load_model
from aioengine.gpu.lora import LoRASlots
from aioengine.gpu.models.moe import active_weight_bytes, num_active_parameters, num_parameters
from aioengine.gpu.pooler import Pooler
from aioengine.gpu.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs
from aioengine.gpu.states import RequestStates
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.model.lora import LoRAAdapter, read_adapter
from aioengine.sched.kv_cache_spec import group_size, layer_slots
from aioengine.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InputBatch:
    req_ids: list[str]  # batch order: decodes first
    rows: np.ndarray  # state row of each request
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # token index of each sampled request's last query token (and drafts')
    sample_mask: np.ndarray  # bool [num_reqs]: False for a prefill chunk (it samples nothing)
    num_drafts: np.ndarray | None = None  # int [num_reqs]: drafts each request verifies (None: no drafts)
    draft_ids: np.ndarray | None = None  # the drafts, concatenated in batch order
    # Per request (the attention metadata's rows differ where drafts are verified).
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    num_drafts_to_propose: dict[str, int] = dataclasses.field(default_factory=dict)  # the draft model's


class ModelRunner:
    """Runs on the backend's worker: execute_model() then sample_tokens(), in order. What differs by device
    (kernels, KV layout, fast paths, staging, the output copy) is the backend's."""

    def __init__(
        self,
        model_path: str,
        backend: Backend,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        seed: int,
        quantization: str | None = None,
        draft_model: str | None = None,
        lora: tuple[list[tuple[str, str]], int, int] | None = None,
    ) -> None:
        """``max_model_len`` is the engine's, already within the model's limits (``EngineConfig``);
        ``draft_model``: a checkpoint proposing drafts (speculative decoding), loaded beside the model;
        ``lora``: the LoRA adapters (name, folder) loaded at start (ids 1..N), the slots, the largest rank."""
        self.backend = backend
        self.device = device = backend.device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.model, self.hf_config = load_model(model_path, dtype=dtype, device=device, ops=backend.ops)
        self.model.cover_positions(max_model_len)  # a max_model_len past max_position_embeddings extrapolates
        self.kv_cache_groups = self.model.kv_cache_groups  # layers grouped by attention window
        self._num_parameters = num_parameters(self.model)  # before any repacking
        self._num_active_parameters = num_active_parameters(self.model)
        self._active_weight_bytes = active_weight_bytes(
            self.model, torch.empty((), dtype=dtype).element_size()
        )
        path = os.fspath(model_path)
        backend.prepare_model(self.model, quantization, path, activations_apart=lora is not None)
        self.lora: LoRASlots | None = None
        # every registered adapter, read and checked, on the host: a slot takes one when a step needs it
        self.lora_adapters: dict[int, LoRAAdapter] = {}
        self.lora_loads = 0  # adapters copied into a slot (on demand, least recently used out)
        self._lora_used: dict[int, int] = {}  # adapter id -> the last step that ran it
        if lora is not None:  # hooked on the linears as prepared (quantized, on codes)
            modules, max_loras, max_rank = lora
            self.lora = LoRASlots(self.model, self.hf_config, max_loras, max_rank, backend.ops, dtype, device)
            for adapter_id, (name, adapter_path) in enumerate(modules, start=1):
                self.load_lora(adapter_id, name, adapter_path)
        self.sampler = Sampler(
            seed,
            device,
            backend.ops,
            top_p_from_candidates=backend.sample_top_p_from_candidates,
            grammar_check_argmax_first=backend.grammar_check_argmax_first,
        )
        self.staging = backend.make_staging()
        self.states = RequestStates(
            max_num_reqs,
            max_model_len,
            self.max_blocks_per_req,
            device,
            vocab_size=self.hf_config.vocab_size,
            staging=self.staging,
            num_kv_groups=len(self.kv_cache_groups),
        )
        self.drafter = (
            Drafter(draft_model, backend, dtype, max_model_len, self.hf_config, self.kv_cache_groups)
            if draft_model is not None
            else None
        )
        self.kv_caches: list[torch.Tensor] = []
        self.kv_tensors: list[torch.Tensor] = []  # each cache tensor once (groups share them), draft too
        self.kv_host: HostKVTier | None = None  # the offload tier's host slots (gpu/kv_offload.py)
        self.pooler = Pooler()  # embedding requests: their hidden states pooled instead of sampled
        self._busy_s = 0.0
        self._last_output = ModelRunnerOutput([], [])
        self._pending: tuple[InputBatch, torch.Tensor] | None = None
        self.fault_hook: Callable[[str, SchedulerOutput | None], None] | None = None  # tests inject faults
        self.num_steps = 0
        # Seconds this (worker) thread spent per phase, summed over steps: building inputs, launching (or
        # computing, on CPU) the forward, and sampling. The bench reports them per step.
        self.host_s = cast("dict[str, float]", collections.Counter())  # (Counter's stubs: int counts only)

    def load_lora(self, adapter_id: int, name: str, path: str) -> None:
        """Read and check the adapter at ``path`` under ``adapter_id`` (LoRAError: nothing registered); it
        takes a free slot now, or one when a step needs it."""
        assert self.lora is not None, "LoRA is not enabled"
        adapter = read_adapter(name, path, self.lora.max_rank)
        self.lora.check(adapter)
        self.lora_adapters[adapter_id] = adapter
        if len(self.lora.slot_of) < self.lora.max_loras:
            self._lora_into_slot(adapter_id)

    def unload_lora(self, adapter_id: int) -> None:
        assert self.lora is not None, "LoRA is not enabled"
        del self.lora_adapters[adapter_id]
        self._lora_used.pop(adapter_id, None)
        if adapter_id in self.lora.slot_of:
            self.lora.unload(adapter_id)

    def _lora_into_slot(self, adapter_id: int, keep: frozenset[int] = frozenset()) -> None:
        """Copy a registered adapter into a slot, emptying the least recently used one not in ``keep`` (the
        step's own) when none is free: the scheduler never runs more than max_loras adapters at once."""
        assert self.lora is not None
        if len(self.lora.slot_of) >= self.lora.max_loras:
            idle = [i for i in self.lora.slot_of if i not in keep]
            assert idle, f"a step needs more than {self.lora.max_loras} LoRA adapters (max_loras)"
            self.lora.unload(min(idle, key=lambda i: self._lora_used.get(i, -1)))
        self.lora.load(adapter_id, self.lora_adapters[adapter_id])
        self.lora_loads += 1

    def _loras_for_step(self, token_adapters: np.ndarray) -> None:
        assert self.lora is not None
        needed = frozenset(int(i) for i in np.unique(token_adapters) if i)
        for adapter_id in needed:
            if adapter_id not in self.lora.slot_of:
                self._lora_into_slot(adapter_id, keep=needed)
            self._lora_used[adapter_id] = self.num_steps

    @property
    def lora_active(self) -> bool:
        """This step has rows of a LoRA adapter: the C stack and CUDA graphs (no hooks there) sit out."""
        return self.lora is not None and self.lora.active

    def num_parameters(self) -> int:
        """The checkpoint's parameter count (a tied head counted once, as in the checkpoint)."""
        return self._num_parameters

    def num_active_parameters(self) -> int:
        """The parameters one token runs through (a mixture's chosen experts only; else all of them)."""
        return self._num_active_parameters

    def active_weight_bytes_per_token(self) -> int:
        """The weight bytes one token reads at the model's dtype, a GGUF mixture's experts at their codes'
        bytes (the file's block codes of the dense layers read fewer)."""
        return self._active_weight_bytes

    def kv_cache_bytes_per_block(self) -> int:
        """A block id costs one slot in each of the groups' shared cache tensors (and the draft model's)."""
        draft = self.drafter.kv_cache_bytes_per_block(self.block_size) if self.drafter is not None else 0
        return draft + kv_cache_bytes_per_block(
            self.hf_config, self.block_size, self.dtype, group_size(self.kv_cache_groups)
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        tensors = self.backend.allocate_kv_caches(
            self.hf_config, num_blocks, self.block_size, self.dtype, group_size(self.kv_cache_groups)
        )
        # layer l of a group uses the tensor at its place in the group
        slots = layer_slots(self.kv_cache_groups, self.hf_config.num_hidden_layers)
        self.kv_caches = [tensors[p] for _, p in slots]
        self.kv_tensors = list(tensors)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.block_size)
            self.kv_tensors += list({id(t): t for t in self.drafter.kv_caches}.values())

    def initialize_kv_offload(self, num_slots: int) -> None:
        """Host slots for the blocks the pool evicts (``--kv-offload-size``), a block of every cache each."""
        self.kv_host = HostKVTier(self.kv_tensors, num_slots, self.backend.host_buffer)

    # ---- stop 5: update states ----------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        states = self.states
        for rid in scheduler_output.finished_req_ids:
            states.remove(rid)
            self.pooler.remove(rid)
        for rid in scheduler_output.preempted_req_ids:
            states.remove(rid)
            self.pooler.remove(rid)
        for data in scheduler_output.scheduled_new_reqs:
            states.add(data)
            if data.pooling is not None:
                self.pooler.add(data.req_id, data.pooling)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if block_ids:
                states.append_blocks(states.row_of[rid], block_ids)

    # ---- stop 6: the flat batch ---------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> InputBatch:
        states = self.states
        self.staging.begin_step()
        computed = {d.req_id: d.num_computed_tokens for d in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        ids = list(scheduler_output.num_scheduled_tokens)
        n = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        rows = np.fromiter((states.row_of[r] for r in ids), dtype=np.int64, count=len(ids))
        start = np.fromiter((computed[r] for r in ids), dtype=np.int64, count=len(ids))
        # Decodes first: one token past the prompt. A one-token prompt chunk (a prefix-cache hit recomputing
        # the last prompt token) is a prefill: prompt tokens share one attention path, whatever the chunking.
        prefill_len = states.prefill_len[rows]
        spec = scheduler_output.scheduled_spec_decode_tokens
        spec_n = np.fromiter((len(spec.get(r, ())) for r in ids), dtype=np.int64, count=len(ids))
        # A verified request's tokens attend as decodes, one row each (below): it goes with the decodes.
        is_decode = ((n == 1) | (spec_n > 0)) & (start >= prefill_len)
        order = np.argsort(~is_decode, kind="stable")
        req_ids = [ids[i] for i in order]
        n, rows, start, prefill_len = n[order], rows[order], start[order], prefill_len[order]
        num_decodes = int(np.count_nonzero(is_decode))
        num_reqs = len(req_ids)
        num_tokens = int(n.sum())
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        tok_req = np.repeat(np.arange(num_reqs), n)
        positions = np.repeat(start - cu[:-1], n) + np.arange(num_tokens)
        rows_tok = rows[tok_req]
        if self.lora is not None:
            self._loras_for_step(states.lora_id[rows_tok])
            self.lora.set_step(states.lora_id[rows_tok], self.staging.to_device)
        seq_lens = start + n
        known = positions < prefill_len[tok_req]
        input_ids_np = np.where(
            known, states.token_ids[rows_tok, np.minimum(positions, self.max_model_len - 1)], 0
        )
        num_drafts = draft_ids = None
        if spec:
            # A verified request's query: its last sampled token (on the device), then its drafts.
            num_drafts = spec_n[order]
            draft_ids = np.fromiter(
                (t for r in req_ids for t in spec.get(r, ())), dtype=np.int64, count=int(num_drafts.sum())
            )
            is_draft = np.arange(num_tokens) >= (cu[1:] - num_drafts)[tok_req]
            input_ids_np[is_draft] = draft_ids
            known |= is_draft
        bs = self.block_size
        max_seq_len = int(seq_lens.max())
        slot_mappings = states.slot_mappings(rows_tok, positions, bs)
        block_tables = states.block_tables(rows, -(-max_seq_len // bs))
        sample_mask = seq_lens >= prefill_len
        if self.pooler.live:  # an embedding's last chunk is pooled, not sampled
            sample_mask &= ~self.pooler.is_pooling(req_ids)
        logits_indices = (cu[1:] - 1)[sample_mask]
        if num_drafts is not None:  # a verified request samples at its drafts' positions too
            num_logits = np.where(sample_mask, num_drafts + 1, 0)
            ends = np.repeat(cu[1:], num_logits)
            offsets = np.arange(int(num_logits.sum())) - np.repeat(
                np.cumsum(num_logits) - num_logits, num_logits
            )
            logits_indices = ends - num_logits.repeat(num_logits) + offsets

        to_device = self.staging.to_device
        input_ids = to_device(input_ids_np)
        from_last = np.flatnonzero(~known)
        if from_last.size:
            # Decode inputs: the token each request sampled last step, still on the device.
            src = to_device(rows_tok[from_last])
            input_ids[to_device(from_last)] = states.last_sampled_tokens[src]
        seq_lens_list = seq_lens.tolist()
        cu_list = cu.tolist()
        att_cu, att_seq_lens, att_n, att_decodes = cu, seq_lens, n, num_decodes
        if num_drafts is not None:
            # Each position of a verified query is a decode row of its own, seeing the KV up to itself (the
            # whole step's KV is stored before attention): the decode kernels, graphs and stack take it.
            per_row = np.where(num_drafts > 0, n, 1)
            verified = np.repeat(num_drafts > 0, per_row)
            first = np.repeat(np.cumsum(per_row) - per_row, per_row)
            j = np.arange(int(per_row.sum())) - first
            att_seq_lens = np.where(verified, np.repeat(start, per_row) + 1 + j, np.repeat(seq_lens, per_row))
            att_n = np.where(verified, 1, np.repeat(n, per_row))
            att_cu = np.zeros(len(att_n) + 1, dtype=np.int64)
            np.cumsum(att_n, out=att_cu[1:])
            att_decodes = num_decodes + int(n[num_drafts > 0].sum()) - int(np.count_nonzero(num_drafts))
            block_tables = [np.repeat(t, per_row, axis=0) for t in block_tables]
        meta = AttentionMetadata(
            num_reqs=len(att_n),
            num_decodes=att_decodes,
            num_actual_tokens=num_tokens,
            max_query_len=int(att_n.max()),
            max_seq_len=max_seq_len,
            query_start_loc=to_device(att_cu.astype(np.int32)),
            seq_lens=to_device(att_seq_lens.astype(np.int32)),
            block_table=to_device(block_tables[0]),
            slot_mapping=to_device(slot_mappings[0]),
            query_start_loc_cpu=att_cu.tolist() if num_drafts is not None else cu_list,
            seq_lens_cpu=att_seq_lens.tolist() if num_drafts is not None else seq_lens_list,
        )
        # the other groups see the same batch through their own blocks
        meta.add_group_views(
            (to_device(t), to_device(m)) for t, m in zip(block_tables[1:], slot_mappings[1:], strict=True)
        )
        return InputBatch(
            req_ids=req_ids,
            rows=rows,
            input_ids=input_ids,
            positions=to_device(positions),
            attn_metadata=meta,
            logits_indices=to_device(logits_indices),
            sample_mask=sample_mask,
            num_drafts=num_drafts,
            draft_ids=draft_ids,
            query_start_loc_cpu=cu_list,
            seq_lens_cpu=seq_lens_list,
            num_drafts_to_propose=scheduler_output.num_drafts_to_propose,
        )

    # ---- stops 5-7: execute_model enqueues the forward ----------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.fault_hook is not None:
            self.fault_hook("execute_model", scheduler_output)
        if scheduler_output.kv_transfers is not None:
            assert self.kv_host is not None, "the scheduler has an offload tier, the runner none"
            self.kv_host.run(scheduler_output.kv_transfers)  # before the forward overwrites evicted blocks
        self._update_states(scheduler_output)
        self._pending = None
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        t0 = time.perf_counter()
        batch = self._prepare_inputs(scheduler_output)
        t1 = time.perf_counter()
        hidden = self.backend.forward(self, batch.input_ids, batch.positions, batch.attn_metadata)
        if self.drafter is not None:
            self.drafter.catch_up(batch.input_ids, batch.positions, batch.attn_metadata)
        self._pending = (batch, hidden)
        self.num_steps += 1
        host = self.host_s
        t2 = time.perf_counter()
        host["prepare"] += t1 - t0
        host["forward"] += t2 - t1
        self._busy_s = t2 - t0  # this step's worker time so far; sample_tokens adds its own

    # ---- stop 9: logits for the sampled rows only, then the sampler ----------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> Any:
        """The step's output, or what the backend's worker awaits for it (CUDA: a copy in flight)."""
        if self.fault_hook is not None:
            self.fault_hook("sample_tokens", None)
        if self._pending is None:
            return ModelRunnerOutput([], [])
        t0 = time.perf_counter()
        out = self._sample_tokens(grammar_output)
        elapsed = time.perf_counter() - t0
        self.host_s["sample"] += elapsed
        self._last_output.step_time_s = self._busy_s + elapsed  # (CUDA: its copy may still be in flight)
        return out

    def _sample_tokens(self, grammar_output: GrammarOutput | None) -> Any:
        assert self._pending is not None  # sample_tokens looked
        batch, hidden = self._pending
        self._pending = None
        states = self.states
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        out = self._last_output = ModelRunnerOutput(batch.req_ids, sampled)
        if self.pooler.live:
            prompt_lens = states.prefill_len[batch.rows]
            cu, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
            assert cu is not None and seq_lens is not None
            pooled = self.pooler.step(batch.req_ids, cu, seq_lens, prompt_lens, hidden)
            out.pooler_output = pooled or None
        if (states.num_prompt_logprobs[batch.rows] >= 0).any():
            out.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if not batch.logits_indices.numel():
            self.backend.end_step()
            return out
        sample_idx = np.flatnonzero(batch.sample_mask)
        sample_rows = batch.rows[sample_idx]
        if batch.num_drafts is not None:
            return self._verify_drafts(batch, hidden, sample_idx, sample_rows, out, grammar_output)
        md = self._sampling_metadata(sample_rows)
        if grammar_output is not None:
            md.grammar = self._grammar_rows(batch, sample_idx, grammar_output)
        result = self._sample(hidden[batch.logits_indices], md)
        states.update_after_sample(sample_rows, result.sampled)  # device state for step k+1
        self._propose(batch, sample_idx, out, None)
        tensors = [result.sampled]
        num_logprobs = None
        if result.logprobs is not None:
            tensors += result.logprobs
            num_logprobs = states.num_logprobs[sample_rows].tolist()
        finish = functools.partial(_fill_output, out, sample_idx.tolist(), num_logprobs)
        return self.backend.finish_step(tensors, finish)

    def _sample(self, hidden: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """The sampled token of each logits row (plain greedy rows on the CPU: the head's GEMM picks each
        argmax without writing [rows, vocab] logits)."""
        greedy = self.model.compute_greedy(hidden) if md.plain_greedy else None
        if greedy is not None:
            return SamplerOutput(greedy)
        return self.sampler(self.model.compute_logits(hidden), md)

    def _verify_drafts(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        sample_idx: np.ndarray,
        sample_rows: np.ndarray,
        out: ModelRunnerOutput,
        grammar_output: GrammarOutput | None,
    ) -> Any:
        """Sample every position of each verified request, then keep its drafts up to the first that differs
        from what was sampled there, plus that position's sample (the bonus token when all hold); the logprobs
        of each kept token come from the row that sampled it.

        With one-hot drafts (n-gram) this is the speculative-sampling rule exactly: a draft d is accepted with
        probability p(d), and a rejection's token is distributed as p without d, renormalized. Greedy rows
        sample the argmax. Requests that use penalties, bad words or grammars carry no drafts.
        """
        assert batch.num_drafts is not None and batch.draft_ids is not None
        nd = batch.num_drafts[sample_idx]
        num_logits = nd + 1
        logit_rows = np.repeat(sample_rows, num_logits)
        starts = np.cumsum(num_logits) - num_logits  # each request's first logits row
        md = self._sampling_metadata(logit_rows)
        if grammar_output is not None:  # structured requests carry no drafts: one row each
            md.grammar = self._grammar_rows(batch, sample_idx, grammar_output, starts, len(logit_rows))
        result = self._sample(hidden[batch.logits_indices], md)
        sampled = result.sampled
        # What each logits row verifies: the next draft, or -1 at a request's last row (nothing to check).
        target = np.full(len(logit_rows), -1, dtype=np.int64)
        all_drafts = np.split(batch.draft_ids, np.cumsum(batch.num_drafts)[:-1])
        for j, i in enumerate(sample_idx.tolist()):
            target[starts[j] : starts[j] + nd[j]] = all_drafts[i]
        to_device = self.staging.to_device
        miss = sampled != to_device(target)
        seg = to_device(np.repeat(np.arange(len(sample_idx)), num_logits))
        pos = to_device(np.concatenate([np.arange(k) for k in num_logits]))
        big = torch.full((len(sample_idx),), 1 << 30, dtype=torch.int64, device=self.device)
        # accepted drafts = the position of the first miss in each request's rows
        accepted = big.scatter_reduce(0, seg, torch.where(miss, pos, big[seg]), reduce="amin")
        last = sampled[to_device(starts) + accepted]
        self.states.update_after_sample(sample_rows, last)  # device state for step k+1
        self._propose(batch, sample_idx, out, accepted)
        tensors = [sampled, accepted]
        num_logprobs = None
        if result.logprobs is not None:  # every logits row's: each kept token's row gives its logprobs
            tensors += list(result.logprobs)
            num_logprobs = self.states.num_logprobs[sample_rows].tolist()
        finish = functools.partial(_fill_verified, out, sample_idx.tolist(), starts.tolist(), num_logprobs)
        return self.backend.finish_step(tensors, finish)

    def _propose(
        self, batch: InputBatch, sample_idx: np.ndarray, out: ModelRunnerOutput, accepted: torch.Tensor | None
    ) -> None:
        """The draft model's proposals after each asked request's last sampled token, into ``out``."""
        want = batch.num_drafts_to_propose
        if not want or self.drafter is None:
            return
        asked = [j for j, i in enumerate(sample_idx.tolist()) if batch.req_ids[i] in want]
        pick = np.array(asked, dtype=np.int64)
        if not pick.size:
            return
        idx = sample_idx[pick]
        assert batch.seq_lens_cpu is not None
        # the token sampled last sits after the accepted drafts: seq_len - drafts + accepted
        positions = np.asarray(batch.seq_lens_cpu, dtype=np.int64)[idx]
        if batch.num_drafts is not None and accepted is not None:
            positions += accepted.cpu().numpy()[pick] - batch.num_drafts[idx]
        num = np.array([want[batch.req_ids[i]] for i in idx.tolist()], dtype=np.int64)
        proposals = self.drafter.propose(self.states, batch.rows[idx], positions, num, self.block_size)
        drafts: list[list[int]] = [[] for _ in batch.req_ids]
        for i, p in zip(idx.tolist(), proposals, strict=True):
            drafts[i] = p
        out.draft_token_ids = drafts

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        return self.states.sampling_metadata(rows)

    def _grammar_rows(
        self,
        batch: InputBatch,
        sample_idx: np.ndarray,
        grammar_output: GrammarOutput,
        first_rows: np.ndarray | None = None,
        num_rows: int | None = None,
    ) -> tuple[list[int], torch.Tensor] | None:
        """Map the bitmask's requests to the rows of this step's logits (decodes-first order); with drafts,
        ``first_rows`` is each sampled request's first logits row, of ``num_rows``."""
        order = sample_idx.tolist()
        firsts = list(range(len(order))) if first_rows is None else first_rows.tolist()
        pos = {batch.req_ids[i]: firsts[j] for j, i in enumerate(order)}
        rows, keep = [], []
        for k, rid in enumerate(grammar_output.req_ids):
            j = pos.get(rid)
            if j is not None:
                rows.append(j)
                keep.append(k)
        if not rows:
            return None
        bitmask = np.full((num_rows or len(sample_idx), grammar_output.bitmask.shape[1]), -1, dtype=np.int32)
        bitmask[rows] = grammar_output.bitmask[keep]  # row j of the bitmask masks row j of the logits
        return rows, self.staging.to_device(bitmask)

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> dict[str, list] | None:
        """Logprobs of each prompt token given the tokens before it, gathered over the prompt's chunks and
        returned whole in the step that samples the first output token."""
        states = self.states
        cu, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
        assert cu is not None and seq_lens is not None
        done: dict[str, list] = {}
        for i, rid in enumerate(batch.req_ids):
            row = int(batch.rows[i])
            k = int(states.num_prompt_logprobs[row])
            if k < 0:
                continue
            n = cu[i + 1] - cu[i]
            start = seq_lens[i] - n  # position of the chunk's first token
            end = min(start + n, int(states.num_prompt[row]) - 1)  # position p predicts token p + 1
            acc = states.prompt_logprobs.setdefault(row, [])
            for lo in range(start, end, 256):  # bounded logits memory: 256 rows at a time
                hi = min(end, lo + 256)
                idx = torch.arange(cu[i] + lo - start, cu[i] + hi - start, device=self.device)
                logprobs = self.model.compute_logits(hidden[idx]).float().log_softmax(-1)
                targets = self.staging.to_device(states.token_ids[row, lo + 1 : hi + 1])
                ids, lps, ranks = (t.tolist() for t in gather_logprobs(logprobs, targets, k))
                acc.extend(zip(ids, lps, ranks, strict=True))
            if batch.sample_mask[i]:
                done[rid] = states.prompt_logprobs.pop(row)
                states.num_prompt_logprobs[row] = -1
        return done or None


def _fill_output(
    out: ModelRunnerOutput,
    sample_idx: list[int],
    num_logprobs: list[int] | None,
    sampled: torch.Tensor,
    *logprobs: torch.Tensor,
) -> ModelRunnerOutput:
    """Put the sampled tokens (and logprobs), host tensors by now, into the output's per-request lists."""
    tokens = sampled.tolist()
    for j, i in enumerate(sample_idx):
        out.sampled_token_ids[i] = [tokens[j]]
    if num_logprobs is not None:
        _fill_logprobs(out, sample_idx, num_logprobs, logprobs)
    return out


def _fill_logprobs(
    out: ModelRunnerOutput,
    sample_idx: list[int],
    num_logprobs: list[int],
    logprobs: tuple[torch.Tensor, ...],
    rows: list[range] | None = None,
) -> None:
    """Each request's logprobs, one entry per token it sampled: logits rows ``rows[j]`` (default: row j)."""
    ids, lps, ranks = (t.tolist() for t in logprobs)
    per_req: list = [None] * len(out.req_ids)
    for j, i in enumerate(sample_idx):
        k = num_logprobs[j]
        if k >= 0:
            per_req[i] = [(ids[r][: k + 1], lps[r][: k + 1], ranks[r]) for r in (rows[j] if rows else (j,))]
    out.logprobs = per_req


def _fill_verified(
    out: ModelRunnerOutput,
    sample_idx: list[int],
    starts: list[int],
    num_logprobs: list[int] | None,
    sampled: torch.Tensor,
    accepted: torch.Tensor,
    *logprobs: torch.Tensor,
) -> ModelRunnerOutput:
    """The tokens of a step with drafts: each request's accepted drafts and the token sampled after them."""
    tokens = sampled.tolist()
    kept = [range(start, start + a + 1) for start, a in zip(starts, accepted.tolist(), strict=True)]
    for i, r in zip(sample_idx, kept, strict=True):
        out.sampled_token_ids[i] = tokens[r.start : r.stop]
    if num_logprobs is not None:  # the accepted drafts' rows sampled them: their logprobs are theirs
        _fill_logprobs(out, sample_idx, num_logprobs, logprobs, kept)
    return out
