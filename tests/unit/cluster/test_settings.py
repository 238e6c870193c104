"""cluster/settings.py is the one place PDSERVE_* variables are read, and docs/operations.md's
table lists exactly the settings it defines."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster import settings

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("cluster", "native", "engine", "hicache", "kv_transfer", "rank_runtime", "prefill", "decode",
            "pd_server", "bench", "scripts")
READ = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"']PDSERVE_")


def test_no_module_reads_a_pdserve_variable_itself():
    files = [f for p in PACKAGES for f in (ROOT / p).rglob("*.py")] + [ROOT / "tests" / "conftest.py"]
    readers = [str(f.relative_to(ROOT)) for f in files
               if f.name != "settings.py" and READ.search(f.read_text())]
    assert readers == []


def test_every_pdserve_name_in_the_code_is_a_setting():
    names = {s.name for s in settings.SETTINGS}
    seen = set()
    for p in PACKAGES:
        for f in (ROOT / p).rglob("*.py"):
            # (-DPDSERVE_...: a C macro the loader defines, not an environment variable)
            seen |= set(re.findall(r"(?<![-\w])PDSERVE_[A-Z_]+[A-Z]", f.read_text()))
    assert seen - names == set()


def test_the_docs_table_lists_exactly_the_settings():
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("## Environment settings"):]
    rows = set(re.findall(r"^\| `(PDSERVE_[A-Z_]+)`", table, re.M))
    assert rows == {s.name for s in settings.SETTINGS}


def test_values_are_read_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert settings.cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert settings.cache_dir() == Path.home() / ".cache" / "pdserve"
    monkeypatch.delenv("PDSERVE_KERNELS", raising=False)
    assert settings.kernels() == "native"
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    assert settings.kernels() == "torch" and settings.packing_identity() == "kernels=torch"
    assert settings.api_key({"PDSERVE_API_KEY": "k"}) == "k" and settings.api_key({}) == ""


def test_a_misspelt_kernels_value_is_an_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "off")
    with pytest.raises(ValueError, match="PDSERVE_KERNELS must be 'native' or 'torch'"):
        settings.kernels()
