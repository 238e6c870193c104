"""The packages' import directions, read from the source (every import, function-level ones too):
the PD roles build on rank_runtime/ and never on each other; rank_runtime/ knows no role; the
engine and the host cache know no rank and no router."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "prefill": {"decode"},
    "decode": {"prefill"},
    "rank_runtime": {"decode", "prefill"},
    "engine": {"decode", "prefill", "rank_runtime", "pd_server"},
    "hicache": {"decode", "prefill", "rank_runtime", "pd_server"},
}


def imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downwards(package):
    bad = {str(f.relative_to(ROOT)): sorted(imported_packages(f) & FORBIDDEN[package])
           for f in sorted((ROOT / package).rglob("*.py"))}
    assert {f: b for f, b in bad.items() if b} == {}
