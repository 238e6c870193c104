"""The packages' import directions, read from the source (every import, function-level ones too):
cluster/ (the messages, cluster auth, flags, settings) depends on no other package of ours;
native/ (the kernels and their loader) only on cluster's settings; kv_transfer/ on those two;
the ranks (rank_runtime/, and the PD roles on it, never on each other) do not import the
router; the engine knows no rank, router, transfer backend or host cache, the host cache no
rank, router or transfer backend; the router (pd_server/) no rank and no transfer backend; only
launcher/ knows both the router and the ranks (nothing imports it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "cluster": {"pd_server", "rank_runtime", "decode", "prefill", "engine", "hicache", "kv_transfer", "native",
                "launcher"},
    "native": {"pd_server", "rank_runtime", "decode", "prefill", "engine", "hicache", "kv_transfer", "launcher"},
    "kv_transfer": {"pd_server", "rank_runtime", "decode", "prefill", "engine", "hicache", "launcher"},
    "rank_runtime": {"pd_server", "decode", "prefill", "launcher"},
    "prefill": {"pd_server", "decode", "launcher"},
    "decode": {"pd_server", "prefill", "launcher"},
    "engine": {"pd_server", "rank_runtime", "decode", "prefill", "kv_transfer", "hicache", "launcher"},
    "hicache": {"pd_server", "rank_runtime", "decode", "prefill", "kv_transfer", "launcher"},
    "pd_server": {"rank_runtime", "decode", "prefill", "kv_transfer", "launcher"},  # the router: no rank code
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
