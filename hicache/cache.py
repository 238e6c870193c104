"""HostCache: the host pool + prefix index behind one interface, with counters and events.

A request's life with the cache, as the engine drives it (engine/llm_engine.py):
  1. Admission (`admit`, the scheduler's on_admit hook): look up the prompt's
     longest stored prefix (at least one token left to compute; for hybrid models
     cut back to a boundary with a stored SWA state), allocate device pages for it,
     copy host -> device, restore the SWA ring into the sequence's slot, and mark
     those tokens computed. `seq.store_points` gets the positions where this
     prompt will be written through.
  2. Prefill runs on the suffix only. A chunk never crosses the next store point
     (Sequence.num_schedulable), so the SWA ring is as of that point when it ends.
  3. Write-through (`write_through`, after each step): at a store point, the
     prompt's complete pages not yet stored are copied device -> host, and (hybrid
     models) the SWA rings as of that page boundary go into a state slot.
  4. Eviction, on demand when a store needs room: least recently used unpinned
     chain tails first (with their states); states alone when only state slots are
     short. Pinned entries (a load, a store, an in-flight transfer, a write to L3) stay.
     A full cache stores fewer pages, never raises.
  5. L3 (`kv_store`, hicache/store.py), when set: every page and state stored in step 3 is
     also written to the store by a writer thread (the node stays pinned until written:
     single-node pins, which eviction's leaf check keeps safe). Before admission the engine
     has the pages past a prompt's host hit that the store holds read ahead (`prefetch`,
     hicache/prefetch.py: a thread of its own, a deadline) and `adopt`s them into host pages,
     so they load like host hits and no step waits on the store. The store is shared (the
     ranks of a host, the next start): what one rank computed is a hit on the others.

Store points (hybrid models): the SWA ring after prefill holds the last `window`
tokens as of the prompt's end, but a stored state must be as of a page boundary.
So the engine ends a prefill chunk at B = floor(L / page_size) * page_size (what the
next turn, which extends this prompt, can hit) and, when L is itself a boundary, also
at L - page_size (what a repeat of the same prompt can hit, since at least one token
must be recomputed). This costs at most one extra, shorter step per prefill (the
< page_size tail after B). Full-attention-only models store at the prompt's end.
Intermediate boundaries get no state (a shared system prompt hits only if some
request's prompt ended right after it); storing a state at every chunk end that is a
page boundary would fix that at the cost of state-slot churn.
"""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import asdict

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVPool
from engine.sequence import Sequence
from hicache.build import build_parts
from hicache.cache_types import CacheEvent, HostCacheStats, Hit
from hicache.index import Node, PrefixIndex, page_keys, salted_root
from hicache.l3 import PREFETCH_STAGING_BYTES, L3ReadAhead, write_through
from hicache.pool import HostPool
from hicache.prefetch import Prefetcher
from hicache.store import KVStore, StoreWriter
from native.page_copy import copy_pages

__all__ = ["CacheEvent", "HostCache", "HostCacheStats", "Hit"]


