"""The typed exceptions that aioengine raises to its users."""

from __future__ import annotations


class AioEngineError(Exception):
    """Base class of every error aioengine raises on purpose."""


class InvalidRequestError(AioEngineError, ValueError):
    """A request that can never run: bad parameters, an empty or too long prompt."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineDeadError(AioEngineError, RuntimeError):
    """The engine hit an unrecoverable error; every pending and future request fails with this."""


class EngineNotStartedError(AioEngineError, RuntimeError):
    """generate() was called before start() (or after shutdown())."""


class RequestAbortedError(AioEngineError, RuntimeError):
    """A request whose result is one value (an embedding) was aborted before it had that value."""


class UnknownModelError(AioEngineError, KeyError):
    """A model name that a server of several models does not serve."""

    def __init__(self, name: str, names: list[str]) -> None:
        super().__init__(name)
        self.message = f"The model `{name}` does not exist. Served: {', '.join(names) or 'none'}."

    def __str__(self) -> str:
        return self.message


class ModelLoadError(AioEngineError, RuntimeError):
    """A served model that failed to load (a bad file, too little memory); its requests fail with this."""
