"""Multi-LoRA: two PEFT adapters and the base model in the same batches, each request's greedy tokens equal
to transformers with its adapter merged (peft's merge_and_unload), with chunked prefill and prefix hits
that never cross adapters; malformed adapters are refused with the reason."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import pytest
import torch

peft = pytest.importorskip("peft")

from aioengine import AsyncEngine, EngineArgs, InvalidRequestError, SamplingParams  # noqa: E402
from aioengine.model.lora import LoRAError  # noqa: E402
from tests.engine.conftest import SMALL, TINY, make_tiny_checkpoint, save_tiny  # noqa: E402
from tests.engine.test_parity import NEW_TOKENS, hf_greedy  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rsLoRA, targets) of the two adapters
ADAPTERS = {"alpha": (8, 16, False, ALL), "beta": (16, 8, True, ["q_proj", "v_proj", "down_proj"])}


def lora_args(root, modules, **kw) -> EngineArgs:
    """The tiny base model in float32 serving ``modules`` (name -> folder)."""
    return EngineArgs(model=str(root / "base"), dtype="float32", enable_lora=True, lora_modules=modules, **kw)


def make_adapter(base_path, out, rank, alpha, rslora, targets, seed):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero: random A and B so every module's delta shows
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lora_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_tiny_checkpoint(request.param, root / "base")
    merged = {
        name: make_adapter(root / "base", root / name, *spec, seed=i)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    return root, base, merged


def test_two_adapters_and_the_base_in_one_batch_equal_their_merged_models(lora_model):
    check_adapters_in_one_batch(*lora_model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adapters_on_cuda_equal_their_merged_models(tmp_path):
    """The same on CUDA (adapter steps run eagerly, base-only decode steps replay graphs); the checkpoint
    carries no tokenizer, so the GPU image needs no default-model package."""
    config_cls, model_cls, extra = TINY["llama"]
    torch.manual_seed(0)
    base = save_tiny(model_cls(config_cls(**SMALL, **extra)), tmp_path / "base", tokenizer=False)
    merged = {
        name: make_adapter(tmp_path / "base", tmp_path / name, *spec, seed=i)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    check_adapters_in_one_batch(tmp_path, base, merged, device="cuda", skip_tokenizer_init=True)


def check_adapters_in_one_batch(root, base, merged, **engine_kw):
    rng = random.Random(4)
    shared = [rng.randrange(3, 49152) for _ in range(40)]  # the same prefix for every adapter: no cross hits
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    cases = [(lora, p) for p in prompts for lora in (None, "alpha", "beta")]
    expected = [hf_greedy(base if lora is None else merged[lora], p) for lora, p in cases]
    args = lora_args(
        root,
        {name: str(root / name) for name in ADAPTERS},
        max_num_batched_tokens=48,  # prompts chunked, decodes of all three beside them
        max_loras=2,
        max_lora_rank=16,
        **engine_kw,
    )

    async def run():
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            stats = engine.scheduler.kv_cache_manager.total_prefix_cache
            outs, hits = [], []
            # One prompt alone under each adapter in turn, then alpha again: only the last may hit.
            for lora, p in [*cases[:3], cases[1]]:
                before = stats.hits
                outs.append(await engine.generate(p, params, lora=lora))
                hits.append(stats.hits - before)
            outs += await asyncio.gather(*(engine.generate(p, params, lora=lora) for lora, p in cases[3:]))
            assert engine.kv_cache_usage() == 0.0
            return outs, hits

    outs, hits = asyncio.run(run())
    got = [o.outputs[0].token_ids for o in outs]
    assert got[3] == got[1]
    del got[3]
    for (lora, p), g, e in zip(cases, got, expected, strict=True):
        assert g == e, (lora, len(p))
    assert got[1] != got[0] and got[2] != got[0]  # the adapters change the output
    # The same tokens under another adapter (or none) find nothing; under the same one, every full block.
    assert hits[:3] == [0, 0, 0] and hits[3] == (len(cases[1][1]) - 1) // 16 * 16, hits


def test_an_unknown_adapter_and_malformed_ones_are_refused(lora_model, tmp_path):
    root, _, _ = lora_model
    good = {"alpha": str(root / "alpha")}

    async def start(modules, **kw):
        async with AsyncEngine(lora_args(root, modules, **kw)) as engine:
            with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'; served: alpha"):
                engine.generate([5, 6, 7], SamplingParams(max_tokens=2), lora="nope")
            assert engine.lora_names == list(modules)
            with pytest.raises(InvalidRequestError, match="needs --enable-lora-runtime-updates"):
                await engine.load_lora("gamma", str(root / "beta"))

    asyncio.run(start(good, max_lora_rank=16))
    with pytest.raises(LoRAError, match="rank 16 is above max_lora_rank 8"):
        asyncio.run(start({"beta": str(root / "beta")}, max_lora_rank=8))
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        asyncio.run(start({"empty": str(tmp_path)}))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (bad / f).write_bytes((root / "alpha" / f).read_bytes())
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head", "q_proj"]}))
    with pytest.raises(LoRAError, match=r"target modules \['lm_head'\] are not ones the model has"):
        asyncio.run(start({"bad": str(bad)}, max_lora_rank=16))
    with pytest.raises(ValueError, match="max_loras and max_lora_rank must be at least 1"):
        EngineArgs(model="x", enable_lora=True, lora_modules={"a": "a"}, max_loras=0).validate()


def test_the_openai_client_picks_adapters_by_model_name(lora_model):
    """/v1/models lists each adapter with the base as its parent; a completion's model picks its adapter
    (the same text as generate(lora=...)); an unknown name is the API's 404."""
    import openai

    from aioengine.http.app import bound_port, build_app, start_server

    root, _, _ = lora_model
    args = lora_args(
        root, {name: str(root / name) for name in ADAPTERS}, served_model_name="base", max_loras=2
    )
    prompt = [11, 12, 13, 14, 15, 16]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run():
        async with AsyncEngine(args) as engine:
            runner = await start_server(build_app(engine), "127.0.0.1", 0, shutdown_timeout=1.0)
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="x")
            try:
                cards = {m.id: m for m in (await client.models.list()).data}
                assert list(cards) == ["base", "alpha", "beta"]
                assert cards["alpha"].parent == "base" and cards["base"].parent is None
                assert cards["beta"].root == str(root / "beta")
                texts = set()
                for model in ("base", "alpha", "beta"):
                    served = await client.completions.create(
                        model=model,
                        prompt=prompt,
                        max_tokens=NEW_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    lora = None if model == "base" else model
                    direct = await engine.generate(prompt, params, lora=lora)
                    assert served.choices[0].text == direct.outputs[0].text, model
                    texts.add(served.choices[0].text)
                assert len(texts) == 3  # each adapter answers its own way
                with pytest.raises(openai.NotFoundError, match="nope"):
                    await client.completions.create(model="nope", prompt=prompt, max_tokens=2)
                # vLLM's lora_requests_info: the adapters of the queued and running requests, the slots
                handle = engine.generate(prompt, params, lora="beta")
                s = engine.stats()
                assert s.waiting_loras + s.running_loras == ("beta",) and s.max_loras == 2
                await handle
                metrics = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{bound_port(runner)}/metrics").read()
                )
                info = [
                    ln
                    for ln in metrics.decode().splitlines()
                    if ln.startswith("aioengine:lora_requests_info{")
                ]
                assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
                counts = {  # finished completions per adapter, every engine request: served and generate()'s
                    ln.split('lora_name="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
                    for ln in metrics.decode().splitlines()
                    if ln.startswith("aioengine:lora_requests_total{")
                }
                assert counts == {"alpha": 2.0, "beta": 3.0}, counts
            finally:
                await client.close()
                await runner.cleanup()

    asyncio.run(run())


def test_more_adapters_than_slots_take_turns_in_them(lora_model):
    """Three adapters, one slot: the scheduler runs one adapter at a time beside base requests, the worker
    copies each into the slot when its turn comes (the least recently used out), and every request still
    equals its merged model."""
    root, base, merged = lora_model
    gamma = make_adapter(root / "base", root / "gamma", 4, 8, False, ["o_proj", "up_proj"], seed=7)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    models = {None: base, **merged, "gamma": gamma}
    cases = [(lora, p) for p in prompts for lora in models]
    expected = [hf_greedy(models[lora], p) for lora, p in cases]
    modules = {name: str(root / name) for name in (*ADAPTERS, "gamma")}
    args = lora_args(root, modules, max_loras=1, max_lora_rank=16, max_num_batched_tokens=64)

    async def run():
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params, lora=lora) for lora, p in cases))
            loads = await engine.run_on_worker(lambda: engine.runner.lora_loads)
            return [o.outputs[0].token_ids for o in outs], loads

    got, loads = asyncio.run(run())
    for (lora, p), g, e in zip(cases, got, expected, strict=True):
        assert g == e, (lora, len(p))
    assert loads >= 3  # each adapter took the one slot at least once (alpha at start, then the others)


