"""aioengine: an LLM inference engine whose serving path runs in one asyncio event loop."""

__version__ = "0.1.0"
