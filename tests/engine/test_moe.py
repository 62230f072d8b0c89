"""Mixture-of-experts models beyond greedy parity (test_parity, test_quant, test_spec_decode and the TP test
take Qwen3-MoE and Mixtral too): logprobs equal transformers', structured output holds, each routing
switch of the config is honoured, Qwen2-MoE's shared expert, and an unsupported mixture is refused by
name."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch
import transformers

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.models import get_model_class
from aioengine.gpu.models.moe import FusedMoE
from aioengine.sampling_params import StructuredOutputsParams
from tests.engine.conftest import SMALL, save_tiny
from tests.engine.test_parity import CASES, hf_greedy, prompts, run_engine
from tests.engine.test_tensor_parallel import _greedy


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_logprobs_equal_transformers(tiny_checkpoint_of, kind):
    path = tiny_checkpoint_of(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = prompts(shared_prefix=False, n=1)[0]

    async def main():
        async with AsyncEngine(EngineArgs(model=str(path), dtype="float32")) as engine:
            params = SamplingParams(
                temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=1, ignore_eos=True
            )
            return await engine.generate(prompt, params)

    out = asyncio.run(main())
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0].double(), -1)
    for k, (tok, lps) in enumerate(zip(ids, out.outputs[0].logprobs, strict=True)):
        row = logp[len(prompt) - 1 + k]
        assert tok == int(row.argmax())
        for t, lp in lps.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4, (k, t)
    for k, lps in enumerate(out.prompt_logprobs[1:], start=1):  # the prompt's own tokens
        t = prompt[k]
        assert abs(lps[t].logprob - float(logp[k - 1, t])) < 1e-4


def test_structured_output_holds_on_a_mixture(tiny_checkpoint_of):
    path = tiny_checkpoint_of("qwen3_moe")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def main():
        async with AsyncEngine(EngineArgs(model=str(path), dtype="float32")) as engine:
            as_json = SamplingParams(
                max_tokens=40, seed=3, structured_outputs=StructuredOutputsParams(json=schema)
            )
            as_regex = SamplingParams(
                max_tokens=8, seed=4, structured_outputs=StructuredOutputsParams(regex="[ab]{8}")
            )
            return await asyncio.gather(engine.generate("x", as_json), engine.generate("y", as_regex))

    a, b = asyncio.run(main())
    if a.outputs[0].finish_reason == "stop":  # random weights may run out of tokens before closing it
        assert isinstance(json.loads(a.outputs[0].text)["n"], int)
    else:
        assert re.fullmatch(r'\{\s*("n"\s*(:\s*(-?\d*)?)?)?', a.outputs[0].text)
    assert re.fullmatch("[ab]{8}", b.outputs[0].text)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_topk_prob=False),  # the top-k of the softmax as they are
        dict(decoder_sparse_step=2, mlp_only_layers=[]),  # every second layer routes
        dict(num_experts_per_tok=1, mlp_only_layers=[]),  # top-1
        dict(num_experts_per_tok=8, num_experts=8, mlp_only_layers=[]),  # every expert
    ],
)
def test_each_routing_switch_keeps_parity(tiny_checkpoint_of, overrides):
    path = tiny_checkpoint_of("qwen3_moe", **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(shared_prefix=True, n=6)
    expected = [hf_greedy(hf, p) for p in ps]
    got, engine = asyncio.run(run_engine(path, ps, max_num_batched_tokens=48))
    assert got == expected
    layers = engine.runner.model.model.layers
    sparse = [isinstance(layer.mlp, FusedMoE) for layer in layers]
    config = hf.config
    assert sparse == [
        i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
        for i in range(len(layers))
    ]


@pytest.mark.parametrize("case", ["chunked", "prefix", "preempt"])
def test_qwen2_moe_with_its_shared_expert_keeps_parity(tmp_path_factory, case):
    """Qwen2's q/k/v biases, a dense first layer, and every sparse layer's shared expert behind its sigmoid
    gate; at TP=2 the same tokens as at TP=1."""
    path = tmp_path_factory.mktemp("qwen2-moe")
    config = transformers.Qwen2MoeConfig(
        **SMALL,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[0],
    )
    torch.manual_seed(0)
    hf = save_tiny(transformers.Qwen2MoeForCausalLM(config), path)
    ps = prompts(shared_prefix=case == "prefix")
    kwargs = CASES[case]
    got, engine = asyncio.run(run_engine(path, ps, **kwargs))
    assert got == [hf_greedy(hf, p) for p in ps]
    blocks = [layer.mlp for layer in engine.runner.model.model.layers]
    assert not isinstance(blocks[0], FusedMoE) and blocks[1].shared_expert is not None
    if case == "preempt":
        assert engine.scheduler.num_preemptions_total > 0
        # the shared expert's 48 columns split 24 + 24 and each expert's 32 as 16 + 16; routers replicated
        ref, _ = asyncio.run(_greedy(path, 1))
        tp2, _ = asyncio.run(_greedy(path, 2))
        assert tp2 == ref


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "OlmoeForCausalLM"])
def test_an_unsupported_mixture_is_refused_naming_the_supported_ones(arch):
    config = transformers.LlamaConfig(**SMALL, architectures=[arch])
    with pytest.raises(
        ValueError, match=f"unsupported model architectures \\['{arch}'\\].*Qwen3MoeForCausalLM"
    ):
        get_model_class(config)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantization_takes_each_experts_linears_and_keeps_the_router(tiny_checkpoint_of, method):
    """--quantization int4|int8 quantizes every expert's gate_up and down (the stacked copies dropped, and
    no dequantized copy kept: every batch runs on the codes) and leaves the router as it is; test_quant
    checks the tokens against transformers on the same codes."""
    from aioengine.gpu.cpu.quant import QuantizedLinear
    from aioengine.gpu.models.moe import Router

    path = tiny_checkpoint_of("mixtral")
    _, engine = asyncio.run(run_engine(path, prompts(shared_prefix=False, n=2), quantization=method))
    blocks = [layer.mlp for layer in engine.runner.model.model.layers]
    assert blocks and all(isinstance(b, FusedMoE) for b in blocks)
    for b in blocks:
        assert b.experts.w13 is None and b.experts.w2 is None
        assert len(b.experts.linears) == 2 * b.num_experts
        assert all(isinstance(q, QuantizedLinear) for q in b.experts.linears)
        assert all(q.weight is None for q in b.experts.linears)  # codes only: no dequantized copy kept
        assert type(b.gate) is Router
