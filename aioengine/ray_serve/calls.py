"""What the ingress sends an engine replica (one HTTP request, with its prompt's block hashes for the
router) and what the replica answers first (the response's status and headers; body chunks follow)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class HTTPCall:
    method: str
    target: str  # path and query, as the engine's own server routes them
    headers: list[tuple[str, str]]
    body: bytes
    block_hashes: list[int] = field(default_factory=list)  # the prompt's, as the engine will chain them


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[str, str]]


@dataclass(slots=True)
class RoutingInfo:
    """What the ingress needs to hash prompts as a replica's engine does."""

    block_size: int
    tokenizer: Any  # the engine's tokenizer (pickled across), None for a model with none
    lora_names: tuple[str, ...]  # requests for an adapter hash differently: they are routed by load
    prefix_caching: bool
