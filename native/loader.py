"""JIT build-and-load of every native library in `csrc/`: the C++ kernels (torch ops), and
`load_c_module` for a plain CPython extension in C (the router's csrc/fanout/sse_fanout.c).
Nothing is built at import time: each caller builds (or finds cached) on first use.

`load_kernel` builds a source set with torch.utils.cpp_extension into
`$PDSERVE_CACHE_DIR/kernels/<variant>-<hash>` and loads the library, which registers
its ops under `torch.ops.pdserve`. The hash covers the sources and headers, the
flags and the torch version, and, for `-march=native` builds, the CPU model and
feature flags (such code is only valid where they match): an edit, an upgrade or
another machine rebuilds; later processes load the cached library.

The cache's directories are 0700 and refused when another user owns them or may write to them,
and a library whose bytes no longer match the hash recorded at its build is built again.

Processes that start together (the ranks) build once: the first takes an flock on the
directory, the others wait for it and load what it built. torch's own build lock is a plain
file that a process killed mid-build leaves behind, and every later load would wait on it
forever; under the flock no one else is building, so a leftover one is removed.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from cluster import settings

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def check_compiler(who: str) -> None:
    """Raise RuntimeError naming `who` when torch's extension builder has no C++ compiler."""
    cxx = os.environ.get("CXX") or "c++"  # torch.utils.cpp_extension compiles with $CXX, else `c++`
    if shutil.which(cxx.split()[0]) is not None:
        return
    hint = " (g++ is installed: set CXX=g++)" if shutil.which("g++") else ""
    source = "$CXX" if os.environ.get("CXX") else "`c++` on PATH ($CXX is unset)"
    raise RuntimeError(f"{who} needs a C++ compiler to build its kernel, but {source} names {cxx!r}, "
                       f"which was not found{hint}")


def cpu_id() -> str:
    """The CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def _build_dir(name: str) -> Path:
    """The cache's directory for one library: made 0700, refused when another user owns it (or its
    `kernels` parent) or may write to it (settings.private_dir)."""
    return settings.private_dir(settings.private_dir(settings.cache_dir() / "kernels") / name)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_recorded(library: Path) -> None:
    """A cached library whose bytes differ from the hash recorded when it was built is removed
    (with its objects), so it is built again rather than loaded. (Held under the directory's flock.)"""
    record = library.with_name(library.name + ".sha256")
    if library.exists() and record.exists() and record.read_text().strip() != _sha256(library):
        log.warning("%s does not match the hash recorded at its build: building it again", library)
        for f in library.parent.iterdir():
            if f.name != "pdserve.flock" and f.is_file():
                f.unlink()


def _record(library: Path) -> None:
    """Record the hash of the library this process just built or loaded (under the directory's
    flock): what the next process checks. Always, not only when none is recorded: the build step
    may have rebuilt it (its inputs' times changed), and a stale record would make every later
    process throw the library away and build it again."""
    record = library.with_name(library.name + ".sha256")
    if library.exists() and (not record.exists() or record.read_text().strip() != _sha256(library)):
        tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        tmp.write_text(_sha256(library))
        tmp.replace(record)


def load_kernel(who: str, variant: str, sources: Sequence[str], cflags: Sequence[str],
                ldflags: Sequence[str] = ("-fopenmp",), headers: Sequence[str] = (),
                cuda_cflags: Sequence[str] = ()) -> None:
    """Build (or find cached) `sources` (paths under csrc/) and load them into torch.ops.pdserve.

    Raises RuntimeError when no compiler is found or the build fails.
    """
    from torch.utils import cpp_extension

    check_compiler(who)
    if "-march=native" in cflags and platform.machine() in ("x86_64", "AMD64") and not any(
            f.startswith("-mprefer-vector-width") for f in cflags):
        # GCC's tuning for some -march targets (this VM's CPU model reads as rocketlake) prefers
        # 256-bit vectors: 16-float vector-extension code is then split into halves and loops are
        # vectorized at 8 lanes (the decode attention kernel ran ~15% slower from cache).
        cflags = (*cflags, "-mprefer-vector-width=512")
    digest = hashlib.sha256(str(CSRC).encode())  # a checkout of its own: another's build files name other paths
    for rel in (*sources, *headers):
        digest.update(rel.encode() + b"\0" + (CSRC / rel).read_bytes())
    for part in (" ".join((*cflags, *ldflags, *cuda_cflags)), torch.__version__):
        digest.update(b"\0" + part.encode())
    if "-march=native" in cflags:
        digest.update(b"\0" + cpu_id().encode())
    build_dir = _build_dir(f"{variant}-{digest.hexdigest()[:12]}")
    with open(build_dir / "pdserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when this process exits, however it exits
        (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a build that was killed
        library = build_dir / f"pdserve_{variant}.so"
        _check_recorded(library)
        cpp_extension.load(
            name=f"pdserve_{variant}",
            sources=[str(CSRC / rel) for rel in sources],
            extra_cflags=list(cflags),
            extra_cuda_cflags=list(cuda_cflags),
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(CSRC / "include")],
            build_directory=str(build_dir),
            is_python_module=False,  # the library registers its ops in torch.ops.pdserve
        )
        _record(library)


def load_c_module(name: str, source: str, cflags: Sequence[str] = ("-O2",)):
    """Build (or find cached) the CPython extension module `name` from `source` (a C file under
    csrc/) with the C compiler, under the same cache, hash and flock rules as load_kernel (the
    hash covers the source, the flags and the Python version); returns the loaded module.
    Raises RuntimeError when it cannot be built."""
    import importlib.machinery
    import importlib.util
    import subprocess
    import sys
    import sysconfig

    src = CSRC / source
    digest = hashlib.sha256(src.read_bytes() + b"\0" + " ".join(cflags).encode() + b"\0" + sys.version.encode())
    build_dir = _build_dir(f"{name}-{digest.hexdigest()[:12]}")
    path = build_dir / f"{name}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    with open(build_dir / "pdserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _check_recorded(path)
        if not path.exists():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
            cmd = [*cc.split(), *cflags, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", str(tmp),
                   str(src)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                tmp.unlink(missing_ok=True)
                detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-300:]
                raise RuntimeError(f"cannot build {source} ({e} {detail})") from e
            tmp.replace(path)
        _record(path)
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
