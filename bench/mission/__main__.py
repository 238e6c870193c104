"""`python -m bench.mission`: see bench/mission/cli.py."""
import sys

from bench.mission.cli import main

sys.exit(main())
