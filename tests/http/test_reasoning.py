"""--reasoning-parser: <think> text apart from the answer, whole or streamed in any cut, in chat
(reasoning_content) and in Messages (thinking blocks); an answer without a think block is left as it is."""

from __future__ import annotations

import json
import random

import anthropic
import openai
import pytest

from aioengine.http.reasoning import ReasoningParser, split

TEXTS = [
    "<think>\nhmm, France\n</think>\n\nParis",
    "Paris",
    "<think>cut short",
    "  <think>a</think>b",
    "<thi",
    "x <think> not a block</think>",
    "hmm</think>Paris",
    "<think></think>",
    "a</thin",
]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_a_stream_cut_anywhere_splits_as_the_whole_text(kind):
    rng = random.Random(0)
    for text in TEXTS:
        want = split(kind, text)
        for _ in range(20):
            parser, got_r, got_c, i = ReasoningParser(kind), "", "", 0
            while i < len(text):
                j = min(len(text), i + rng.randint(1, 4))
                r, c = parser.feed(text[i:j])
                got_r, got_c, i = got_r + r, got_c + c, j
            r, c = parser.flush()
            assert ((got_r + r) if parser.reasoned else None, got_c + c) == want, (kind, text)


def test_the_two_parsers_rules():
    assert split("qwen3", "<think>\nhmm\n</think>\n\nParis") == ("\nhmm\n", "\n\nParis")
    assert split("qwen3", "Paris") == (None, "Paris")  # no think block (enable_thinking false): an answer
    assert split("qwen3", "<think>cut") == ("cut", "")  # unclosed: all reasoning
    assert split("qwen3", "x <think> y</think>") == (None, "x <think> y</think>")  # a block only opens first
    assert split("deepseek_r1", "hmm</think>Paris") == ("hmm", "Paris")  # the prompt opened the block
    assert split("deepseek_r1", "hmm") == ("hmm", "")
    assert split("deepseek_r1", "<think>a</think>b") == ("a", "b")


THINK = {"structured_outputs": {"regex": "<think>[a-z ]{8,24}</think>The capital is Paris\\."}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url("reasoning") + "/v1", api_key="x", max_retries=0, timeout=60)


