"""Tests of the CUDA backend (aioengine/gpu/cuda/); those that need a GPU skip without one."""
