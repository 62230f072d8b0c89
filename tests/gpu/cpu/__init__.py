"""Tests of the CPU backend (aioengine/gpu/cpu/)."""
