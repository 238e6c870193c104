"""`python -m bench.pdtune ...` (what scripts/pd_tune.py runs)."""
from bench.pdtune.cli import main

main()
