"""aioengine: an LLM inference engine whose serving path runs in one asyncio event loop."""

import importlib.metadata

from aioengine.config import EngineArgs
from aioengine.engine import AsyncEngine, GenerateHandle
from aioengine.errors import AioEngineError, EngineDeadError, EngineNotStartedError, InvalidRequestError
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.sampling_params import SamplingParams

try:
    __version__ = importlib.metadata.version("aioengine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"
__all__ = [
    "AioEngineError",
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineNotStartedError",
    "GenerateHandle",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
]
