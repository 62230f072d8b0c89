"""The engine on Ray Serve (the ``[ray]`` extra): data-parallel replicas, each an AsyncEngine, behind Serve's
HTTP proxy, routed by their cached prefixes. `build_app` from Python; `app_builder` for ``serve run`` and
YAML configs (docs/design/ray-serve.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["RayServeConfig", "app_builder", "build_app"]


def __getattr__(name: str) -> Any:
    # Ray is imported on first use: the prompt hasher and the prefix index run without it
    if name in __all__:
        from aioengine.ray_serve import app

        return getattr(app, name)
    raise AttributeError(name)
