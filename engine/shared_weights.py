"""One read-only copy of the weights for every rank of a host, loaded and packed once.

Every rank of a launch holds the same weights, and the linear kernel's packed copy of them
(513 MB for SmolLM2 in bf16 without AMX; ~480 MB with it, where the AMX GEMM's copy of the
layers' weights takes the place of the decode kernel's, plus 98 MB of exact Q4_1 / Q8_0 copies
for a GGUF checkpoint): mapped from one file they are held once, not once per rank.
Mapped, the copies are also the same physical pages, so ranks that read a layer at about the
same time share it in the L3 (docs/kernels.md has what that measured).

The launcher makes a directory on tmpfs (`--shared-weights-dir`, /dev/shm/pdserve-weights-<pid>)
and removes it when it stops. Each rank builds its model (on the meta device) and calls
`share_weights` with what the file's content is a function of (`weights_identity`: the bytes
of the checkpoint's files, the dtype, the engine's and kernels' source, the torch version, the
CPU's features and PDSERVE_KERNELS, all hashed). The file is named by a hash of that
identity. Under an flock on a lock file next to it, the first rank finds no file: it loads and
packs its model, writes every parameter and packed kernel copy into the file (under a temporary
name, renamed: a reader never sees half a file) and maps it. The ranks that start meanwhile wait
on the lock instead of loading and packing at once on the same cores, then map the file without
reading the checkpoint: the same identity means the same bytes, so a rank never maps weights
other than those it would have made. The file's header holds the identity, every tensor's name,
dtype, shape and offset, which module parameter and kernel copy is which tensor (tied weights
stay one tensor) and a SHA-1 of the tensor bytes, which a reader checks before it uses them
(0.2 s for 257 MB, against 1.2-1.6 s to load the checkpoint and 0.7 s to compare it byte for
byte, as ranks did before): a file that differs in any byte, has another size or layout is not
used, and that rank loads its own copy. Where the file cannot be written (tmpfs full) or opened
the rank keeps its private copy and logs why.
The mapping is read-only (PROT_READ): a write to a weight faults instead of changing the peers'
weights. It is mapped at a 2 MB-aligned address and collapsed to huge pages where the kernel
does that (engine/hugepages.py: a decode step streams all of it).
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cluster import settings
from engine import hugepages

log = logging.getLogger(__name__)

ALIGN = 4096  # every tensor starts on its own page
PREFIX = "pdserve-weights-"
MAGIC = b"PDSWGT02"  # the file format; bump the digit when the layout or what the identity covers changes
_COPIES = ("_packed", "_gemm", "_quant")  # a Linear's kernel copies


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


def weights_identity(model_dir: str | Path, dtype: str) -> str:
    """What a CPU rank's loaded and packed weights are a function of, as one string of digests:
    the name and SHA-1 of every file of `model_dir` (0.4 s for SmolLM2's 538 MB here; kept by
    path and stat, `_file_sha1`), the dtype, the engine's Python and kernel sources, the torch
    and safetensors versions, the CPU's model and features (which kernel paths, so which packed
    layouts) and PDSERVE_KERNELS (whether copies are made). Raises OSError where the checkpoint cannot be read."""
    parts = [MAGIC.decode(), f"dtype {dtype}", f"torch {torch.__version__}",
             f"safetensors {importlib.metadata.version('safetensors')}", f"code {_code_digest()}",
             f"cpu {_cpu_digest()}", f"env {_env_digest()}"]
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file():
            parts.append(f"file {f.name} {_file_sha1(f)}")
    return "\n".join(parts)


# A file's SHA-1 is kept in $PDSERVE_CACHE_DIR/digests/ under its path and stat (device, inode,
# size, mtime in ns): every rank of a launch hashed the same checkpoint (1.5-2 s each with 4 ranks
# on 2 cores). A file modified less than DIGEST_SETTLE_S before it was hashed is not kept: its
# mtime could repeat for a second write in the same clock tick (git's "racily clean" entries).
DIGEST_SETTLE_S = 2.0


def _file_sha1(f: Path) -> str:
    from cluster.settings import cache_dir

    st = f.stat()
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    entry = cache_dir() / "digests" / hashlib.sha1(str(f.resolve()).encode()).hexdigest()
    try:
        kept_stamp, digest = entry.read_text().split()
        if kept_stamp == stamp:
            return digest
    except (OSError, ValueError):
        pass
    with open(f, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha1").hexdigest()
    if time.time() - st.st_mtime_ns / 1e9 > DIGEST_SETTLE_S and f.stat().st_mtime_ns == st.st_mtime_ns:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(f"{stamp} {digest}\n")
            tmp.replace(entry)
        except OSError:
            pass  # a cache that cannot be written: hash again next time
    return digest


@functools.cache
def _code_digest() -> str:
    from native.loader import CSRC

    digest = hashlib.sha1()
    root = Path(__file__).resolve().parents[1]  # the repository: engine/ and native/ (the kernels' wrappers)
    for f in sorted([*(root / "engine").rglob("*.py"), *(root / "native").rglob("*.py"),
                     *(p for p in CSRC.rglob("*") if p.is_file())]):
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def _cpu_digest() -> str:
    from native.loader import cpu_id

    return hashlib.sha1(f"{platform.machine()}\n{cpu_id()}".encode()).hexdigest()


def _env_digest() -> str:
    return hashlib.sha1(settings.packing_identity().encode()).hexdigest()


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter (tied ones once) and every Linear's packed copies (the
    decode kernel's, the AMX GEMM's and the quant copy)."""
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


