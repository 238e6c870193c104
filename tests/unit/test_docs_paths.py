"""The docs name only paths that exist: every repository path (`pd_server/...`, `scripts/...`,
...) and every file name (`foo.py`, `bar.sh`) in README.md and docs/*.md is in the tree. (The
run notes under docs/results/ keep the names of their day.)"""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("pd_server", "prefill", "decode", "hicache", "engine", "cluster", "kv_transfer", "rank_runtime", "native",
        "csrc", "scripts", "bench", "tests", "docs")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOPS)})/[\w./-]*\w)")
NAME = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|sh|cpp|h|cu|md|toml))\b")
PROSE = {"prefill/decode"}  # words that look like paths
OUTPUTS = {"soak.md", "llama.cpp"}  # files a documented command writes; a project's name


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _tree_names() -> set[str]:
    out = set()
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__", "build")]
        out.update(dirs, files)
    return out


def test_docs_name_only_paths_that_exist():
    names, missing = _tree_names(), []
    for doc in _docs():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                p = m.group(1).rstrip("/.")
                if p not in PROSE and not any(c in p for c in "*{<") and not (ROOT / p).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {p}")
            for m in NAME.finditer(line):
                if m.group(1) not in names and m.group(1) not in OUTPUTS:
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert missing == []
