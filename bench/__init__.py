"""Benchmarks: standalone scripts (`python bench/bench_*.py`) and packages run with `python -m`
(`bench.agentx`: AgentX replay with aiperf; `bench.pdtune`: prefill/decode split tuning)."""
