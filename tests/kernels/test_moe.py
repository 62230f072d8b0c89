"""The fused-MoE op's torch reference against the plainest sum (every expert on every token, masked, in
float64), and the router's top-k against transformers' routers."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from aioengine.kernels.reference_moe import expert_runs, fused_moe, select_experts

E, H, INTER = 8, 48, 40


def _dense(x, w13, w2, weights, ids):
    """Every expert on every token, kept where the token chose it (float64)."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ w2[e].T
        scale = (weights.double() * (ids == e)).sum(-1, keepdim=True)  # 0 where the token did not choose e
        out += y * scale
    return out


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("load", ["random", "one_takes_all", "some_idle"])
def test_fused_moe_equals_every_expert_masked(top_k, load):
    torch.manual_seed(top_k)
    T = 13
    x = torch.randn(T, H)
    w13, w2 = _weights()
    logits = torch.randn(T, E)
    if load == "one_takes_all":
        logits[:, 5] += 100  # expert 5 is every token's first choice
    elif load == "some_idle":
        logits[:, [0, 3, 7]] -= 100  # no token picks them unless k forces it
    weights, ids = select_experts(logits, top_k, renormalize=True)
    counts = expert_runs(ids, E)[1]
    assert sum(counts) == T * top_k
    if load == "one_takes_all":
        assert counts[5] == T
    if load == "some_idle" and top_k <= E - 3:
        assert counts[0] == counts[3] == counts[7] == 0
    got = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), _dense(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_takes_bfloat16_and_no_tokens():
    w13, w2 = _weights(1)
    x = torch.randn(5, H)
    weights, ids = select_experts(torch.randn(5, E), 2, renormalize=False)
    got = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _dense(x, w13, w2, weights, ids), rtol=0.05, atol=0.05)
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H)


def test_each_expert_reads_only_its_tokens_rows():
    """A token's output depends on its own experts only: zeroing the others' weights changes nothing."""
    w13, w2 = _weights(2)
    x = torch.randn(4, H)
    weights, ids = select_experts(torch.randn(4, E), 2, renormalize=True)
    chosen = set(ids.flatten().tolist())
    w13_only, w2_only = w13.clone(), w2.clone()
    for e in set(range(E)) - chosen:
        w13_only[e], w2_only[e] = float("nan"), float("nan")  # read, they would poison the sum
    torch.testing.assert_close(
        fused_moe(x, w13_only, w2_only, weights, ids), fused_moe(x, w13, w2, weights, ids)
    )


@pytest.mark.parametrize(
    ("config_cls", "module", "kwargs", "renormalize"),
    [
        (
            transformers.Qwen3MoeConfig,
            "qwen3_moe",
            dict(num_experts=E, num_experts_per_tok=2, norm_topk_prob=False),
            False,
        ),
        (
            transformers.Qwen3MoeConfig,
            "qwen3_moe",
            dict(num_experts=E, num_experts_per_tok=3, norm_topk_prob=True),
            True,
        ),
        (transformers.MixtralConfig, "mixtral", dict(num_local_experts=E, num_experts_per_tok=2), True),
    ],
)
def test_routing_equals_transformers(config_cls, module, kwargs, renormalize):
    config = config_cls(hidden_size=H, **kwargs)
    models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    router_cls = next(getattr(models, n) for n in dir(models) if n.endswith("TopKRouter"))
    router = router_cls(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, H)
    _, want_w, want_ids = router(x)
    weights, ids = select_experts(x @ router.weight.T, config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=0)
