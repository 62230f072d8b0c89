"""Tests of the Triton kernels (aioengine/kernels/triton/), interpreted on CPU without a GPU."""
