"""The CPU's C kernels: their sources, the build and the ctypes loader (clib)."""
