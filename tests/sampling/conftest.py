"""Reuse the engine tests' tiny random checkpoints."""

from tests.engine.conftest import tiny_llama  # noqa: F401
