"""NIXL transfer backend: one NIXL agent per process, UCX underneath, one-sided READs.

How a read travels:
  1. `register` registers the region with the agent (one registration for the whole span)
     and prepares its local descriptor list once: a strided list, one descriptor per page.
  2. `add_peer` loads the peer's agent metadata, prepares one descriptor list per remote
     region (again strided, prepared once), opens the UCX connection and reads one page of
     each region into scratch memory, so the first real read pays for no set-up.
  3. `read` makes one transfer request from the two prepared lists and the page indices
     (NIXL merges runs of pages adjacent on both sides into one descriptor), posts it and
     waits for it: on the read thread, or inline when it is small.
  4. `poll` looks at that job's outcome; it never calls into NIXL.

On one host UCX picks CMA (`process_vm_readv`: the reader's kernel copies straight out of
the owner's memory, no staging) for DRAM, and TCP on loopback for its control messages;
across hosts whatever the fabric offers (RDMA, else TCP). UCX_TLS / UCX_NET_DEVICES narrow it.

NOTE: with CMA, posting a request IS the copy: `postXferReq` returns only when every byte
has moved (35 ms for 180 MB here). Hence the read thread: posting there keeps the caller's
loop running (the binding releases the GIL while it copies), and UCX's worker lock is held
for the whole copy.

NOTE: we drive NIXL through its pybind module (`_bindings`) instead of the `nixl_agent`
wrapper because the wrapper hard-codes the progress thread's delay to 0: that thread then
busy-polls and burns a whole core per process, forever (measured: 1.0-2.0 CPU s per idle
second with nixl 1.5.1). With a delay it sleeps in poll() on the UCX workers' event fds and
wakes for traffic; the delay only bounds a missed wake-up. The owner of the pages needs the
thread because it never calls into NIXL during a read, yet UCX's connection wire-up needs
its worker to answer; a reader progresses its own worker while it posts and polls.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import numpy as np
import torch

from kv_transfer.base import (
    METADATA_VERSION,
    NixlMetadata,
    Region,
    RegionDesc,
    TransferBackend,
    TransferHandle,
    decode_metadata,
    encode_metadata,
)

logger = logging.getLogger(__name__)

# nixl-cu12 / nixl-cu13 ship the bindings; the `nixl` meta package picks one by CUDA version.
_BINDING_MODULES = ("nixl._bindings", "nixl_cu12._bindings", "nixl_cu13._bindings")


def _skip_ucx_ib_without_rdma() -> None:
    """UCX_MODULES=^ib where this host has no RDMA device (and the user set no UCX_MODULES).

    NIXL's wheel bundles UCX with its own libibverbs and libnl. Where Debian's rdma-core
    (ibverbs-providers, which Mooncake's master needs) is installed, that libibverbs loads the
    system's verbs providers, which bring the system's libnl-route: two copies of it in one
    process, and the second's destructor segfaults at exit (every process that made a NIXL
    agent then exits 139). Without an RDMA device the IB transports have nothing to drive;
    with one, UCX loads them as before."""
    rdma = Path("/sys/class/infiniband")
    if "UCX_MODULES" not in os.environ and not (rdma.is_dir() and any(rdma.iterdir())):
        os.environ["UCX_MODULES"] = "^ib"


def load_nixl() -> ModuleType:
    """NIXL's pybind module; ImportError naming every module tried when none imports."""
    _skip_ucx_ib_without_rdma()
    errors = []
    for name in _BINDING_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # also raised by `nixl` when it finds CUDA N but not nixl-cuN
            errors.append(f"{name}: {e}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12): " + "; ".join(errors))


@dataclass
class _Peer:
    agent_name: str
    regions: dict[str, RegionDesc]
    dlists: dict[str, int]  # region name -> prepared remote descriptor list


@dataclass
class _Local:
    reg_dlist: object  # nixlRegDList, needed again to deregister
    dlist: int  # prepared local descriptor list


