"""Tests of aioengine/gpu/: the device-neutral runner parts, the models, and each backend (cpu/, cuda/)."""
