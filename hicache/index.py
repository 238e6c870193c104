"""The prefix index: a hash chain of stored pages, their pins, and LRU eviction.

A page's key is `blake2b(parent key || its page_size token ids as little-endian
uint32, 16 bytes)`; the first page's parent is the namespace key (model, dtype,
page size), so caches of different models or layouts never share a key. Equal keys
mean equal token prefixes, so equal KV (up to hash collisions, 2^-128 a pair).

Invariants (tests/unit/hicache/test_hicache_index.py checks them):
  - every stored node's parent is stored (chains have no holes);
  - a pinned node's ancestors are pinned (callers pin whole paths from the root);
  - LRU order keeps every parent after all of its descendants, because a path is
    touched leaf first. So the oldest unpinned node is always a leaf: eviction takes
    chain tails first, and the SWA state hanging off an evicted node goes with it.
The index is bookkeeping only: host page and state ids come from the caller.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16


def namespace_key(model: str, dtype: str, page_size: int) -> bytes:
    """The root parent key: one namespace per model, dtype and page size."""
    return hashlib.blake2b(f"pdserve-kv|{model}|{dtype}|{page_size}".encode(), digest_size=KEY_BYTES).digest()


def salted_root(root: bytes, salt: str) -> bytes:
    """The root of a request's key chain: `root` itself without a salt, else one of the salt's own
    (a request's cache_salt: its pages are never a hit for another salt's, nor for no salt)."""
    if not salt:
        return root
    return hashlib.blake2b(root + b"|salt|" + salt.encode(), digest_size=KEY_BYTES).digest()


def page_keys(tokens: Sequence[int], page_size: int, root: bytes, num_pages: int | None = None) -> list[bytes]:
    """Chain keys of the first `num_pages` full pages of `tokens` (default: all full pages).

    Pure function of its arguments, so a router can compute the keys a rank reports.
    """
    n = len(tokens) // page_size if num_pages is None else num_pages
    return list(_iter_keys(tokens, page_size, root, n))


_BLOCK_PAGES = 64  # tokens are converted to bytes this many pages at a time, so a miss stays cheap


def _iter_keys(tokens: Sequence[int], page_size: int, root: bytes, num_pages: int):
    step = 4 * page_size
    key = root
    for first in range(0, num_pages, _BLOCK_PAGES):
        last = min(first + _BLOCK_PAGES, num_pages)
        buf = memoryview(np.asarray(tokens[first * page_size:last * page_size], dtype="<u4").tobytes())
        for i in range(last - first):
            h = hashlib.blake2b(key, digest_size=KEY_BYTES)
            h.update(buf[i * step:(i + 1) * step])
            key = h.digest()
            yield key


@dataclass(eq=False, slots=True)
class Node:
    """One stored page: tokens [(depth-1)*page_size, depth*page_size) of its chain."""

    key: bytes
    parent: "Node | None"
    depth: int  # pages from the root, this one included
    page: int  # host page id
    children: int = 0
    refs: int = 0  # pins: loads, stores, in-flight transfers
    state: int | None = None  # host state slot: the SWA rings as of position depth * page_size


class PrefixIndex:
    """Page chains keyed by token-prefix hashes. Not thread-safe: one engine loop owns it."""

    def __init__(self, root: bytes, page_size: int) -> None:
        self.root = root
        self.page_size = page_size
        self._nodes: OrderedDict[bytes, Node] = OrderedDict()  # LRU order, oldest first
        self._states: OrderedDict[bytes, Node] = OrderedDict()  # nodes holding a state, LRU order

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def num_states(self) -> int:
        return len(self._states)

    def get(self, key: bytes) -> Node | None:
        return self._nodes.get(key)

    def nodes(self) -> list[Node]:
        """All nodes, least recently used first."""
        return list(self._nodes.values())

    # ---- lookup --------------------------------------------------------------------
    def match(self, tokens: Sequence[int], num_pages: int, root: bytes | None = None) -> list[Node]:
        """The stored path for the longest prefix of the first `num_pages` pages of `tokens`
        (keys under `root`, default the index's: a salted root, salted_root)."""
        return self.match_keys(_iter_keys(tokens, self.page_size, root or self.root, num_pages))

    def match_keys(self, keys) -> list[Node]:
        """The stored path for the longest prefix of a root-first key chain (hashing stops at a miss)."""
        path: list[Node] = []
        for key in keys:
            node = self._nodes.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def lookup(self, tokens: Sequence[int], need_state: bool, root: bytes | None = None) -> list[Node]:
        """Longest reusable stored path for a prompt; does not pin or touch.

        Capped at (len(tokens) - 1) // page_size pages so at least one token is left
        to compute (its logits are sampled). With `need_state` (hybrid models) the
        path is cut back to its deepest node that holds an SWA state (maybe empty).
        """
        path = self.match(tokens, max(len(tokens) - 1, 0) // self.page_size, root)
        if need_state:
            while path and path[-1].state is None:
                path.pop()
        return path

    def match_and_pin(self, keys) -> list[Node]:
        """match_keys, pinned (one call, so a shared index can do it atomically)."""
        path = self.match_keys(keys)
        self.pin(path)
        return path

    def lookup_and_pin(self, tokens: Sequence[int], need_state: bool, root: bytes | None = None) -> list[Node]:
        path = self.lookup(tokens, need_state, root)
        self.pin(path)
        return path

    # ---- mutation --------------------------------------------------------------------
    def insert(self, parent: Node | None, key: bytes, page: int) -> Node:
        """Add a child page of `parent` (None: a first page). The new node is most recent."""
        if key in self._nodes:
            raise KeyError("page key already stored")
        node = Node(key, parent, parent.depth + 1 if parent else 1, page)
        if parent is not None:
            parent.children += 1
        self._nodes[key] = node
        return node

    def touch(self, path: list[Node]) -> None:
        """Mark a root-first path (and its deepest state) most recently used."""
        for node in reversed(path):  # leaf first: parents end up after descendants
            self._nodes.move_to_end(node.key)
        if path and path[-1].state is not None:
            self._states.move_to_end(path[-1].key)

    def pin(self, path: list[Node]) -> None:
        for node in path:
            node.refs += 1

    def unpin(self, path: list[Node]) -> None:
        for node in path:
            if node.refs <= 0:
                raise RuntimeError("unpin of an unpinned page")
            node.refs -= 1

    def set_state(self, node: Node, slot: int) -> bool:
        if node.state is not None:
            raise RuntimeError("node already holds a state")
        node.state = slot
        self._states[node.key] = node
        return True

    # ---- eviction ----------------------------------------------------------------------
    def evict_page(self) -> Node | None:
        """Remove the least recently used unpinned leaf; None when every node is pinned.

        The caller frees `node.page` and, if set, `node.state` (no longer indexed).
        NOTE: the leaf check does not rely on the LRU invariant; the invariant only
        keeps the scan short (it stops at the first unpinned node).
        """
        for node in self._nodes.values():
            if node.refs == 0 and node.children == 0:
                break
        else:
            return None
        del self._nodes[node.key]
        if node.parent is not None:
            node.parent.children -= 1
        if node.state is not None:
            del self._states[node.key]
        return node

    def evict_state(self) -> tuple[Node, int] | None:
        """Detach the least recently used state whose node is unpinned; returns (node, slot)."""
        for node in self._states.values():
            if node.refs == 0:
                break
        else:
            return None
        del self._states[node.key]
        slot, node.state = node.state, None
        return node, slot
