"""PrefixIndex invariants: hash chains, lookup cap, state snapping, LRU order, pins, namespaces."""
from __future__ import annotations

import pytest

from hicache.index import PrefixIndex, namespace_key, page_keys

PS = 4
ROOT = namespace_key("model-a", "float32", PS)


def check_invariants(index: PrefixIndex) -> None:
    """Chains without holes, correct child counts, parents after descendants in LRU order."""
    nodes = index.nodes()
    pos = {n.key: i for i, n in enumerate(nodes)}
    children = {n.key: 0 for n in nodes}
    for n in nodes:
        if n.parent is not None:
            assert n.parent.key in pos, "stored node with an evicted parent"
            assert pos[n.parent.key] > pos[n.key], "parent older than its child"
            assert n.depth == n.parent.depth + 1
            children[n.parent.key] += 1
            if n.refs:
                assert n.parent.refs, "pinned node under an unpinned parent"
        else:
            assert n.depth == 1
    assert all(n.children == children[n.key] for n in nodes)


def store(index: PrefixIndex, tokens: list[int], pages: iter) -> list:
    """Insert every full page of `tokens` like HostCache.store does (existing prefix reused)."""
    keys = page_keys(tokens, PS, index.root)
    path = index.match_keys(keys)
    parent = path[-1] if path else None
    for key in keys[len(path):]:
        parent = index.insert(parent, key, next(pages))
        path.append(parent)
    index.touch(path)
    check_invariants(index)
    return path


def test_keys_chain_and_depend_on_every_token_and_namespace():
    a = list(range(3, 3 + 4 * PS))
    keys = page_keys(a, PS, ROOT)
    assert len(keys) == 4 and len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    assert page_keys(a[:2 * PS + 1], PS, ROOT) == keys[:2]  # a prefix has the prefix's keys
    b = list(a)
    b[PS + 1] += 1  # change a token in page 1: pages 1.. change, page 0 does not
    kb = page_keys(b, PS, ROOT)
    assert kb[0] == keys[0] and not set(kb[1:]) & set(keys)
    for other in (namespace_key("model-b", "float32", PS), namespace_key("model-a", "bfloat16", PS),
                  namespace_key("model-a", "float32", 2 * PS)):
        assert not set(page_keys(a, PS, other)) & set(keys)


def test_namespace_separation_in_lookup():
    ours, theirs = PrefixIndex(ROOT, PS), PrefixIndex(namespace_key("model-b", "float32", PS), PS)
    tokens = list(range(10, 10 + 3 * PS + 1))
    store(ours, tokens, iter(range(100)))
    assert len(ours.lookup(tokens, need_state=False)) == 3
    assert theirs.match_keys(page_keys(tokens, PS, ours.root)) == []  # foreign keys
    assert ours.match(tokens, 3) and not theirs.lookup(tokens, need_state=False)


def test_lookup_leaves_at_least_one_token():
    index = PrefixIndex(ROOT, PS)
    tokens = list(range(5, 5 + 3 * PS))
    store(index, tokens, iter(range(100)))
    assert len(index.lookup(tokens, need_state=False)) == 2  # exactly 3 pages: the last is recomputed
    assert len(index.lookup(tokens + [1], need_state=False)) == 3
    assert len(index.lookup(tokens[:PS], need_state=False)) == 0
    assert index.lookup([], need_state=False) == []
    diverged = tokens[:PS + 1] + [0] * (2 * PS)  # differs inside page 1
    assert len(index.lookup(diverged, need_state=False)) == 1


def test_state_snapping_goes_down_to_a_stored_state():
    index = PrefixIndex(ROOT, PS)
    tokens = list(range(7, 7 + 6 * PS))
    path = store(index, tokens, iter(range(100)))
    assert index.lookup(tokens + [1], need_state=True) == []  # no state anywhere
    index.set_state(path[1], 0)  # state as of 2 pages
    index.set_state(path[3], 1)  # as of 4 pages
    assert len(index.lookup(tokens + [1], need_state=True)) == 4
    assert len(index.lookup(tokens[:4 * PS], need_state=True)) == 2  # cap (3 pages) snaps to 2
    assert len(index.lookup(tokens[:3 * PS + 2], need_state=True)) == 2
    assert len(index.lookup(tokens + [1], need_state=False)) == 6
    with pytest.raises(RuntimeError):
        index.set_state(path[1], 5)


def test_lru_evicts_chain_tails_first_and_touch_reorders():
    index = PrefixIndex(ROOT, PS)
    shared = list(range(20, 20 + 2 * PS))
    a = store(index, shared + [1] * (2 * PS), iter(range(0, 10)))
    b = store(index, shared + [2] * (2 * PS), iter(range(10, 20)))
    assert a[:2] == b[:2] and len(index) == 6
    order = []
    while (node := index.evict_page()) is not None:
        order.append(node)
        check_invariants(index)
    # a is older: its tail goes first (leaf, then its parent), then b's tail, then the shared pages.
    assert order == [a[3], a[2], b[3], b[2], b[1], b[0]]

    index = PrefixIndex(ROOT, PS)
    a = store(index, shared + [1] * (2 * PS), iter(range(0, 10)))
    b = store(index, shared + [2] * (2 * PS), iter(range(10, 20)))
    index.touch(a)  # a hit on a: now b is the older chain
    check_invariants(index)
    assert [index.evict_page() for _ in range(2)] == [b[3], b[2]]


def test_pins_are_respected_and_states_go_with_their_page():
    index = PrefixIndex(ROOT, PS)
    a = store(index, [1] * (3 * PS), iter(range(0, 10)))
    b = store(index, [2] * (3 * PS), iter(range(10, 20)))
    index.set_state(a[2], 0)
    index.set_state(b[1], 1)
    index.pin(a)  # a load of chain a is in progress
    check_invariants(index)
    evicted = []
    while (node := index.evict_page()) is not None:
        evicted.append(node)
    assert evicted == [b[2], b[1], b[0]] and b[1].state == 1  # the caller frees the state slot
    assert index.num_states == 1 and len(index) == 3
    assert index.evict_state() is None  # a's state is pinned with its page
    index.unpin(a)
    assert index.evict_state() == (a[2], 0) and a[2].state is None
    with pytest.raises(RuntimeError):
        index.unpin(a)
    while index.evict_page() is not None:
        pass
    assert len(index) == 0 and index.num_states == 0


def test_state_lru_follows_use():
    index = PrefixIndex(ROOT, PS)
    chains = [store(index, [t] * (2 * PS), iter(range(10 * t, 10 * t + 10))) for t in (1, 2, 3)]
    for i, c in enumerate(chains):
        index.set_state(c[-1], i)
    index.touch(chains[0])  # chain 0's state was used last
    assert index.evict_state() == (chains[1][-1], 1)
    assert index.evict_state() == (chains[2][-1], 2)
    assert index.evict_state() == (chains[0][-1], 0)


def test_insert_rejects_a_duplicate_key():
    index = PrefixIndex(ROOT, PS)
    path = store(index, [3] * PS, iter(range(10)))
    with pytest.raises(KeyError):
        index.insert(None, path[0].key, 5)
