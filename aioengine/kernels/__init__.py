"""aioengine.kernels: the layers' hot ops: torch references (reference.py), CPU C (cpu/), Triton (triton/)."""
