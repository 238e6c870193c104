"""KV memory: a paged pool for full-attention layers and a slot pool for sliding-window state.

Full-attention layers share one page pool, page-major so that one page is one
contiguous region holding `page_size` tokens of K and V for every full layer:

    full[num_pages, num_full_layers, 2, page_size, num_kv_heads, head_dim]

(one descriptor per page for a transfer engine; the host cache uses the same page
layout). Sliding-window layers keep only the last `window` tokens of each running
sequence in a ring, so their memory never grows with the context:

    swa[num_slots, num_swa_layers, 2, window, num_kv_heads, head_dim]

Token at absolute position p lives at ring index p % window. A slot plus the
number of tokens it has seen is the sequence's **SWA state** (see `SwaState`): it
is self-describing, so it can be exported, stored and imported elsewhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine import hugepages
from engine.config import ModelConfig


@dataclass
class SwaState:
    """One sequence's sliding-window state, detached from any pool.

    ring: [num_swa_layers, 2, window, num_kv_heads, head_dim]; ring index r holds
    the largest position p < num_tokens with p % window == r (if p >= 0).
    """

    num_tokens: int
    ring: torch.Tensor


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler waits or preempts."""


class KVPool:
    """Owns the KV tensors and their free lists. Not thread-safe: one engine loop owns it."""

    def __init__(self, model: ModelConfig, page_size: int, num_pages: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.full_layers = model.full_layers
        self.swa_layers = model.swa_layers
        self.window = model.sliding_window or 0
        kvh, hd = model.num_kv_heads, model.head_dim
        # On the CPU in huge pages where the kernel gives them (engine/hugepages.py): a decode step
        # reads its sequences' pages scattered over the pool. Not faulted in at load: a page's
        # first write does it, so only pages ever used cost anything. Faulting in the whole 1 GB
        # default pool took 2.7-6.3 s of each rank's start-up on this 2-core VM, whose memory
        # the host backs on first touch (~4 ms a MB; memory a process freed recently: ~0.2 ms),
        # 4 GB for a 2P2D start; a 542-token prompt's first write to 12 MB of fresh pages costs
        # at most ~50 ms once, and freed pages are handed out again first.
        zeros = (functools.partial(hugepages.zeros, prefault=False) if torch.device(device).type == "cpu"
                 else functools.partial(torch.zeros, device=device))
        self.full = zeros((num_pages, len(self.full_layers), 2, page_size, kvh, hd), dtype=dtype)
        self.num_slots = num_slots if self.swa_layers else 0
        self.swa = zeros((self.num_slots, len(self.swa_layers), 2, self.window, kvh, hd), dtype=dtype)
        # Index of a model layer inside `full` or `swa` (dim 1).
        self.layer_index = {l: i for i, l in enumerate(self.full_layers)}
        self.layer_index.update({l: i for i, l in enumerate(self.swa_layers)})
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_page(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return len(model.full_layers) * 2 * page_size * model.num_kv_heads * model.head_dim * elem

    @staticmethod
    def bytes_per_slot(model: ModelConfig, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        w = model.sliding_window or 0
        return len(model.swa_layers) * 2 * w * model.num_kv_heads * model.head_dim * elem

    # ---- pages -------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; raises OutOfPages (taking none) when fewer are free."""
        if n > len(self._free_pages):
            raise OutOfPages(f"need {n} pages, {len(self._free_pages)} free")
        return [self._free_pages.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free_pages.extend(reversed(pages))

    # ---- sliding-window slots ---------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int | None:
        """A zeroed-position slot, or None for models without sliding layers."""
        if not self.swa_layers:
            return None
        if not self._free_slots:
            raise OutOfPages("no free sliding-window slot")
        return self._free_slots.pop()

    def free_slot(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.append(slot)

    def export_swa(self, slot: int, num_tokens: int) -> SwaState:
        return SwaState(num_tokens, self.swa[slot].clone())

    def import_swa(self, slot: int, state: SwaState) -> None:
        self.swa[slot].copy_(state.ring)

    # ---- full-attention pages ---------------------------------------------
    def export_pages(self, pages: list[int]) -> torch.Tensor:
        """[len(pages), num_full_layers, 2, page_size, kvh, hd] copy of those pages."""
        return self.full[torch.tensor(pages, dtype=torch.long, device=self.full.device)].clone()

    def import_pages(self, pages: list[int], data: torch.Tensor) -> None:
        self.full[torch.tensor(pages, dtype=torch.long, device=self.full.device)] = data.to(self.full.dtype)
