"""The engine: AsyncEngine and its step, start-up, request handles, outputs and the EngineClient seam."""

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.handle import GenerateHandle

__all__ = ["AsyncEngine", "GenerateHandle"]
