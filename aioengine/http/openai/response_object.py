"""The Responses API's reply: a `response` object, its output items and its stream's `response.*` events."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aioengine.http.streaming import JSON


class ResponseBuilder:
    """One response's ids and settings; renders it in progress, finished, and the stream's events."""

    def __init__(self, data: JSON, request_id: str, model: str) -> None:
        self.id = "resp_" + request_id.split("-", 1)[-1]
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.model = model
        self.data = data
        self.sequence = 0
        self.reasoning: str | None = None  # the think block's text, with a reasoning parser
        self.calls: list[dict] = []  # the completion's tool calls (chat's shape), as function_call items
        self.reasoning_id = "rs_" + uuid.uuid4().hex

    def response(
        self,
        status: str,
        text: str | None = None,
        finish_reason: str | None = None,
        usage: JSON | None = None,
    ) -> JSON:
        """The response object; ``usage`` as streaming.Tally.usage() counts it."""
        d = self.data
        fmt = (d.get("text") or {}).get("format") or {"type": "text"}
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": d.get("instructions"),
            "max_output_tokens": d.get("max_output_tokens"),
            "metadata": d.get("metadata") or {},
            "parallel_tool_calls": d.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": d.get("reasoning"),
            "store": False,
            "temperature": d.get("temperature", 1.0),
            "top_p": d.get("top_p", 1.0),
            "text": {"format": fmt},
            "tool_choice": d.get("tool_choice", "auto"),
            "tools": d.get("tools") or [],
            "truncation": d.get("truncation", "disabled"),
            "user": d.get("user"),
            "usage": None,
        }
        if text is not None:
            output = [] if self.reasoning is None else [self.reasoning_item("completed")]
            if text or not self.calls:
                output.append(self.message(text, "completed" if finish_reason != "length" else "incomplete"))
            output += [self.call_item(call) for call in self.calls]
            obj["output"] = output
        if finish_reason == "length":
            obj["status"], obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        if usage is not None:
            obj["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": usage["prompt_tokens_details"],
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        if obj["status"] == "completed":  # not a truncated (incomplete) one
            obj["completed_at"] = int(time.time())
        return obj

    def message(self, text: str | None, status: str) -> JSON:
        content = [] if text is None else [self.part(text)]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def call_item(self, call: dict) -> JSON:
        fn = call["function"]
        item_id = "fc_" + call["id"].removeprefix("chatcmpl-tool-")
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": "completed",
        }

    def call_items(self, final: JSON) -> list[tuple[int, JSON]]:
        """The function_call items of ``final``'s output, with their places."""
        return [(i, item) for i, item in enumerate(final["output"]) if item["type"] == "function_call"]

    @property
    def message_index(self) -> int:
        """The message's place in ``output``: after the reasoning item, when there is one."""
        return 0 if self.reasoning is None else 1

    def reasoning_item(self, status: str) -> JSON:
        content = [] if status != "completed" else [{"type": "reasoning_text", "text": self.reasoning or ""}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "status": status,
            "summary": [],
            "content": content,
        }

    def reasoning_event(self, kind: str, **fields: Any) -> JSON:
        return self.event(kind, item_id=self.reasoning_id, output_index=0, content_index=0, **fields)

    @staticmethod
    def part(text: str) -> JSON:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields: Any) -> JSON:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def text_event(self, kind: str, **fields: Any) -> JSON:
        return self.event(
            kind, item_id=self.item_id, output_index=self.message_index, content_index=0, **fields
        )
