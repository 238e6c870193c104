"""The native libraries and their Python wrappers, side by side: one module per op group, each
building its sources under csrc/<group>/ on first use through `loader` (nothing is built at
import). docs/kernels.md has the table: op, sources, path by CPU feature, what each replaced.

`PDSERVE_KERNELS=torch` (cluster/settings.py) makes every wrapper with a torch reference say
its kernel is unavailable, so callers run the torch ops: the one comparison switch.
"""
from __future__ import annotations

from cluster import settings


def torch_only() -> bool:
    """PDSERVE_KERNELS=torch: the torch reference ops run where a kernel has one."""
    return settings.kernels() == "torch"
