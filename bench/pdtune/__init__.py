"""Tuning the prefill/decode split (scripts/pd_tune.py).

Data flow: measure.py (cost curves of this machine -> costs.json) -> costs.py (interpolated
curves, per-rank costs) -> split.py (colocated N or xPyD) -> workload.py (weka traces or
synthetic) -> sim.py (discrete-event replay of one split) -> report.py (per-request results,
goodput, tables) <- sweep.py (the same results measured with aiperf against real systems).
cli.py wires the subcommands.
"""
