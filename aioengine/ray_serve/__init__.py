"""The engine on Ray Serve (the ``[ray]`` extra): data-parallel replicas, each an AsyncEngine, behind Serve's
HTTP proxy, routed by their cached prefixes. `build_app` from Python; `app_builder` for ``serve run`` and
YAML configs (docs/design/ray-serve.md)."""

from aioengine.ray_serve.app import RayServeConfig, app_builder, build_app

__all__ = ["RayServeConfig", "app_builder", "build_app"]
