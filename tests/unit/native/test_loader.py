"""The kernels' JIT loader (native/loader.py): one build at a time per directory, and a
build killed half-way does not block every later start."""
from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from native import loader as jit


@pytest.fixture
def seen(tmp_path, monkeypatch) -> list:
    """(build directory, torch's lock present) per cpp_extension.load call (faked: no build);
    one load done, so seen[0][0] is the directory."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls: list = []

    def load(**kw):
        d = Path(kw["build_directory"])
        calls.append((d, (d / "lock").exists()))

    monkeypatch.setattr(cpp_extension, "load", load)
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert calls[0][0].parent == tmp_path / "kernels"
    return calls


def test_a_lock_left_by_a_killed_build_is_removed(seen):
    build_dir = seen[0][0]
    (build_dir / "lock").write_text("")  # torch's FileBaton of a process that died mid-build
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert seen[1] == (build_dir, False)


def test_a_second_loader_waits_for_the_build_in_progress(seen):
    build_dir = seen[0][0]
    # Another process holds the flock (a build in progress) for a while, and writes `done` just
    # before it lets go: a loader that waited for it finds the file.
    done = build_dir / "done"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, pathlib, time\n"
        f"f = open({str(build_dir / 'pdserve.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"print('held', flush=True); time.sleep(1.0); pathlib.Path({str(done)!r}).write_text('')")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
        assert done.exists() and len(seen) == 2
    finally:
        holder.wait(timeout=10)
        holder.stdout.close()
    # Free again: no wait.
    with open(build_dir / "pdserve.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_cache_is_private_and_a_library_changed_after_its_build_is_built_again(seen, tmp_path):
    build_dir = seen[0][0]
    assert (build_dir.stat().st_mode & 0o777, (tmp_path / "kernels").stat().st_mode & 0o777) == (0o700, 0o700)
    lib = build_dir / "pdserve_activation_cpu.so"
    lib.write_bytes(b"built")  # (the faked build made none)
    (build_dir / "kernel.o").write_bytes(b"obj")
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    record = build_dir / "pdserve_activation_cpu.so.sha256"
    assert record.exists()  # a library without a record gets one (trust on first load)
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert lib.exists()  # it matches: loaded as it is
    lib.write_bytes(b"tampered")
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert not lib.exists() and not (build_dir / "kernel.o").exists()  # removed: the build runs again
    build_dir.chmod(0o777)
    with pytest.raises(RuntimeError, match="refusing to load"):
        jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))


def test_a_library_the_build_step_rebuilt_is_recorded_again(seen, monkeypatch):
    """torch's build step rebuilds a library whose inputs' times changed: the record follows the
    new bytes, so the next process loads it rather than throwing it away and building it again."""
    build_dir = seen[0][0]
    lib = build_dir / "pdserve_activation_cpu.so"
    lib.write_bytes(b"built once")
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))

    def rebuild(**kw):
        lib.write_bytes(b"built again by ninja")

    monkeypatch.setattr(cpp_extension, "load", rebuild)
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert lib.read_bytes() == b"built again by ninja"  # not removed as tampered


def test_each_checkout_builds_in_a_directory_of_its_own(seen, monkeypatch, tmp_path):
    other = tmp_path / "other-checkout" / "csrc"
    other.mkdir(parents=True)
    for rel in ("elementwise/activation.cpp",):
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_bytes((jit.CSRC / rel).read_bytes())
    monkeypatch.setattr(jit, "CSRC", other)
    jit.load_kernel("test", "activation_cpu", ["elementwise/activation.cpp"], ("-O3",))
    assert seen[-1][0] != seen[0][0] and seen[-1][0].parent == seen[0][0].parent
