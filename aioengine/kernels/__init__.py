"""aioengine.kernels: the layers' hot ops: torch references (reference.py), CPU C kernels (cpu/), Triton (triton/)."""