class HostCache(L3ReadAhead):
    """Host KV cache of one rank. Not thread-safe: the engine loop owns it. Its L3 read-ahead
    (prefetch, adopt, cancel: the engine's side of hicache/prefetch.py) is l3.L3ReadAhead."""

    def __init__(self, pool: HostPool, index: PrefixIndex, has_swa: bool, store: KVStore | None = None) -> None:
        self.pool = pool
        self.index = index
        self.page_size = index.page_size
        self.has_swa = has_swa
        self.counters = HostCacheStats()
        self.record_events = False  # set by whoever drains them (the rank's router link)
        self._events: list[CacheEvent] = []
        self.l3 = store  # the L3 tier, or None
        self.shared = getattr(index, "shared", False)  # a SharedIndex: the host's one cache (shared_index.py)
        self.writer = StoreWriter(store) if store is not None else None
        self.prefetcher = None
        if store is not None:
            lay = pool.layout
            self.prefetcher = Prefetcher(store, lay.page_shape, lay.state_shape, lay.torch_dtype,
                                         max_staging_bytes=min(PREFETCH_STAGING_BYTES, lay.num_pages * lay.page_bytes
                                                                     + lay.num_states * lay.state_bytes))

    @classmethod
    def for_engine(cls, cfg: EngineConfig, model_cfg: ModelConfig, max_model_len: int) -> "HostCache":
        """Size and create the cache for an engine: hicache_size_gb covers pages and states.

        Raises ValueError when the budget cannot hold the state slots plus one page.
        """
        pool, index, store = build_parts(cfg, model_cfg, max_model_len)
        return cls(pool, index, has_swa=bool(model_cfg.swa_layers), store=store)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self.writer is not None:
            self.writer.close()  # what is queued reaches the store first (the pool's memory is still mapped)
            self.writer = None
        if self.l3 is not None:
            self.l3.close()
        if self.shared:
            self.index.close()
        self.pool.close()

    # ---- lookup and load -------------------------------------------------------------
    def lookup(self, tokens: Seq[int], need_state: bool | None = None, salt: str = "") -> Hit:
        """Longest usable stored prefix of `tokens` in the host cache, pinned (see
        PrefixIndex.lookup; what an L3 store holds comes in through `prefetch` and `adopt`
        first). `need_state` (default: hybrid models) ends the hit at a stored SWA state; False
        for pages alone (a decode rank whose handoff brings the state). `salt`: the request's
        cache_salt (only pages stored under the same salt are a hit)."""
        need_state = self.has_swa if need_state is None else need_state
        root = salted_root(self.index.root, salt)
        self._unpin_written()
        path = self.index.lookup_and_pin(tokens, need_state, root)
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += len(tokens)
        if path:
            c.hits += 1
            c.hit_tokens += len(path) * self.page_size
        return Hit(path, self.page_size)

    def _unpin_written(self) -> None:
        if self.writer is not None:
            for node in self.writer.done():
                self.index.unpin([node])

    def release(self, hit: Hit) -> None:
        if not hit.released:
            hit.released = True
            self.index.unpin(hit.path)

    def load(self, hit: Hit, kv: KVPool, dev_pages: list[int], swa_slot: int | None) -> None:
        """Copy a hit's pages into `dev_pages` and its SWA state into `swa_slot` (None: pages
        only); releases the hit.

        Precondition: len(dev_pages) == len(hit.path).
        """
        try:
            self._copy(self.pool.pages, kv.full, [n.page for n in hit.path], dev_pages, h2d=True)
            if hit.state is not None and swa_slot is not None:
                self._copy(self.pool.states, kv.swa, [hit.state], [swa_slot], h2d=True)
            self.index.touch(hit.path)
        finally:
            self.release(hit)

    # ---- store -----------------------------------------------------------------------
    def store(self, tokens: Seq[int], kv: KVPool, dev_pages: list[int], swa_slot: int | None, salt: str = "") -> int:
        """Write through the complete pages of `tokens` (device pages `dev_pages`) not yet stored.

        With `swa_slot` and len(tokens) on a page boundary, also stores that slot's
        rings as the state at len(tokens) (precondition: they are as of that position).
        Returns the number of pages added; fewer than missing when the cache is full
        of pinned pages.
        """
        n = len(tokens) // self.page_size
        keys = page_keys(tokens, self.page_size, salted_root(self.index.root, salt), n)
        path = self.index.match_and_pin(keys)
        added: list[Node] = []  # pages this call stored
        held: list[Node] = []  # (shared index) pages another rank stored meanwhile
        try:
            missing = keys[len(path):]
            pages = self._alloc_pages(len(missing))
            self.counters.store_skipped_pages += len(missing) - len(pages)
            first = len(path)
            # Bytes first, then the index: a page is visible only once written (shared_index.py).
            self._copy(kv.full, self.pool.pages, dev_pages[first:first + len(pages)], pages, h2d=False)
            parent = path[-1] if path else None
            for key, page in zip(missing, pages):
                parent = self.index.insert(parent, key, page)
                self.index.pin([parent])
                if parent.page == page:
                    added.append(parent)
                else:
                    self._free_page(page)
                    held.append(parent)
            full = path + [*added, *held]
            full.sort(key=lambda node: node.depth)
            stored_state = False
            if (swa_slot is not None and n and len(full) == n and len(tokens) == n * self.page_size
                    and full[-1].state is None):
                slot = self._alloc_state()
                if slot is not None:
                    self._copy(kv.swa, self.pool.states, [swa_slot], [slot], h2d=False)
                    stored_state = self.index.set_state(full[-1], slot)
            self.index.touch(full)
            if self.writer is not None:
                self._unpin_written()
                write_through(self, added, full[-1] if stored_state else None)
        finally:
            self.index.unpin(path + added + held)
        c = self.counters
        c.stored_pages += len(added)
        c.stored_states += stored_state
        c.stores += bool(added) or stored_state
        if added:
            self._event("page_stored", [a.key for a in added])
        if stored_state:
            self._event("state_stored", [full[-1].key])
        return len(added)

    def _alloc_pages(self, n: int) -> list[int]:
        """Up to `n` host pages to write (fewer when everything else is pinned), evicting LRU chain tails."""
        if not self.shared:
            out = []
            while len(out) < n and (page := self._alloc_page()) is not None:
                out.append(page)
            return out
        pages, evicted = self.index.alloc_pages(n)
        for key, had_state in evicted:
            self.counters.evicted_pages += 1
            self._event("page_evicted", [key])
            if had_state:
                self.counters.evicted_states += 1
                self._event("state_evicted", [key])
        return pages

    def _free_page(self, page: int) -> None:
        """Give back a page from _alloc_pages that was not inserted."""
        if self.shared:
            self.index.free_page(page)
        else:
            self.pool.free_page(page)

    def _free_state(self, slot: int) -> None:
        if self.shared:
            self.index.free_state(slot)
        else:
            self.pool.free_state(slot)

    def _alloc_page(self) -> int | None:
        if self.shared:
            got = self._alloc_pages(1)
            return got[0] if got else None
        page = self.pool.alloc_page()
        while page is None:
            node = self.index.evict_page()
            if node is None:
                return None
            self.pool.free_page(node.page)
            self.counters.evicted_pages += 1
            self._event("page_evicted", [node.key])
            if node.state is not None:
                self.pool.free_state(node.state)
                self.counters.evicted_states += 1
                self._event("state_evicted", [node.key])
            page = self.pool.alloc_page()
        return page

    def _alloc_state(self) -> int | None:
        if self.shared:
            slot, lost = self.index.alloc_state()
            if lost is not None:
                self.counters.evicted_states += 1
                self._event("state_evicted", [lost])
            return slot
        slot = self.pool.alloc_state()
        if slot is None:
            got = self.index.evict_state()
            if got is None:
                return None
            node, slot = got
            self.counters.evicted_states += 1
            self._event("state_evicted", [node.key])
        return slot

    # ---- engine hooks ------------------------------------------------------------------
    def admit(self, seq: Sequence, kv: KVPool) -> bool:
        """The scheduler's on_admit for a fresh (or preempted) sequence; see the module steps 1-2.

        Sets seq.pages, num_computed, num_cached_prompt and store_points. Returns
        False (taking nothing) when the device pool cannot hold the hit's pages yet.
        """
        seq.store_points = []
        seq.num_cached_prompt = 0
        if not seq.params.prefix_cache:
            return True
        # A request that wants its prompt's logprobs computes every position (a hit has no
        # logits); its pages are still stored.
        hit = self.lookup(seq.token_ids, salt=seq.params.cache_salt) if seq.prompt_lp is None else None
        if hit is not None and hit.path:
            if len(hit.path) > kv.free_pages:
                self.release(hit)
                return False
            seq.pages = kv.allocate(len(hit.path))
            self.load(hit, kv, seq.pages, seq.swa_slot)
            seq.num_computed = hit.num_tokens
            seq.num_cached_prompt = min(hit.num_tokens, len(seq.prompt_ids))
        seq.store_points = self._store_points(len(seq.prompt_ids), seq.num_computed)
        return True

    def _store_points(self, prompt_len: int, computed: int) -> list[int]:
        ps = self.page_size
        if not self.has_swa:
            return [prompt_len] if prompt_len // ps * ps > computed else []
        points = {(prompt_len - 1) // ps * ps, prompt_len // ps * ps}
        return sorted(p for p in points if p > computed)

    def write_through(self, scheduled: list[tuple[Sequence, int]], kv: KVPool) -> None:
        """After a step: store each sequence's prompt at the store points the step reached."""
        for seq, _ in scheduled:
            while seq.store_points and seq.store_points[0] <= seq.num_computed:
                point = seq.store_points.pop(0)
                slot = None
                if self.has_swa:
                    # Sequence.num_schedulable ended the chunk here, so the ring is as of `point`.
                    assert point == seq.num_computed, (point, seq.num_computed)
                    slot = seq.swa_slot
                self.store(seq.prompt_ids[:point], kv, seq.pages, slot, seq.params.cache_salt)

    # ---- counters and events -------------------------------------------------------------
    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_idx: list[int], dst_idx: list[int],
              h2d: bool) -> None:
        if not src_idx or src[0].numel() == 0:
            return
        t0 = time.perf_counter()
        copy_pages(src, dst, src_idx, dst_idx)
        for t in (src, dst):  # NOTE: synchronous for now; the pins allow an async version
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
                break
        dt = time.perf_counter() - t0
        nbytes = len(src_idx) * src[0].numel() * src.element_size()
        c = self.counters
        if h2d:
            c.bytes_h2d += nbytes
            c.seconds_h2d += dt
        else:
            c.bytes_d2h += nbytes
            c.seconds_d2h += dt

    def _event(self, kind: str, keys: list[bytes]) -> None:
        if self.record_events:
            self._events.append(CacheEvent(kind, tuple(keys)))

    def drain_events(self) -> list[CacheEvent]:
        """Events since the last drain (recorded only while `record_events` is set)."""
        out, self._events = self._events, []
        return out

    def stats(self) -> dict:
        c = self.counters
        w = self.writer
        pf = self.prefetcher
        out = asdict(c)
        if pf is not None:
            out["bytes_l3_read"] += pf.read_bytes
            out["seconds_l3_read"] += pf.read_seconds
            out["l3_read_failures"] += pf.failures
        return {**out,
                "l3": self.l3.kind if self.l3 is not None else None,
                "bytes_l3_written": w.written_bytes if w else 0, "l3_write_errors": w.errors if w else 0,
                "seconds_l3_written": w.write_seconds if w else 0.0,
                "hit_rate": c.hits / c.lookups if c.lookups else 0.0,
                "token_hit_rate": c.hit_tokens / c.lookup_tokens if c.lookup_tokens else 0.0,
                "pages_used": len(self.index), "pages_total": self.pool.num_pages,
                "states_used": self.index.num_states, "states_total": self.pool.num_states}
