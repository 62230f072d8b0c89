"""Triton kernels for CUDA tensors (importing any module here imports triton)."""