class NixlBackend(TransferBackend):
    """Transfers through one NIXL agent named `agent_name` (unique among all peers).

    `progress_thread`: whether NIXL runs its progress thread. A process that peers read from
    needs it (its UCX worker must answer connection wire-up while the process computes); a
    process that only reads must not have it: the thread wakes during a read and spins on the
    UCX worker lock that the read thread holds while the kernel copies, which burns a core
    and halved CMA throughput here. `progress_delay_us` bounds how long the thread sleeps when
    no event wakes it: each bound reached is a wake-up, so 2 ms made an idle prefill rank wake
    ~500 times a second and preempt whatever ran on its core (20 ms: a tenth of the wake-ups;
    the first read, which needs the owner's worker, still completed in 0.2-0.3 ms: an event
    woke it. docs/results/mission.md run 4 has the measurement).

    Reads up to `sync_bytes` run inline when the read thread is idle (see `TransferBackend`;
    inline while it copies would only wait for UCX's worker lock). A read still in progress
    after `read_timeout_s` is aborted and fails. `num_workers` > 1 gives UCX more
    workers. Raises ImportError without NIXL, RuntimeError when the UCX plugin is missing or
    the agent cannot start.
    """

    kind: ClassVar[str] = "nixl"

    def __init__(self, agent_name: str, *, progress_thread: bool = True, progress_delay_us: int = 20_000,
                 num_workers: int = 1, read_timeout_s: float = 30.0, sync_bytes: int = 4 << 20) -> None:
        super().__init__(sync_bytes=sync_bytes)
        nixl = load_nixl()
        self._nixl = nixl
        config = nixl.nixlAgentConfig(progress_thread)
        config.pthrDelay = progress_delay_us
        # RW: reads (on the read thread) share the agent; add/remove peer and register lock it
        config.syncMode = nixl.NIXL_THREAD_SYNC_RW
        try:
            agent = nixl.nixlAgent(agent_name, config)
            if "UCX" not in agent.getAvailPlugins():
                raise RuntimeError(f"NIXL has no UCX plugin (plugins: {agent.getAvailPlugins()})")
            self._ucx = agent.createBackend("UCX", {"num_workers": str(num_workers)})
        except Exception as e:
            raise RuntimeError(f"NIXL agent {agent_name!r} failed to start: {e}") from e
        self._agent = agent
        self.agent_name = agent_name
        self._timeout = read_timeout_s
        self._locals: dict[str, _Local] = {}
        self._peers: dict[str, _Peer] = {}

    # ---- local regions -----------------------------------------------------------------

    def _register(self, region: Region) -> None:
        nixl = self._nixl
        device = _device_id(region)
        mem = nixl.DRAM_SEG if device < 0 else nixl.VRAM_SEG
        dev_id = max(device, 0)
        reg = nixl.nixlRegDList(mem, [(region.addr, region.span_bytes, dev_id, "")])
        self._agent.registerMem(reg, [self._ucx])
        pages = _strided(region.addr, region.page_bytes, dev_id, region.stride_bytes, region.num_pages)
        dlist = self._agent.prepXferDlist(nixl.NIXL_INIT_AGENT, mem, pages, [self._ucx])
        self._locals[region.name] = _Local(reg, dlist)

    def metadata(self) -> bytes:
        regions = [RegionDesc(r.name, r.addr, r.page_bytes, r.stride_bytes, r.num_pages,
                              device=_device_id(r)) for r in self._regions.values()]
        return encode_metadata(NixlMetadata(METADATA_VERSION, self.agent_name,
                                            self._agent.getLocalMD(), regions))

    # ---- peers -------------------------------------------------------------------------

    def add_peer(self, peer_id: str, metadata: bytes) -> None:
        md = decode_metadata(metadata, NixlMetadata)
        if peer_id in self._peers:
            raise ValueError(f"peer {peer_id!r} is already added (remove_peer first)")
        names = {self.agent_name} | {p.agent_name for p in self._peers.values()}
        if md.agent_name in names:
            raise ValueError(f"NIXL agent name {md.agent_name!r} is already in use here: "
                             "agent names must be unique per process")
        nixl, agent = self._nixl, self._agent
        try:
            name = agent.loadRemoteMD(md.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
        except Exception as e:
            raise ValueError(f"peer {peer_id!r}: NIXL rejected its agent metadata: {e}") from e
        peer = _Peer(name, {r.name: r for r in md.regions}, {})
        self._peers[peer_id] = peer
        try:
            for r in md.regions:
                mem = nixl.DRAM_SEG if r.device < 0 else nixl.VRAM_SEG
                pages = _strided(r.addr, r.page_bytes, max(r.device, 0), r.stride_bytes, r.num_pages)
                peer.dlists[r.name] = agent.prepXferDlist(name, mem, pages, [self._ucx])
            agent.makeConnection(name, [self._ucx])
            self._warm_up(peer)
        except Exception as e:
            self.remove_peer(peer_id)
            raise RuntimeError(f"peer {peer_id!r} (agent {name!r}): NIXL could not connect: {e}") from e
        logger.info("nixl: added peer %s (agent %s, %d regions)", peer_id, name, len(md.regions))

    def _warm_up(self, peer: _Peer) -> None:
        """Read page 0 of each of the peer's regions into a scratch buffer: UCX sets up its
        protocols for a peer on the first read (7 ms here, then 2 ms per further region),
        better at the handshake than in a request's time to first token. Raises when the peer
        is unreachable."""
        nixl, agent = self._nixl, self._agent
        regions = list(peer.regions.values())
        if not regions:
            return
        scratch = torch.empty(max(r.page_bytes for r in regions), dtype=torch.uint8)
        reg = nixl.nixlRegDList(nixl.DRAM_SEG, [(scratch.data_ptr(), scratch.numel(), 0, "")])
        agent.registerMem(reg, [self._ucx])
        try:
            descs = np.array([[scratch.data_ptr(), r.page_bytes, 0] for r in regions], dtype=np.uint64)
            dlist = agent.prepXferDlist(nixl.NIXL_INIT_AGENT, nixl.nixlXferDList(nixl.DRAM_SEG, descs),
                                        [self._ucx])
            try:
                for i, r in enumerate(regions):
                    self._run_read(dlist, [i], peer.dlists[r.name], [0])
            finally:
                agent.releasedDlistH(dlist)
        finally:
            agent.deregisterMem(reg, [self._ucx])

    def _has_peer(self, peer_id: str) -> bool:
        return peer_id in self._peers

    def _drop_peer(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id)
        for dlist in peer.dlists.values():
            self._agent.releasedDlistH(dlist)
        try:
            self._agent.invalidateRemoteMD(peer.agent_name)
        except Exception as e:
            logger.debug("nixl: invalidateRemoteMD(%s): %s", peer.agent_name, e)

    def _remote_region(self, peer_id: str, name: str) -> RegionDesc:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise KeyError(f"unknown peer {peer_id!r}")
        region = peer.regions.get(name)
        if region is None:
            raise KeyError(f"peer {peer_id!r} has no region {name!r} (has {sorted(peer.regions)})")
        return region

    # ---- reads -------------------------------------------------------------------------

    def _prepare_read(self, handle: TransferHandle, remote: RegionDesc, src: list[int],
                      local: Region, dst: list[int]) -> Callable[[], None]:
        local_dlist = self._locals[local.name].dlist
        remote_dlist = self._peers[handle.peer_id].dlists[remote.name]
        # NOTE: lists go to makeXferReq as they are: as fast as int32 arrays there, and no numpy call
        return functools.partial(self._run_read, local_dlist, dst, remote_dlist, src)

    def _run_read(self, local_dlist: int, dst: list[int], remote_dlist: int, src: list[int]) -> None:
        nixl, agent = self._nixl, self._agent
        req = agent.makeXferReq(nixl.NIXL_READ, local_dlist, dst, remote_dlist, src, "", [self._ucx])
        try:
            status = agent.postXferReq(req)  # CMA copies right here (the GIL is released)
            deadline = time.monotonic() + self._timeout
            while status == nixl.NIXL_IN_PROG:  # RDMA: the NIC copies; wait for its completion
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL read still in progress after {self._timeout} s")
                time.sleep(20e-6)
                status = agent.getXferStatus(req)
            if status != nixl.NIXL_SUCCESS:
                raise RuntimeError(f"NIXL read failed: {status}")
        finally:  # NOTE: releasing an unfinished request aborts it; never release one twice
            agent.releaseXferReq(req)

    def _close(self) -> None:
        for peer_id in list(self._peers):
            self._drop_peer(peer_id)
        for loc in self._locals.values():
            self._agent.releasedDlistH(loc.dlist)
            self._agent.deregisterMem(loc.reg_dlist, [self._ucx])
        self._locals.clear()
        self._agent = None  # the agent's destructor stops its progress thread


def _device_id(region: Region) -> int:
    device = region.tensor.device
    return (device.index or 0) if device.type == "cuda" else -1


def _strided(addr: int, page_bytes: int, dev_id: int, stride: int, count: int) -> np.ndarray:
    """A one-row compressed descriptor list: `count` pages of `page_bytes`, `stride` apart."""
    return np.array([[addr, page_bytes, dev_id, stride, count]], dtype=np.uint64)
