"""The official openai client against the live server: chat and completions, streaming and not."""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_paris(client, server):
    r = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "default"
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert server.wait_idle()["unfinished"] == 0


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    full = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_tokens=12)
    stream = client.chat.completions.create(
        model="default",
        messages=CHAT,
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # really streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_length_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="default", messages=CHAT, temperature=0, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_n2(client):
    r = client.chat.completions.create(
        model="default", messages=CHAT, temperature=0.8, n=2, max_tokens=8, seed=1
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens == 16 or all(c.finish_reason for c in r.choices)


def test_chat_stream_n2(client):
    stream = client.chat.completions.create(
        model="default",
        messages=CHAT,
        temperature=1.0,
        n=2,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for c in stream:
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens <= 12


def test_completion(client):
    r = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 5


def test_completion_stream_and_echo(client):
    full = client.completions.create(model="default", prompt="Once upon a time", temperature=0, max_tokens=8)
    chunks = list(
        client.completions.create(
            model="default",
            prompt="Once upon a time",
            temperature=0,
            max_tokens=8,
            stream=True,
            echo=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Once upon a time" + full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_batch_and_n2(client):
    r = client.completions.create(
        model="default", prompt=["Hello", "The sky is"], n=2, temperature=0.7, max_tokens=4, seed=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert 4 <= r.usage.completion_tokens <= 16
    ids = client.completions.create(
        model="default", prompt=[[504, 3458, 314], [504, 3458]], temperature=0, max_tokens=2
    )
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_stop_strings(client):
    base = client.completions.create(model="default", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=12)
    text = base.choices[0].text
    assert len(text) > 4
    stop = text.strip()[2:4]  # something the model will say
    assert stop
    r = client.completions.create(
        model="default", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=12, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    assert stop not in r.choices[0].text and text.startswith(r.choices[0].text)
    chunks = list(
        client.completions.create(
            model="default", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=12, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_stop_string(client):
    r = client.chat.completions.create(
        model="default", messages=CHAT, temperature=0, max_tokens=20, stop=["Paris"]
    )
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    assert client.models.retrieve("default").id == "default"


def test_errors_surface_as_openai_exceptions(client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=CHAT, max_tokens=5000)
    assert "2048" in e.value.body["message"] and e.value.body["code"] == "context_length_exceeded"


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="default", messages=CHAT, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.token == e.top_logprobs[0].token  # greedy: the chosen token is the best one
        assert e.bytes == list(e.token.encode())
    chunks = list(
        client.chat.completions.create(
            model="default", messages=CHAT, temperature=0, max_tokens=5, logprobs=True, stream=True
        )
    )
    streamed = [
        e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.token for e in content]


def test_completion_logprobs(client):
    r = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_penalties_and_logit_bias_are_applied(client, http):
    base = client.completions.create(model="default", prompt="Hi", temperature=0, max_tokens=12)
    text = base.choices[0].text  # greedy SmolLM2 repeats itself here ("-party-party-...")
    first = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"][0]
    first_str = http.post("/detokenize", json={"tokens": [first]}).json()["prompt"]
    banned = client.completions.create(
        model="default", prompt="Hi", temperature=0, max_tokens=12, logit_bias={str(first): -100}
    )
    assert not banned.choices[0].text.startswith(first_str)
    penalized = client.completions.create(
        model="default", prompt="Hi", temperature=0, max_tokens=12, frequency_penalty=2.0
    )
    assert penalized.choices[0].text != text


def test_structured_output(client):
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="default",
        messages=CHAT,
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"city"}
    r = client.completions.create(
        model="default",
        prompt="Is Paris in France? Answer:",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no")


def test_completion_echo_with_logprobs_covers_the_prompt(client):
    prompt = "The capital of France is Paris. The capital of Spain is"
    kw = dict(model="default", prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0)
    for _ in range(2):  # the second run would hit the prefix cache: prompt logprobs must still be complete
        r = client.completions.create(**kw)
        c = r.choices[0]
        lp = c.logprobs
        assert c.text.startswith(prompt)
        assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
        assert "".join(lp.tokens) == c.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [ch for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert (
        sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), [])
        == lp.token_logprobs
    )
