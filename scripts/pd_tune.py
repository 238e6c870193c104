#!/usr/bin/env python3
"""Tune the prefill/decode split: `measure`, `simulate`, `sweep` (bench/pdtune/cli.py).

    scripts/pd_tune.py measure --model smollm2-135m-instruct --out costs.json
    scripts/pd_tune.py simulate --costs costs.json --workload bench/traces/agentx_default --ranks 4 \\
        --ttft-ms 2000 --itl-ms 200
    scripts/pd_tune.py sweep --workload bench/traces/agentx_default --ranks 2 --ttft-ms 2000 --itl-ms 200

Runs `python -m bench.pdtune` with the repository on PYTHONPATH (bench/ is not an installed
package), in the project's .venv when the current interpreter is not already one.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    py = sys.executable
    venv_py = ROOT / ".venv" / "bin" / "python"
    if sys.prefix == sys.base_prefix and venv_py.exists():  # system python: use the project's venv
        py = str(venv_py)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    os.execve(py, [py, "-m", "bench.pdtune", *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
