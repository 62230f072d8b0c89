"""Tests of aioengine/kernels/: the torch references, the CPU C kernels (cpu/), the Triton ones (triton/)."""
