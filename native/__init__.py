"""The native libraries and their Python wrappers, side by side: one module per op group, each
building its sources under csrc/<group>/ on first use through `loader` (nothing is built at
import). docs/kernels.md has the table: op, sources, path by CPU feature, what each replaced.

`PDSERVE_KERNELS=torch` (cluster/settings.py) makes every kernel with a torch reference say it
is unavailable (`build` returns False and builds nothing), so callers run the torch ops: the
one comparison switch.
"""
from __future__ import annotations

from collections.abc import Sequence

from cluster import settings

CPU_CFLAGS = ("-O3", "-march=native", "-fopenmp")


def torch_only() -> bool:
    """PDSERVE_KERNELS=torch: the torch reference ops run where a kernel has one."""
    return settings.kernels() == "torch"


def build(who: str, variant: str, sources: Sequence[str], headers: Sequence[str] = ()) -> bool:
    """Build (or find cached) and load a CPU kernel that has a torch reference: False, and nothing
    built, under PDSERVE_KERNELS=torch. Callers cache the answer (functools.cache)."""
    if torch_only():
        return False
    from native.loader import load_kernel

    load_kernel(who, variant, sources, CPU_CFLAGS, headers=headers)
    return True
