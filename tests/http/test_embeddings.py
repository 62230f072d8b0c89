"""POST /v1/embeddings with the official openai client against the live server (the default model): shapes,
unit norm, base64, dimensions, batches and token ids, agreement with transformers, and bad input as 400s."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "x"]


def _vectors(r) -> np.ndarray:
    return np.array([d.embedding for d in r.data], dtype=np.float64)


def test_shapes_norms_usage_and_batches(client, server):
    one = client.embeddings.create(model="default", input=TEXTS[0])
    assert one.object == "list" and one.model == "default" and len(one.data) == 1
    v = _vectors(one)[0]
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert v.shape == (576,) and abs(np.linalg.norm(v) - 1) < 1e-4
    tokens = server.engine.tokenizer.encode(TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tokens)

    batch = client.embeddings.create(model="default", input=[TEXTS[0], TEXTS[1], TEXTS[0], TEXTS[2]])
    vs = _vectors(batch)
    assert [d.index for d in batch.data] == [0, 1, 2, 3] and vs.shape == (4, 576)
    assert np.array_equal(vs[0], vs[2])  # equal texts, identical vectors
    assert not np.allclose(vs[0], vs[1])
    singles = np.stack([_vectors(client.embeddings.create(model="default", input=t))[0] for t in TEXTS])
    np.testing.assert_allclose(vs[[0, 1, 3]], singles, atol=1e-5)  # a batch equals single requests
    # token ids, one list and several
    ids = client.embeddings.create(model="default", input=tokens)
    np.testing.assert_allclose(_vectors(ids)[0], v, atol=1e-5)
    many = client.embeddings.create(model="default", input=[tokens, tokens[:3]])
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(tokens) + 3
    assert server.wait_idle()["unfinished"] == 0


def test_base64_and_dimensions(client):
    floats = _vectors(client.embeddings.create(model="default", input=TEXTS[1]))[0]
    b64 = client.embeddings.create(model="default", input=TEXTS[1], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")  # asked for: left as text
    np.testing.assert_allclose(decoded, floats.astype(np.float32), atol=0)
    cut = client.embeddings.create(model="default", input=TEXTS[1], dimensions=64)
    got = _vectors(cut)[0]
    assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-5
    np.testing.assert_allclose(got, floats[:64] / np.linalg.norm(floats[:64]), atol=1e-5)


def test_raw_base64_is_little_endian_float32(http):
    r = http.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"})
    assert r.status == 200
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert len(raw) == 576 * 4
    v = np.frombuffer(raw, dtype="<f4")
    assert abs(np.linalg.norm(v) - 1) < 1e-4


def test_agrees_with_transformers_last_token_pooling(client, server):
    """The default model's final hidden state of the last token, normalized (the live engine may run bf16:
    agreement is to bf16's precision here; tests/engine/test_embeddings.py checks float32 exactly)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(server.engine.model_path, dtype=torch.float32).eval()
    for text in TEXTS[:2]:
        ids = server.engine.tokenizer.encode(text)
        with torch.no_grad():
            want = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
        want /= np.linalg.norm(want)
        got = _vectors(client.embeddings.create(model="default", input=text))[0]
        assert float(got @ want) > 0.999, text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, -1]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 577}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "bogus": 1}, "bogus"),
        ({"input": [5] * 5000}, "input"),
    ],
)
def test_bad_input_gets_a_400_in_openais_shape(http, server, body, param):
    r = http.post("/v1/embeddings", json=body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["message"]
    assert err["param"] == param or err["param"].startswith(param + "["), err  # input[0]: the first list
    assert server.wait_idle()["unfinished"] == 0


def test_unknown_model_and_the_client_error(client, http):
    r = http.post("/v1/embeddings", json={"input": "a", "model": "nope"})
    assert r.status == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="default", input="")


def test_the_api_key_guards_the_route(server):
    from tests.http.conftest import API_KEY, Http

    keyed = Http(server.url("keyed"))
    assert keyed.post("/v1/embeddings", json={"input": "a"}).status == 401
    ok = keyed.post("/v1/embeddings", json={"input": "a"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status == 200 and len(ok.json()["data"][0]["embedding"]) == 576
