"""Our Llama/Qwen models on a paged cache against transformers, from tiny random checkpoints."""

import pytest
import torch
import transformers

from aioengine.gpu.cpu.backend import CpuBackend
from aioengine.gpu.loader import kv_cache_bytes_per_block, load_model
from aioengine.gpu.models import get_model_class
from aioengine.kernels.metadata import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 24
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **SMALL,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=24),
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    """(our model, HF model) sharing one random checkpoint saved to disk."""
    torch.manual_seed(0)
    hf = HF_CLASSES[request.param](CONFIGS[request.param]()).float().eval()
    with torch.no_grad():  # HF zeroes biases and sets norms to 1: randomise everything to test them
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2) + (1.0 if "norm" in name else 0.0))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, config = load_model(path)
    return ours, hf, config


def _block_tables(num_reqs, max_blocks, seed):
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).int()
    return perm[: num_reqs * max_blocks].view(num_reqs, max_blocks)


def _step(model, kv_caches, ids, positions, query_lens, seq_lens, block_table):
    meta = AttentionMetadata.build(query_lens, seq_lens, block_table, BLOCK_SIZE)
    hidden = model(torch.tensor(ids), torch.tensor(positions), kv_caches, meta)
    assert hidden.shape == (len(ids), model.config.hidden_size)
    return model.compute_logits(hidden)


@torch.inference_mode()
def test_prefill_then_greedy_decode_matches_hf(models):
    model, hf, config = models
    prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    kv_caches = CpuBackend().allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    block_table = _block_tables(1, 6, seed=2)
    logits = _step(model, kv_caches, prompt, list(range(13)), [13], [13], block_table)
    assert logits.dtype == torch.float32 and logits.shape == (13, 256)
    hf_logits = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits[-1], hf_logits[-1], atol=1e-4, rtol=0)

    generated = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 13, dtype=torch.long),
        max_new_tokens=5,
        min_new_tokens=5,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    hf_tokens = generated.sequences[0, 13:].tolist()
    tokens = []
    for step in range(5):
        token = int(logits[-1].argmax())
        tokens.append(token)
        torch.testing.assert_close(logits[-1], generated.logits[step][0], atol=1e-4, rtol=0)
        if step < 4:
            n = 13 + step  # tokens already in the cache
            logits = _step(model, kv_caches, [token], [n], [1], [n + 1], block_table)
    assert tokens == hf_tokens


@torch.inference_mode()
def test_mixed_batch_decode_and_second_chunk_match_hf(models):
    model, hf, config = models
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (9,), generator=gen).tolist()
    y = torch.randint(0, 256, (13,), generator=gen).tolist()
    kv_caches = CpuBackend().allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    block_table = _block_tables(2, 4, seed=4)
    # Step 1: X's whole prompt and Y's first chunk of 6 tokens.
    logits = _step(model, kv_caches, x + y[:6], list(range(9)) + list(range(6)), [9, 6], [9, 6], block_table)
    x_next = int(logits[8].argmax())
    # Step 2, decodes first: X decodes its sampled token, Y prefills tokens 6..12.
    logits = _step(
        model, kv_caches, [x_next] + y[6:], [9] + list(range(6, 13)), [1, 7], [10, 13], block_table
    )
    hf_x = hf(torch.tensor([x + [x_next]])).logits[0]
    hf_y = hf(torch.tensor([y])).logits[0]
    assert x_next == int(hf_x[8].argmax())
    torch.testing.assert_close(logits[0], hf_x[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1:], hf_y[6:], atol=1e-4, rtol=0)


def test_registry_and_cache_sizing():
    config = transformers.LlamaConfig(**SMALL, architectures=["MistralForCausalLM"])
    assert get_model_class(config).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unsupported model architectures"):
        get_model_class(transformers.LlamaConfig(**SMALL, architectures=["GPT2LMHeadModel"]))
    caches = CpuBackend().allocate_kv_caches(config, 5, 16, torch.bfloat16)
    assert len(caches) == 2 and caches[0].shape == (2, 5, 16, 2, 16)
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == sum(c[:, 0].nbytes for c in caches)


def test_unsupported_rope_scaling_is_refused():
    from aioengine.gpu.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        LlamaForCausalLM(config)


def test_incomplete_checkpoint_is_refused():
    from aioengine.gpu.models.qwen import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))
    q = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"missing weights: .*gate_up_proj.weight\[up_proj\].* and \d+ more"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", q)])
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.self_attn.z_proj.weight", q)])
