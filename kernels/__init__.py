"""Compute kernels (Marlin-layout W4A16 and friends); imports nothing from quantserve."""
