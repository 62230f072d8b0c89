"""Triton kernels run under the CPU interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it must be set before the
kernel modules (``aioengine.kernels.triton.kv_store`` etc.) are first imported; the CPU path never imports
them, and this conftest loads before any test module of this directory. The test modules set it
too (``os.environ.setdefault``) for runs that pick a single file.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
