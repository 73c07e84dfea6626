"""Tests of kernels/ (quantserve.kernels): Triton W4A16, fused, MoE, paged-attention kernels; Marlin."""
