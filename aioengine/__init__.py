"""aioengine: an LLM inference engine whose serving path runs in one asyncio event loop."""

from aioengine.config import EngineArgs
from aioengine.engine import AsyncEngine, GenerateHandle
from aioengine.errors import AioEngineError, EngineDeadError, EngineNotStartedError, InvalidRequestError
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.sampling_params import SamplingParams
from aioengine.version import __version__ as __version__

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
