"""The CUDA backend: its launching worker, awaited events, pinned staging, CUDA graphs, memory profiling."""
