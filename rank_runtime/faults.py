"""Fault injection for tests: $PDSERVE_FAULT names faults for particular ranks. Never set in production.

    PDSERVE_FAULT="<rank name>:<fault>[:<seconds>],..."    e.g. "decode-0:delay_pull:3,prefill-1:hang_before_hello"

Faults (each widens a window that real failures hit by chance, so a test can hit it every time):
  hang_before_hello   the rank loads, then never says Hello (a rank stuck loading); it still
                      exits on SIGTERM/SIGINT;
  delay_pull:S        decode rank: a Handoff waits S seconds before its KV read starts (the KV
                      stays pinned in the prefill rank's pool: the window of a transfer).
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster import settings

FAULT_ENV = settings.FAULT.name
KNOWN = frozenset({"hang_before_hello", "delay_pull"})


@dataclass(frozen=True)
class Faults:
    hang_before_hello: bool = False
    delay_pull_s: float = 0.0


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
            kw["delay_pull_s"] = float(parts[2]) if len(parts) == 3 else 1.0
    return Faults(**kw)


def faults_for(rank_name: str) -> Faults:
    return parse_faults(settings.fault_spec(), rank_name)
