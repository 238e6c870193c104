"""Fault injection for tests: $PDSERVE_FAULT names faults for particular ranks. Never set in production.

    PDSERVE_FAULT="<rank name>:<fault>[:<seconds>],..."    e.g. "decode-0:delay_pull:3,prefill-1:hang_before_hello"

Faults (each widens a window that real failures hit by chance, so a test can hit it every time):
  hang_before_hello   the rank loads, then never says Hello (a rank stuck loading); it still
                      exits on SIGTERM/SIGINT;
  delay_pull:S        decode rank: a Handoff waits S seconds before its KV read starts (the KV
                      stays pinned in the prefill rank's pool: the window of a transfer);
  slow_kv_store:S     every probe and read of the rank's L3 read-ahead (--kv-store) takes S
                      seconds longer (a store on a congested network, or a dying disk).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cluster import settings
from hicache.store import KVStore

log = logging.getLogger(__name__)

FAULT_ENV = settings.FAULT.name
KNOWN = frozenset({"hang_before_hello", "delay_pull", "slow_kv_store"})


@dataclass(frozen=True)
class Faults:
    hang_before_hello: bool = False
    delay_pull_s: float = 0.0
    slow_kv_store_s: float = 0.0


def parse_faults(spec: str, rank_name: str) -> Faults:
    """The faults `spec` names for `rank_name`. Raises ValueError on a malformed entry or an
    unknown fault (a typo must not silently test nothing)."""
    kw: dict = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) not in (2, 3) or parts[1] not in KNOWN:
            raise ValueError(f"{FAULT_ENV}: bad entry {entry!r} (want <rank>:<fault>[:<seconds>], faults "
                             f"{sorted(KNOWN)})")
        if parts[0] != rank_name:
            continue
        if parts[1] == "hang_before_hello":
            kw["hang_before_hello"] = True
        else:
            kw[f"{parts[1]}_s"] = float(parts[2]) if len(parts) == 3 else 1.0
    return Faults(**kw)


class SlowStore(KVStore):
    """A KVStore whose probes and reads take `delay_s` longer (slow_kv_store)."""

    def __init__(self, inner: KVStore, delay_s: float) -> None:
        self.inner, self.delay_s, self.kind = inner, delay_s, inner.kind

    def leading(self, names):
        time.sleep(self.delay_s)
        return self.inner.leading(names)

    def read_into(self, name, out):
        time.sleep(self.delay_s)
        return self.inner.read_into(name, out)

    def write(self, name, data):
        self.inner.write(name, data)


def apply_engine_faults(engine, faults: Faults) -> None:
    """The faults that act inside the engine's host cache (slow_kv_store)."""
    hc = getattr(engine, "hicache", None)
    if faults.slow_kv_store_s and hc is not None and hc.prefetcher is not None:
        log.warning("fault injected (%s): L3 probes and reads take %.3f s longer", FAULT_ENV, faults.slow_kv_store_s)
        hc.prefetcher.store = SlowStore(hc.prefetcher.store, faults.slow_kv_store_s)


def faults_for(rank_name: str) -> Faults:
    return parse_faults(settings.fault_spec(), rank_name)
