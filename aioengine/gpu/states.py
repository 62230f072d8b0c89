"""Persistent per-request state of the model runner: one row per live request, updated from diffs."""

from __future__ import annotations

import numpy as np
import torch

from aioengine.sched.output import NewRequestData


class RequestStates:
    """Rows of host arrays (token ids, block table, sampling knobs) plus last_sampled_tokens on the device.

    Known tokens (the prompt, or everything known at resume) live in token_ids; a decode's input is the
    token this request sampled last, read from last_sampled_tokens where the previous step wrote it.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self.last_sampled_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.device = device
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, data: NewRequestData) -> None:
        assert data.req_id not in self.row_of, f"request {data.req_id} already has a row"
        row = self._free_rows.pop()
        self.row_of[data.req_id] = row
        n = len(data.prompt_token_ids)
        self.token_ids[row, :n] = data.prompt_token_ids
        self.prefill_len[row] = n
        self.num_blocks[row] = 0
        self.append_blocks(row, data.block_ids)
        p = data.sampling_params
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed)
            self.generators[row] = gen

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return  # e.g. preempted earlier, finished before resuming
        self.generators.pop(row, None)
        self._free_rows.append(row)
