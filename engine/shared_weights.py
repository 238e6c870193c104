"""One read-only copy of the weights for every rank of a host.

Every rank of a launch holds the same weights, and the linear kernel's packed copy of them
(513 MB for SmolLM2 in bf16 without AMX; ~480 MB with it, where the AMX GEMM's copy of the
layers' weights takes the place of the decode kernel's, plus 98 MB of exact Q4_1 / Q8_0 copies
for a GGUF checkpoint): mapped from one file they are held once, not once per rank.
Mapped, the copies are also the same physical pages, so ranks that read a layer at about the
same time share it in the L3. Measured on this 2-core Zen 4 VM: two processes streaming 30
blocks of 9 MB took 17-18 ms a pass each with private copies and 10.5 ms with one shared copy
(one process alone: 11.4 ms); but a 4-row decode step is not bandwidth-bound enough for that to
show in serving (c8, alternated fresh servers: within the run-to-run noise).

The launcher makes a directory on tmpfs (`--shared-weights-dir`, /dev/shm/pdserve-weights-<pid>)
and removes it when it stops. Each rank loads and packs its model as before, then calls
`share_weights`: the first rank to get there (an flock on a lock file next to it) writes every
parameter and packed kernel copy into one file (named by a hash of the model's identity and the
tensors' names, dtypes and shapes; written under a temporary name and renamed, so a reader never
sees half a file), the others map that file. Before a rank swaps its tensors for views of the
mapping it compares them byte for byte with its own: a file that differs in any byte (another
build of the kernels' layout, another checkpoint) is not used and the rank keeps its private copy.
The mapping is read-only (PROT_READ): a write to a weight faults instead of changing the peers'
weights. It is mapped at a 2 MB-aligned address and collapsed to huge pages where the kernel
does that (engine/hugepages.py: a decode step streams all of it). Where the file cannot be
written (tmpfs full) or opened the rank keeps its private copy and logs why.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine import hugepages

log = logging.getLogger(__name__)

ALIGN = 4096  # every tensor starts on its own page
PREFIX = "pdserve-weights-"


@dataclass
class SharedWeights:
    """The mapping a model's tensors are views of (kept alive with the model)."""

    path: Path
    nbytes: int
    created: bool  # this process wrote the file
    address: int  # where the mapping starts in this process
    inode: int  # of the file mapped
    mm: mmap.mmap | ctypes.Array  # the mapping (engine/hugepages.py's where it could be made)

    def holds(self, t: torch.Tensor) -> bool:
        """`t`'s bytes lie inside the mapping."""
        return self.address <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= self.address + self.nbytes


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter (tied ones once) and every Linear's packed copies (the
    decode kernel's and the AMX GEMM's)."""
    from engine.layers.linear import Linear

    out = [(name, p) for name, p in model.named_parameters()]  # duplicates (tied) removed by torch
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod._packed is not None:
            out.append((name + "._packed", mod._packed[1]))
        if isinstance(mod, Linear) and mod._gemm is not None and mod._gemm[1] is not None:
            out.append((name + "._gemm", mod._gemm[1]))
        if isinstance(mod, Linear) and mod.quant_weight() is not None:
            out.append((name + "._quant", mod._quant[1]))
    return out


def _layout(identity: str, tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, list[int], int]:
    """(file key, byte offset of each tensor, file size)."""
    offsets, pos, manifest = [], 0, []
    for name, t in tensors:
        offsets.append(pos)
        nbytes = t.numel() * t.element_size()
        manifest.append([name, str(t.dtype), list(t.shape), nbytes, pos])
        pos += -(-nbytes // ALIGN) * ALIGN
    key = hashlib.blake2b(json.dumps([identity, manifest]).encode(), digest_size=12).hexdigest()
    return key, offsets, pos


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]], offsets: list[int], size: int) -> bool:
    """Write the file under a temporary name and rename it; False where it cannot be written."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            for (_, t), off in zip(tensors, offsets):
                f.seek(off)
                f.write(memoryview(_bytes(t).numpy()))
            f.truncate(size)
        os.replace(tmp, path)  # readers see the whole file or none
        return True
    except OSError as e:
        log.warning("shared weights: cannot write %s (%s); this rank keeps its own copy", path, e)
        tmp.unlink(missing_ok=True)
        return False


