"""AgentX replay with aiperf: synthetic agent traces (`gen_traces`), colocated vs PD comparison
(`compare`), its report (`report`). The client runs from `.venv-bench` (scripts/setup_aiperf.sh)."""
