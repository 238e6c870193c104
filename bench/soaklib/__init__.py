"""A bounded soak of a running system (bench/soak.py is its command line, tests/e2e/test_e2e_soak.py
its short version): system.py (start one, read /health, /metrics, memory), mix.py (the requests),
client.py (send one, classify its outcome), run.py (the loop and the verdict), report.py (markdown).
"""
from .report import render
from .run import SoakConfig, SoakResult, soak
from .system import Launched, launch

__all__ = ["Launched", "SoakConfig", "SoakResult", "launch", "render", "soak"]
