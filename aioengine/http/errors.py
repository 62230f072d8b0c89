"""Error JSON: APIError (OpenAI's {"error": {...}} shape), and the one mapping from the engine's errors."""

from __future__ import annotations

from aioengine.errors import (
    AioEngineError,
    InvalidRequestError,
    ModelLoadError,
    RequestAbortedError,
    UnknownModelError,
)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's {"error": {...}} JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict:
        return error_dict(self.status, self.message, self.param, self.code)


def error_dict(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error object. `code` is a specific string code when there is one, else the HTTP status."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def api_error(e: AioEngineError) -> APIError:
    """The one mapping from the engine's errors to API errors: a request that can never run
    (InvalidRequestError) -> 400 with its param and code; a dead or stopped engine -> 503."""
    if isinstance(e, InvalidRequestError):
        return APIError(400, e.message, e.param, e.code)
    if isinstance(e, UnknownModelError):
        return APIError(404, e.message, "model", "model_not_found")
    if isinstance(e, ModelLoadError):
        return APIError(500, str(e), "model", "model_load_failed")
    if isinstance(e, RequestAbortedError):
        return APIError(503, f"The request was aborted: {e}", code="request_aborted")
    return APIError(503, f"The engine is not serving: {e}", code="engine_dead")


def not_supported(param: str, what: str | None = None) -> APIError:
    return bad(f"{what or param} is not supported yet by aioengine.", param)
