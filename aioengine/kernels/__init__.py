"""aioengine.kernels: hot ops (attention, KV store) with a torch reference and a Triton kernel."""