def _map(path: Path, tensors, offsets: list[int], size: int) -> tuple[mmap.mmap | ctypes.Array | None, int, bool]:
    """(read-only mapping of the file, its inode, whether this process wrote it), written first
    where it does not exist; (None, 0, False) where it cannot be written or has another size."""
    # One writer: ranks that start together would otherwise each write (and map) a file of their own.
    lock = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    created = False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            if not _write(path, tensors, offsets, size):
                return None, 0, False
            created = True
        fd = os.open(path, os.O_RDONLY)
    finally:
        os.close(lock)  # releases the lock
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            log.warning("shared weights: %s has %d bytes, expected %d; keeping this rank's copy", path, st.st_size, size)
            return None, 0, False
        # 2 MB-aligned and collapsed to huge pages where the kernel does it (engine/hugepages.py)
        mm = hugepages.map_readonly(fd, size)
        if mm is None:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return mm, st.st_ino, created
    finally:
        os.close(fd)


def share_weights(model: nn.Module, directory: str | Path, identity: str) -> SharedWeights | None:
    """Swap the CPU model's weights for read-only views of the host's shared copy in `directory`
    (written by the first rank that gets here). `identity` names the checkpoint and dtype.
    Returns None, leaving the model as it was, where the file cannot be used."""
    tensors = _tensors(model)
    if not tensors or any(t.device.type != "cpu" for _, t in tensors):
        return None
    key, offsets, size = _layout(identity, tensors)
    path = Path(directory) / f"{PREFIX}{key}.bin"
    try:
        mm, inode, created = _map(path, tensors, offsets, size)
    except OSError as e:
        log.warning("shared weights: cannot use %s (%s); this rank keeps its own copy", path, e)
        return None
    if mm is None:
        return None
    with warnings.catch_warnings():  # a non-writable buffer is the point: writes fault
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(mm, dtype=torch.uint8)
    views = []
    for (name, t), off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        v = base[off:off + n]
        if not torch.equal(v, _bytes(t)):
            log.warning("shared weights: %s differs from this rank's %s; keeping this rank's copy", path, name)
            del base, v, views
            try:
                if isinstance(mm, mmap.mmap):
                    mm.close()  # (hugepages' mapping is unmapped when its last view goes)
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
            return None
        views.append(v.view(t.dtype).view(t.shape))
    _swap(model, tensors, views)
    del tensors, views
    hugepages.release_freed_memory()
    log.info("shared weights: %s %s (%.0f MB)", "wrote and mapped" if created else "mapped", path, size / 2**20)
    return SharedWeights(path, size, created, base.data_ptr(), inode, mm)


def _swap(model: nn.Module, tensors: list[tuple[str, torch.Tensor]], views: list[torch.Tensor]) -> None:
    from engine.layers.linear import Linear

    new = {name: v for (name, _), v in zip(tensors, views)}
    # One Parameter per tensor: a tied one, held by two modules, stays one object.
    by_ptr = {t.data_ptr(): nn.Parameter(new[name], requires_grad=False)
              for name, t in tensors if not name.endswith(("._packed", "._gemm", "._quant"))}
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.data_ptr() in by_ptr:
                mod._parameters[pname] = by_ptr[p.data_ptr()]
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and name + "._packed" in new:
            mod._packed = (mod.packed_key(), new[name + "._packed"])
        if isinstance(mod, Linear) and name + "._gemm" in new:
            mod._gemm = (mod.gemm_key(), new[name + "._gemm"])
        if isinstance(mod, Linear) and name + "._quant" in new:
            mod._quant = (Linear.packed_key(mod), new[name + "._quant"])
