"""The mission benchmark (scripts/mission_bench.sh): each serving configuration (2P2D, 1P1D,
colocated-2, vLLM, ...) started as a user starts it, the same synthetic levels and AgentX replay
against each, repeated and interleaved, one markdown table of medians and ratios.

configs.py (names -> start flags), servers.py (start / stop), table.py (medians, ratios,
report.md), cli.py (the driver; `python -m bench.mission`)."""
