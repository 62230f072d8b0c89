"""Tests of the CPU C kernels (aioengine/kernels/cpu/)."""
