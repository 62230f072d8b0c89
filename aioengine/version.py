"""The package's version: its installed metadata, or "0+unknown" when run from a source tree on the path."""

import importlib.metadata

try:
    __version__ = importlib.metadata.version("aioengine")
except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH (the GPU machines)
    __version__ = "0+unknown"