def test_random_adapters_run_on_the_default_model_with_its_kernels(tmp_path):
    """The bench's random adapters on the default model at the machine's default dtype (bf16 packs the MLP's
    activation into its gate_up GEMM unless LoRA keeps it apart): the adapter's rows change the output, the
    base rows in the same batch do not."""
    from aioengine.cli.bench.lora import write_random_adapters

    adapters = write_random_adapters("default", 1, 8, tmp_path, scale=0.2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"

    async def run(**kw):
        async with AsyncEngine(EngineArgs(model="default", max_model_len=256, **kw)) as engine:
            return await asyncio.gather(
                *(engine.generate(prompt, params, lora=lora) for lora in kw.get("lora_modules", [None])),
                engine.generate(prompt, params),
            )

    base = asyncio.run(run())[0].outputs[0].token_ids
    with_lora, beside = asyncio.run(run(enable_lora=True, lora_modules=adapters, max_lora_rank=8))
    assert beside.outputs[0].token_ids == base
    assert with_lora.outputs[0].token_ids != base


def test_adapters_load_and_unload_while_serving(lora_model):
    """vLLM's runtime routes behind the API key: a loaded adapter answers as its merged model; slots are
    bounded by max_loras; an unloaded name is the API's 404; a slot reused by another adapter shares no
    prefix-cache blocks with the one before; malformed loads change nothing."""
    import aiohttp

    from aioengine.http.app import bound_port, build_app, start_server

    root, _, merged = lora_model
    args = lora_args(
        root,
        {"alpha": str(root / "alpha")},
        served_model_name="base",
        max_loras=2,
        max_lora_rank=16,
        enable_lora_runtime_updates=True,
    )
    prompt = list(range(100, 150))  # three full blocks of 16: a second run of one adapter would hit them
    expected = hf_greedy(merged["beta"], prompt)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    key = {"Authorization": "Bearer k"}

    async def run():
        async with AsyncEngine(args) as engine:
            runner = await start_server(build_app(engine, api_key="k"), "127.0.0.1", 0, shutdown_timeout=1.0)
            url = f"http://127.0.0.1:{bound_port(runner)}/v1"
            stats = engine.scheduler.kv_cache_manager.total_prefix_cache
            try:
                async with aiohttp.ClientSession() as http:

                    async def post(route, body, headers=key):
                        async with http.post(f"{url}/{route}", json=body, headers=headers) as r:
                            return r.status, await r.text()

                    beta = {"lora_name": "beta", "lora_path": str(root / "beta")}
                    assert (await post("load_lora_adapter", beta, headers={}))[0] == 401
                    status, text = await post("load_lora_adapter", beta)
                    assert status == 200 and "added" in text, text
                    async with http.get(f"{url}/models", headers=key) as r:
                        assert [m["id"] for m in (await r.json())["data"]] == ["base", "alpha", "beta"]
                    assert (await engine.generate(prompt, params, lora="beta")).outputs[
                        0
                    ].token_ids == expected
                    # a third adapter in two slots: registered, and given a slot when a step needs it
                    third = await post(
                        "load_lora_adapter", {"lora_name": "gamma", "lora_path": str(root / "beta")}
                    )
                    assert third[0] == 200, third
                    gamma = await engine.generate(prompt, params, lora="gamma")
                    assert gamma.outputs[0].token_ids == expected
                    taken = await post(
                        "load_lora_adapter", {"lora_name": "alpha", "lora_path": str(root / "beta")}
                    )
                    assert taken[0] == 400 and "taken" in taken[1], taken
                    assert (await post("unload_lora_adapter", {"lora_name": "beta"}))[0] == 200
                    assert (await post("unload_lora_adapter", {"lora_name": "beta"}))[0] == 404
                    async with http.post(
                        f"{url}/completions", json={"model": "beta", "prompt": prompt}, headers=key
                    ) as r:
                        assert r.status == 404
                    missing = await post(
                        "load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "none")}
                    )
                    assert missing[0] == 400 and "adapter_config.json is missing" in missing[1], missing
                    # the freed slot takes the same weights under a new name: same tokens, no old block hit
                    reload = {"lora_name": "beta2", "lora_path": str(root / "beta")}
                    assert (await post("load_lora_adapter", reload))[0] == 200
                    before = stats.hits
                    again = await engine.generate(prompt, params, lora="beta2")
                    assert again.outputs[0].token_ids == expected and stats.hits == before
            finally:
                await runner.cleanup()

    asyncio.run(run())
