"""Ollama's API through the official ollama client against the live server (default model): chat and
generate, streamed (NDJSON) or not, equal to the OpenAI route's greedy text; options, format (JSON and a
schema), tool calls, embed, tags, ps, show, version; Ollama's error shape and the API key."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def lm(server):
    return ollama.Client(host=server.url(), timeout=60)


def test_chat_equals_the_openai_route_streamed_or_not(lm, client):
    r = lm.chat(model="default", messages=ASK, options=GREEDY)
    want = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=16)
    assert r.message.role == "assistant" and r.message.content == want.choices[0].message.content
    assert "Paris" in r.message.content
    assert r.done and r.done_reason in ("stop", "length") and r.model == "default"
    assert r.prompt_eval_count == want.usage.prompt_tokens and r.eval_count == want.usage.completion_tokens
    assert r.total_duration > 0 and r.eval_duration >= 0
    parts = list(lm.chat(model="default", messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == r.eval_count
    assert len(parts) > 2 and "".join(p.message.content for p in parts) == r.message.content


def test_generate_with_system_and_raw(lm, client):
    r = lm.generate(model="default:latest", prompt="What is the capital of France?", options=GREEDY)
    assert "Paris" in r.response and r.done and r.context is None  # Ollama deprecated context
    # the durations come from the engine's own times: prompt, then generation
    assert r.prompt_eval_duration > 0 and r.eval_duration > 0 and r.total_duration >= r.eval_duration
    parts = list(
        lm.generate(model="default", prompt="What is the capital of France?", options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in parts) == r.response and parts[-1].done
    raw = lm.generate(model="default", prompt="The capital of France is", raw=True, options=GREEDY)
    want = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=16
    )
    assert raw.response == want.choices[0].text
    system = lm.generate(model="default", prompt="Hi", system="Answer in one word: OK.", options=GREEDY)
    assert system.done and system.prompt_eval_count > r.prompt_eval_count - 20  # the system turn counted
    loaded = lm.generate(model="default", prompt="")  # Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_stop_and_num_predict(lm):
    capped = lm.chat(model="default", messages=ASK, options={"temperature": 0, "num_predict": 3})
    assert capped.eval_count == 3 and capped.done_reason == "length"
    stopped = lm.chat(
        model="default", messages=ASK, options={"temperature": 0, "num_predict": 32, "stop": ["Paris"]}
    )
    assert "Paris" not in stopped.message.content and stopped.done_reason == "stop"
    seeded = [
        lm.generate(
            model="default", prompt="Say a word", options={"temperature": 1.0, "seed": 7, "num_predict": 8}
        )
        for _ in range(2)
    ]
    assert seeded[0].response == seeded[1].response
    tuned = lm.chat(model="default", messages=ASK, options={**GREEDY, "num_ctx": 4096, "num_thread": 2})
    assert tuned.done  # the runner's own knobs are accepted and change nothing here


def test_format_json_and_schema(lm):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = lm.chat(model="default", messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(r.message.content)["city"], str)
    j = lm.generate(model="default", prompt="Give a JSON object.", format="json", options={"num_predict": 30})
    assert j.done


def test_a_tool_call_comes_back_with_arguments_as_an_object(lm):
    """Ollama has no tool_choice: a format in Llama 3's call shape makes the model call (the chat parser
    reads a whole output of {"name", "parameters"} naming a tool as a call)."""
    city = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": city},
    }
    as_call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "parameters": city},
        "required": ["name", "parameters"],
    }
    msgs = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    options = {"temperature": 0, "num_predict": 48}
    for stream in (False, True):
        out = lm.chat(
            model="default", messages=msgs, tools=[tool], format=as_call, options=options, stream=stream
        )
        last = list(out)[-1] if stream else out
        calls = last.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_weather"], (stream, last.message)
        assert isinstance(calls[0].function.arguments, dict) and "city" in calls[0].function.arguments
    # a call in the history, answered by a tool turn, is accepted back
    history = [
        *msgs,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"},
    ]
    assert lm.chat(model="default", messages=history, tools=[tool], options=GREEDY).done


def test_embed_tags_ps_show_and_version(lm, server):
    e = lm.embed(model="default", input=["Paris is in France", "Berlin is in Germany"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) > 100
    assert abs(sum(x * x for x in e.embeddings[0]) - 1.0) < 1e-3  # unit vectors, as Ollama's
    one = lm.embed(model="default", input="Paris is in France")
    assert one.embeddings[0] == pytest.approx(e.embeddings[0], abs=1e-5)
    tags = lm.list()
    assert [m.model for m in tags.models] == ["default"] and tags.models[0].size > 0
    running = lm.ps()
    assert [m.model for m in running.models] == ["default"] and running.models[0].expires_at is not None
    shown = lm.show("default")
    assert shown.details.family == "llama" and "context_length" in shown.modelinfo
    assert "{%" in (shown.template or "")  # the chat template
    assert httpx.get(server.url() + "/api/version").json()["version"]


def test_errors_have_ollamas_shape_and_the_key_guards_the_api(lm, server):
    with pytest.raises(ollama.ResponseError) as e:
        lm.chat(model="nope", messages=ASK)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        lm.chat(model="default", messages=ASK, options={"bogus": 1})
    assert e.value.status_code == 400 and "bogus" in e.value.error
    for body in (
        {"model": "default", "prompt": "x", "images": ["aGk="]},
        {"model": "default", "prompt": "x", "format": 3},
    ):
        r = httpx.post(server.url() + "/api/generate", json=body)
        assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(server.url() + "/api/chat", content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    keyed = server.url("keyed")
    assert httpx.get(keyed + "/api/tags").status_code == 401
    from tests.http.conftest import API_KEY

    ok = ollama.Client(host=keyed, headers={"Authorization": f"Bearer {API_KEY}"})
    assert [m.model for m in ok.list().models] == ["default"]


HOSTILE = [
    ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": 5}]}),
    ("/api/chat", {"model": "default", "messages": "hello"}),
    ("/api/chat", {"model": "default", "messages": [{"role": "tool", "content": "x", "tool_name": ["a"]}]}),
    ("/api/chat", {"model": "default", "messages": [{"role": "assistant", "tool_calls": [1]}]}),
    (
        "/api/chat",
        {
            "model": "default",
            "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": [1]}}]}],
        },
    ),
    ("/api/embed", {"model": "default", "input": ["x"] * 100_000}),
    ("/api/chat", {"model": "default", "messages": ASK, "options": {"temperature": "hot"}}),
    ("/api/chat", {"model": "default", "messages": ASK, "options": {"num_predict": "all"}}),
    ("/api/chat", {"model": "default", "messages": ASK, "options": []}),
    ("/api/chat", {"model": "default", "messages": ASK, "keep_alive": {}}),
    ("/api/chat", {"model": "default", "messages": ASK, "tools": "all"}),
    ("/api/generate", {"model": 5, "prompt": "x"}),
    ("/api/generate", {"model": "default", "prompt": ["x"]}),
    ("/api/generate", {"model": "default", "prompt": "x", "stream": "yes"}),
    ("/api/generate", {"model": "default", "prompt": "x", "context": [1, 2]}),
    ("/api/generate", {"model": "default", "prompt": "x", "suffix": "y"}),
    ("/api/embed", {"model": "default", "input": [1, 2]}),
    ("/api/embed", {"model": "default", "input": "x", "dimensions": 0}),
    ("/api/show", {"model": "nope"}),
    ("/api/generate", [1, 2]),
]


@pytest.mark.parametrize(("path", "body"), HOSTILE)
def test_bad_bodies_get_a_4xx_in_ollamas_shape(server, path, body):
    r = httpx.post(server.url() + path, json=body, timeout=30)
    assert 400 <= r.status_code < 500 and set(r.json()) == {"error"} and r.json()["error"], r.text