def test_chat_puts_the_think_block_in_reasoning_content_streamed_or_not(oai):
    r = oai.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=60, extra_body=THINK
    )
    m = r.choices[0].message
    assert m.content == "The capital is Paris." and 8 <= len(m.reasoning_content) <= 24
    chunks = list(
        oai.chat.completions.create(
            model="default", messages=ASK, temperature=0, max_tokens=60, extra_body=THINK, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == m.reasoning_content and content == m.content and "<think>" not in content
    assert sum(1 for d in deltas if getattr(d, "reasoning_content", None)) >= 2  # streamed as it came


def test_the_websocket_sends_the_think_block_as_reasoning(oai, server):
    """/v1/ws under --reasoning-parser: a chat's deltas carry the think text in "reasoning", the answer in
    "text", split as the HTTP route splits them."""
    import asyncio

    import aiohttp

    want = oai.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=60, extra_body=THINK
    ).choices[0]

    async def main():
        body = {"messages": ASK, "temperature": 0, "max_tokens": 60, **THINK}
        async with aiohttp.ClientSession() as s, s.ws_connect(server.url("reasoning") + "/v1/ws") as ws:
            await ws.send_json({"type": "chat", "id": "r", "body": body})
            deltas = []
            while True:
                m = await asyncio.wait_for(ws.receive_json(), 60)
                if m["type"] == "delta":
                    deltas.append(m)
                elif m["type"] in ("done", "error"):
                    return deltas, m

    deltas, done = asyncio.run(main())
    assert done["type"] == "done" and done["choices"][0]["finish_reason"] == want.finish_reason
    assert "".join(d.get("reasoning", "") for d in deltas) == want.message.reasoning_content
    assert "".join(d["text"] for d in deltas) == want.message.content == "The capital is Paris."
    assert sum(1 for d in deltas if d.get("reasoning")) >= 2 and all(
        "<think>" not in d["text"] for d in deltas
    )


def test_an_answer_without_a_think_block_is_unchanged(oai, client):
    plain = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    parsed = oai.chat.completions.create(
        model="default",
        messages=ASK,
        temperature=0,
        max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert parsed.choices[0].message.content == plain.choices[0].message.content
    assert getattr(parsed.choices[0].message, "reasoning_content", None) is None


def test_messages_give_a_thinking_block_first_streamed_or_not(server, http):
    claude = anthropic.Anthropic(base_url=server.url("reasoning"), api_key="x", max_retries=0)
    extra = {"temperature": 0, **THINK}
    m = claude.messages.create(model="default", max_tokens=60, messages=ASK, extra_body=extra)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == "The capital is Paris." and 8 <= len(m.content[0].thinking) <= 24
    with claude.messages.stream(model="default", max_tokens=60, messages=ASK, extra_body=extra) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking and final.content[1].text == m.content[1].text
    raw = http.request(
        "POST",
        "/v1/messages",
        body=json.dumps({"max_tokens": 60, "messages": ASK, "stream": True, **extra}).encode(),
    )
    body = raw.body.decode()  # the main app has no parser: the think text stays in the answer
    texts = [
        json.loads(line[6:])["delta"].get("text", "") for line in body.splitlines() if "text_delta" in line
    ]
    assert raw.status == 200 and "thinking_delta" not in body and "".join(texts).startswith("<think>")


def test_responses_give_a_reasoning_item_before_the_message_streamed_or_not(oai):
    kwargs = dict(
        model="default", input="What is the capital of France?", temperature=0, max_output_tokens=60
    )
    r = oai.responses.create(**kwargs, extra_body=THINK)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert 8 <= len(thought) <= 24 and r.output_text == "The capital is Paris."
    events = list(oai.responses.create(**kwargs, extra_body=THINK, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    # the reasoning item closes before the message opens, and each event names its item's place
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert all(e.output_index == 1 for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == r.output_text


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
JSON_ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def _json_chat(server, app: str):
    c = openai.OpenAI(base_url=server.url(app) + "/v1", api_key="x", max_retries=0, timeout=60)
    return c.chat.completions.create(
        model="default",
        messages=JSON_ASK,
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    ).choices[0]


def test_structured_outputs_constrain_the_answer_after_the_think_block(server):
    """As vLLM: under a reasoning parser the schema applies after the think block. qwen3 (the block is
    optional) still answers valid JSON; deepseek_r1's output opens inside the block, so the same request's
    JSON-like text is reasoning and may not end there (the answer never came within max_tokens), where
    with the constraint over the whole output it ended right after the JSON."""
    import jsonschema

    qwen = _json_chat(server, "reasoning-answer")
    jsonschema.validate(json.loads(qwen.message.content), CITY)
    r1 = _json_chat(server, "reasoning-r1")
    assert r1.finish_reason == "length" and r1.message.content in ("", None)
    assert r1.message.reasoning_content.startswith('{"city"') and len(r1.message.reasoning_content) > 30


def test_a_thinking_budget_ends_the_reasoning_over_chat_and_messages(server):
    """thinking_token_budget (vLLM's) and Messages' thinking.budget_tokens: under deepseek_r1's rules the
    output is reasoning from its first token, so the block holds exactly the budget's tokens before the
    forced </think>, and an answer follows."""
    from transformers import AutoTokenizer

    from aioengine.model.files import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    oai = openai.OpenAI(base_url=server.url("reasoning-r1") + "/v1", api_key="x", max_retries=0, timeout=60)
    r = oai.chat.completions.create(
        model="default", messages=ASK, temperature=0, max_tokens=30, extra_body={"thinking_token_budget": 5}
    ).choices[0]
    assert len(tok.encode(r.message.reasoning_content, add_special_tokens=False)) <= 5 + 1  # one may merge
    assert r.message.reasoning_content and r.message.content
    plain = oai.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=30).choices[
        0
    ]
    assert plain.message.reasoning_content.startswith(r.message.reasoning_content)  # free until the budget
    ant = anthropic.Anthropic(base_url=server.url("reasoning-r1"), api_key="x", max_retries=0, timeout=60)
    m = ant.messages.create(
        model="default",
        max_tokens=30,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 5},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in m.content][:2] == ["thinking", "text"]
    assert m.content[0].thinking == r.message.reasoning_content and m.content[1].text


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"thinking_token_budget": -1}, "thinking_token_budget"),
        ("/v1/chat/completions", {"thinking_token_budget": "5"}, "thinking_token_budget"),
        ("/v1/messages", {"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 50}}, "thinking.budget_tokens"),
        ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking"),
    ],
)
def test_bad_thinking_budgets_get_the_routes_400(server, route, body, param):
    from tests.http.conftest import Http

    payload = {"model": "default", "messages": ASK, "max_tokens": 20, **body}
    r = Http(server.url("reasoning-r1")).request("POST", route, json=payload)
    assert r.status == 400, r.body
    err = json.loads(r.body)["error"]
    if route == "/v1/messages":
        assert err["type"] == "invalid_request_error" and param.split(".")[-1] in err["message"]
    else:
        assert err["param"] == param
