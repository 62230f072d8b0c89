"""Session-wide test setup: Triton runs under its CPU interpreter when no GPU is present.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
(or a library such as xgrammar) can import a kernel module.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
