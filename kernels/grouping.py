"""The group arithmetic every quantized layout shares, without torch (detection reads headers only)."""

from __future__ import annotations

SUPPORTED_BITS = (2, 3, 4, 8)  # what QuantizedWeight holds and the kernels run


def n_groups(k: int, group_size: int) -> int:
    """Quantization groups over K input rows; group_size -1 is one group spanning K."""
    return 1 if group_size == -1 else -(-k // group_size)
