"""aioengine.bench: throughput, serving and latency benchmarks."""
