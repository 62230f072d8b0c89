"""A tiny random Qwen3 under the real Qwen3 chat template (read from llama.cpp's copy in the
llama-cpp-python sdist): the server renders conversations as transformers does with it (tools, tool calls,
earlier reasoning, enable_thinking), and the qwen3 reasoning parser splits what the model writes under it."""

from __future__ import annotations

import json
import re
import urllib.request

import openai
import pytest
import transformers

from aioengine import AsyncEngine, EngineArgs
from aioengine.http.app import bound_port, build_app, start_server
from tests.engine.conftest import make_tiny_checkpoint
from tests.http.conftest import LiveServer
from tests.real_templates import real_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# An agent's turn: the user asks, the assistant thinks and calls a tool, the tool answers. The assistant's
# reasoning comes after the last user message, so Qwen3's template renders it.
AGENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
# Two whole turns: the first answer's reasoning is before the last user message, so the template drops it.
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning": "A greeting."},
    {"role": "user", "content": "Capital of France?"},
]


class Qwen3Server(LiveServer):
    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    async def _start(self) -> None:
        args = EngineArgs(model=self.model, max_model_len=1024, num_kv_blocks=256, max_num_batched_tokens=256)
        self.engine = AsyncEngine(args)
        await self.engine.start()
        apps = {
            "think": build_app(self.engine, reasoning_parser="qwen3", structured_outputs_in_reasoning=True),
            "answer": build_app(self.engine, reasoning_parser="qwen3"),
        }
        for name, app in apps.items():
            runner = await start_server(app, "127.0.0.1", 0, shutdown_timeout=1.0)
            self.runners[name], self.ports[name] = runner, bound_port(runner)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-template")
    make_tiny_checkpoint("qwen3", path)
    (path / "chat_template.jinja").write_text(real_template("Qwen-Qwen3-0.6B"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # the file above is the template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    server = Qwen3Server(str(path)).start()
    yield server, transformers.AutoTokenizer.from_pretrained(path)
    server.stop()


def _model(server: LiveServer) -> str:
    with urllib.request.urlopen(server.url("answer") + "/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


def _tokenize(server: LiveServer, messages: list[dict], **kwargs) -> list[int]:
    body = json.dumps({"messages": messages, "chat_template_kwargs": kwargs}).encode()
    req = urllib.request.Request(
        server.url("answer") + "/tokenize", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["tokens"]


def _as_template_reads(messages: list[dict]) -> list[dict]:
    """What the template gets: text parts joined, tool arguments as objects, reasoning_content."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        (AGENT, {"tools": TOOLS}),
        (CHAT, {}),
        (CHAT, {"enable_thinking": False}),
        (AGENT[:2], {"tools": TOOLS, "enable_thinking": True}),
    ],
)
def test_the_server_renders_the_real_template_as_transformers_does(qwen3, messages, kwargs):
    server, tokenizer = qwen3
    want = tokenizer.apply_chat_template(
        _as_template_reads(messages), add_generation_prompt=True, tokenize=True, **kwargs
    )
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    got = _tokenize(server, messages, **kwargs)
    assert got == list(want)
    text = tokenizer.decode(got)
    if messages is AGENT:  # the tool flow's reasoning is rendered, the call and the result too
        assert "<think>\nI should call the tool.\n</think>" in text and '"city": "Paris"' in text
        assert "<tool_response>" in text and "get_weather" in text
    if messages is CHAT:  # an answer before the last user message keeps no reasoning
        assert "A greeting." not in text
    assert text.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)


def test_an_earlier_answers_reasoning_is_taken_back_as_the_api_gave_it(qwen3):
    """An assistant message carrying reasoning_content (what this server returns) is accepted in history."""
    server, _ = qwen3
    client = openai.OpenAI(base_url=server.url("answer") + "/v1", api_key="x", max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model=_model(server), messages=AGENT, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_reasoning_and_answer_split_under_the_template(qwen3):
    """The random model is forced (structured outputs over the whole text) to think, then answer, whole and
    streamed; and with enable_thinking false the template closes the block in the prompt, so the answer's
    constraint covers all it writes (no think block of its own), as vLLM's."""
    server, _ = qwen3
    think = openai.OpenAI(base_url=server.url("think") + "/v1", api_key="x", max_retries=0, timeout=60)
    forced = {"structured_outputs": {"regex": "<think>[a-z ]{8,20}</think>\n\nThe answer is [a-z]{3,8}\\."}}
    out = think.chat.completions.create(
        model=_model(server), messages=CHAT, max_tokens=60, temperature=0, extra_body=forced
    ).choices[0]
    whole = out.model_dump()["message"]
    assert re.fullmatch("[a-z ]{8,20}", whole["reasoning_content"]), whole
    assert re.fullmatch("\n*The answer is [a-z]{3,8}\\.", whole["content"]), whole
    answer = openai.OpenAI(base_url=server.url("answer") + "/v1", api_key="x", max_retries=0, timeout=60)
    plain = {
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"regex": "The answer is [a-z]{3,8}\\."},
    }
    msg = (
        answer.chat.completions.create(
            model=_model(server), messages=CHAT, max_tokens=40, temperature=0, extra_body=plain
        )
        .choices[0]
        .model_dump()["message"]
    )
    assert msg.get("reasoning_content") is None and re.fullmatch(
        "The answer is [a-z]{3,8}\\.", msg["content"]
    )
    chunks = think.chat.completions.create(
        model=_model(server), messages=CHAT, max_tokens=60, temperature=0, stream=True, extra_body=forced
    )
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in chunks:
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": whole["reasoning_content"], "content": whole["content"]}


def test_either_name_of_an_earlier_reasoning_reaches_the_template_and_null_is_absent():
    from aioengine.http.messages import parse_messages

    for given in (
        {"reasoning_content": "r"},
        {"reasoning": "r"},
        {"reasoning_content": None, "reasoning": "r"},
    ):
        msgs = parse_messages(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **given}]
        )
        assert msgs[1]["reasoning_content"] == "r"
    assert (
        "reasoning_content"
        not in parse_messages([{"role": "assistant", "content": "a", "reasoning": None}])[0]
    )
