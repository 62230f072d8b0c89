"""CORS for pages of other origins (vLLM's --allowed-origins, --allowed-methods, --allowed-headers): the
preflight answered before auth (browsers send no credentials on it), and the headers on every response to
an allowed origin, streams included.

Unlike vLLM, no origin is allowed unless named: a server on localhost would otherwise answer any page the
user opens. ``--allowed-origins '["*"]'`` allows them all, as vLLM does by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

PREFLIGHT_MAX_AGE_S = 600
_EXPOSED = "X-Request-Id, Retry-After"


@dataclass(slots=True, frozen=True)
class CorsConfig:
    allowed_origins: tuple[str, ...] = ()  # "*": any
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    _methods: frozenset[str] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        object.__setattr__(self, "_methods", frozenset(m.upper() for m in self.allowed_methods))

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def method_allowed(self, method: str) -> bool:
        return "*" in self._methods or method.upper() in self._methods

    def allow_origin_value(self, origin: str) -> str:
        # With credentials the browser needs the origin itself, never "*".
        return "*" if "*" in self.allowed_origins and not self.allow_credentials else origin


def preflight(request: web.Request, cors: CorsConfig) -> web.Response | None:
    """The answer to a CORS preflight (OPTIONS with Access-Control-Request-Method), or None for any other
    request."""
    origin = request.headers.get("Origin")
    method = request.headers.get("Access-Control-Request-Method")
    if request.method != "OPTIONS" or origin is None or method is None:
        return None
    if not cors.enabled or not cors.origin_allowed(origin) or not cors.method_allowed(method):
        return web.Response(status=400, text="Disallowed CORS origin, method or headers")
    asked = request.headers.get("Access-Control-Request-Headers", "")
    if "*" in cors.allowed_headers:
        headers = asked
    else:
        wanted = [h.strip() for h in asked.split(",") if h.strip()]
        allowed = {h.lower() for h in cors.allowed_headers}
        if any(h.lower() not in allowed for h in wanted):
            return web.Response(status=400, text="Disallowed CORS origin, method or headers")
        headers = ", ".join(cors.allowed_headers)
    out = {
        "Access-Control-Allow-Origin": cors.allow_origin_value(origin),
        "Access-Control-Allow-Methods": method.upper()
        if "*" in cors.allowed_methods
        else ", ".join(cors.allowed_methods),
        "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        "Vary": "Origin",
    }
    if headers:
        out["Access-Control-Allow-Headers"] = headers
    if cors.allow_credentials:
        out["Access-Control-Allow-Credentials"] = "true"
    return web.Response(status=200, headers=out)


def add_headers(request: web.Request, response: web.StreamResponse, cors: CorsConfig) -> None:
    """On every response (on_response_prepare, so a stream gets them before its first byte)."""
    origin = request.headers.get("Origin")
    if origin is None or not cors.enabled or not cors.origin_allowed(origin):
        return
    response.headers["Access-Control-Allow-Origin"] = cors.allow_origin_value(origin)
    response.headers["Access-Control-Expose-Headers"] = _EXPOSED
    response.headers.add("Vary", "Origin")
    if cors.allow_credentials:
        response.headers["Access-Control-Allow-Credentials"] = "true"