def _manifest(identity: str, model: nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """The file's header: the tensors' layout (offsets from the body's start), which module
    parameter and kernel copy is which tensor, and the body's size (digest filled in by _write)."""
    from engine.layers.linear import Linear

    index = {name: i for i, (name, _) in enumerate(tensors)}
    by_param = {id(p): index[name] for name, p in model.named_parameters()}
    layout, pos = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), nbytes, pos])
        pos += -(-nbytes // ALIGN) * ALIGN
    params, copies = [], []
    for mname, mod in model.named_modules():
        params += [[mname, pname, by_param[id(p)]] for pname, p in mod._parameters.items() if p is not None]
        if isinstance(mod, Linear):
            if mod._gemm is not None and mod._gemm[1] is None:
                copies.append([mname, "_gemm", None])  # the GEMM does not run this shape: nothing to make
            copies += [[mname, attr, index[f"{mname}.{attr}"]] for attr in _COPIES if f"{mname}.{attr}" in index]
    return {"identity": identity, "tensors": layout, "params": params, "copies": copies, "body_bytes": pos,
            "body_sha1": "0" * 40}


def _header_bytes(manifest: dict) -> tuple[bytes, int]:
    """(MAGIC, length, JSON), and where the body starts (the next ALIGN boundary)."""
    text = json.dumps(manifest).encode()
    head = MAGIC + len(text).to_bytes(8, "little") + text
    return head, -(-len(head) // ALIGN) * ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _write(path: Path, manifest: dict, tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Write the file (header, then each tensor at its offset, zero-padded) under a temporary name
    and rename it; False where it cannot be written. Fills in manifest["body_sha1"]."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    _, body = _header_bytes(manifest)  # the digest's placeholder has its length: the body does not move
    digest = hashlib.sha1()
    try:
        with open(tmp, "wb") as f:
            for (_, t), (_, _, _, nbytes, off) in zip(tensors, manifest["tensors"]):
                data = memoryview(_bytes(t).numpy())
                f.seek(body + off)
                f.write(data)
                digest.update(data)
                digest.update(bytes(-(-nbytes // ALIGN) * ALIGN - nbytes))  # the padding, as read back
            manifest["body_sha1"] = digest.hexdigest()
            head, start = _header_bytes(manifest)
            assert start == body
            f.seek(0)
            f.write(head)
            f.truncate(body + manifest["body_bytes"])
        os.replace(tmp, path)  # readers see the whole file or none
        return True
    except OSError as e:
        log.warning("shared weights: cannot write %s (%s); this rank keeps its own copy", path, e)
        tmp.unlink(missing_ok=True)
        return False


def _read_header(fd: int, size: int) -> tuple[dict, int] | None:
    """(manifest, body offset) of an open file of `size` bytes; None where it is not one of ours
    of that size."""
    head = os.pread(fd, 16, 0)
    if len(head) < 16 or head[:8] != MAGIC:
        return None
    n = int.from_bytes(head[8:16], "little")
    if 16 + n > size:
        return None
    try:
        manifest = json.loads(os.pread(fd, n, 16))
    except ValueError:
        return None
    body = -(-(16 + n) // ALIGN) * ALIGN
    if body + manifest.get("body_bytes", -1) != size:
        return None
    return manifest, body


def _map(fd: int, size: int) -> mmap.mmap | ctypes.Array:
    # 2 MB-aligned and collapsed to huge pages where the kernel does it (engine/hugepages.py)
    mm = hugepages.map_readonly(fd, size)
    if mm is None:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    return mm


def _views(base: torch.Tensor, body: int, manifest: dict) -> list[torch.Tensor]:
    out = []
    for _, dtype, shape, nbytes, off in manifest["tensors"]:
        out.append(base[body + off:body + off + nbytes].view(getattr(torch, dtype)).view(shape))
    return out


def _apply(model: nn.Module, manifest: dict, views: list[torch.Tensor]) -> str | None:
    """Make `model`'s parameters and kernel copies the views, as the manifest pairs them; None, or
    why not (the model's parameters are then left as they were)."""
    from engine.layers.linear import Linear

    mods = dict(model.named_modules())
    have = {(m, p): t for m, mod in mods.items() for p, t in mod._parameters.items() if t is not None}
    if set(have) != {(m, p) for m, p, _ in manifest["params"]}:
        return "another set of parameters"
    for m, p, i in manifest["params"]:
        if tuple(have[m, p].shape) != tuple(views[i].shape) or have[m, p].dtype != views[i].dtype:
            return f"another shape or dtype of {m}.{p}"
    if any(not isinstance(mods.get(m), Linear) or attr not in _COPIES for m, attr, _ in manifest["copies"]):
        return "kernel copies of other modules"
    made: dict[int, nn.Parameter] = {}  # one Parameter per tensor: a tied one, held by two modules, stays one
    for m, p, i in manifest["params"]:
        if i not in made:
            made[i] = nn.Parameter(views[i], requires_grad=False)
        mods[m]._parameters[p] = made[i]
    for m, attr, i in manifest["copies"]:  # after the parameters: the copies are keyed by their weight
        mod, v = mods[m], None if i is None else views[i]
        if attr == "_packed":
            mod._packed = (mod.packed_key(), v)
        elif attr == "_gemm":
            mod._gemm = (mod.gemm_key(), v)
        else:
            mod._quant = (Linear.packed_key(mod), v)
    return None


def share_weights(model: nn.Module, directory: str | Path, identity: str,
                  load: Callable[[], None] | None = None) -> SharedWeights | None:
    """Make the CPU model's weights and kernel copies read-only views of the host's shared copy in
    `directory`, the file of `identity` (weights_identity's; the same identity must give the same
    tensors). `load` materialises the model (its weights and packed copies); it is called, once,
    unless the model's tensors come from a file written before: by the first rank that gets here
    (which writes the file), or where no file can be used (the model then keeps its own
    tensors). Without `load` the model is already loaded. Returns None where no file is used."""
    key = hashlib.blake2b(identity.encode(), digest_size=12).hexdigest()
    path = Path(directory) / f"{PREFIX}{key}.bin"
    loaded = load is None
    try:
        settings.private_dir(Path(directory), create=False)  # another user's, or one others may write to: refused
        # One writer: ranks that start together would otherwise each load, pack and write; they
        # wait here for the first one instead and map what it wrote.
        lock = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    except (OSError, RuntimeError) as e:
        log.warning("shared weights: cannot use %s (%s); this rank keeps its own copy", path, e)
        lock = None
    got = None
    if lock is not None:
        found = False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = path.exists()  # whole: written under a temporary name, then renamed
            if not found:
                if not loaded:
                    load()
                    loaded = True
                got = _create(path, identity, model)
        except OSError as e:
            log.warning("shared weights: cannot use %s (%s); this rank keeps its own copy", path, e)
        finally:
            os.close(lock)  # releases the lock
        try:
            # Readers check and map the file after the lock: in turn, the last of 3 waited for the
            # others' digests (0.4-0.9 s each with 4 ranks on 2 cores).
            if found:
                got = _open(path, model, created=False, identity=identity)
        except OSError as e:
            log.warning("shared weights: cannot use %s (%s); this rank keeps its own copy", path, e)
    if got is None and not loaded:
        load()
    return got


def _create(path: Path, identity: str, model: nn.Module) -> SharedWeights | None:
    """Write the loaded model's tensors into a new file at `path` and swap them for views of it."""
    tensors = _tensors(model)
    if not tensors or any(t.device.type != "cpu" for _, t in tensors):
        return None
    manifest = _manifest(identity, model, tensors)
    if not _write(path, manifest, tensors):
        return None
    del tensors
    return _open(path, model, created=True, written=manifest)


def _open(path: Path, model: nn.Module, created: bool, identity: str = "",
          written: dict | None = None) -> SharedWeights | None:
    """Map the file at `path` and make the model's tensors views of it: the file this process
    just wrote (`created`, its manifest `written`), or another rank's, used where it holds what
    `identity` names, whole (its digest checked) and in the model's layout."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        read = _read_header(fd, st.st_size)
        if read is None or (written is not None and read[0] != written):
            log.warning("shared weights: %s is not a whole weights file of this layout (%d bytes); keeping this "
                        "rank's copy", path, st.st_size)
            return None
        manifest, body = read
        if not created and manifest["identity"] != identity:
            log.warning("shared weights: %s holds other weights; keeping this rank's copy", path)
            return None
        mm = _map(fd, st.st_size)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # a non-writable buffer is the point: writes fault
        warnings.simplefilter("ignore", UserWarning)
        base = torch.frombuffer(mm, dtype=torch.uint8)
    why = None
    # The writer wrote these bytes from its tensors; a reader checks them (SHA-1 releases the GIL).
    if not created and hashlib.sha1(base[body:].numpy()).hexdigest() != manifest["body_sha1"]:
        why = "its tensor bytes do not match its digest"
    why = why or _apply(model, manifest, _views(base, body, manifest))
    if why is not None:
        log.warning("shared weights: %s not used (%s); keeping this rank's copy", path, why)
        del base
        try:
            if isinstance(mm, mmap.mmap):
                mm.close()  # (hugepages' mapping is unmapped when its last view goes)
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass
        return None
    hugepages.release_freed_memory()  # the heap pages of the private copies the views replaced
    log.info("shared weights: %s %s (%.0f MB)", "wrote and mapped" if created else "mapped", path, st.st_size / 2**20)
    return SharedWeights(path, st.st_size, created, base.data_ptr(), st.st_ino, mm)
