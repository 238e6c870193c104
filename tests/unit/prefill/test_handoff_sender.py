"""The prefill rank's handoff pool (prefill/handoff_sender.py): reserve, stage, lease, release once."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hicache.pool import HostPool, HostPoolLayout
from prefill.handoff_sender import HandoffSender
from tests.fakes import FakeBackend, FakeClock, FakeWorld

PAGE_SHAPE = (2, 2, 4, 1, 8)  # [full layers, k/v, page_size 4, kv heads, head_dim]
STATE_SHAPE = (1, 2, 6, 1, 8)  # [swa layers, k/v, window 6, kv heads, head_dim]


@pytest.fixture
def sender():
    import secrets

    layout = HostPoolLayout(f"pdserve-test-handoff-{secrets.token_hex(4)}", "float32", 8, PAGE_SHAPE, 2, STATE_SHAPE)
    pool = HostPool.create(layout)
    s = HandoffSender(pool, page_size=4, lease_s=5.0, clock=FakeClock())
    yield s
    s.close()


class DevicePool:
    """The two KV tensors of a device pool and what was freed into it."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.full, self.swa = torch.randn(16, *PAGE_SHAPE, generator=g), torch.randn(3, *STATE_SHAPE, generator=g)
        self.freed_pages: list[int] = []
        self.freed_slots: list[int] = []

    def free(self, pages: list[int]) -> None:
        self.freed_pages += pages

    def free_slot(self, slot: int | None) -> None:
        if slot is not None:
            self.freed_slots.append(slot)


def test_take_copies_nothing_then_stage_copies_every_page_and_the_swa_state(sender):
    kv = DevicePool()
    assert sender.reserve("r", 10, needs_state=True)  # 3 pages of 4, the last holding 2 tokens
    seq = SimpleNamespace(request_id="r", prompt_ids=list(range(10)), pages=[7, 3, 12, 5], swa_slot=2)
    before = sender.pool.pages.clone()
    staged = sender.take(seq, kv)
    assert staged.num_tokens == 10 and len(staged.pages) == 3 and staged.state >= 0
    assert seq.pages == [] and seq.swa_slot is None  # the engine frees nothing when it finishes seq
    assert sender.pool.pages.equal(before) and sender.taken() == ["r"] and not kv.freed_pages
    sender.stage("r")
    assert sender.pool.pages[staged.pages].equal(kv.full[[7, 3, 12]])
    assert sender.pool.states[staged.state].equal(kv.swa[2])
    assert kv.freed_pages == [7, 3, 12, 5] and kv.freed_slots == [2] and not sender.taken()
    sender.stage("r")  # staged already: nothing copied or freed again
    assert sender.release("r", "pulled") and kv.freed_pages == [7, 3, 12, 5] and kv.freed_slots == [2]


def test_release_before_stage_gives_the_device_pages_back_once(sender):
    kv = DevicePool()
    assert sender.reserve("r", 5, needs_state=True)
    sender.take(SimpleNamespace(request_id="r", prompt_ids=[1] * 5, pages=[4, 9], swa_slot=1), kv)
    assert sender.release("r", "no decode peer") and not sender.release("r", "again")
    sender.stage("r")  # released: a no-op
    assert kv.freed_pages == [4, 9] and kv.freed_slots == [1] and not sender.taken()
    assert sender.pool.free_pages == 8 and sender.pool.free_states == 2


def test_reserve_takes_all_or_nothing(sender):
    assert sender.reserve("a", 20, needs_state=True)  # 5 of 8 pages
    assert not sender.reserve("b", 16, needs_state=True)  # 4 pages: short by one
    assert sender.pool.free_pages == 3 and sender.pool.free_states == 1 and "b" not in sender.entries
    assert sender.reserve("c", 12, needs_state=True)
    assert not sender.reserve("d", 1, needs_state=True)  # pages left, no state slot
    assert not sender.reserve("e", 1, needs_state=False)  # no page left either
    with pytest.raises(ValueError):
        sender.reserve("a", 1, needs_state=False)
    assert not sender.fits_ever(33) and sender.fits_ever(32)


def test_lease_and_exactly_once_release(sender):
    for rid in ("a", "b"):
        assert sender.reserve(rid, 8, needs_state=True)
    sender.hand_off("a", b"decode-0")
    sender.clock.advance(2.0)
    sender.hand_off("b", b"decode-1")
    assert sender.num_handed_off == 2 and sender.handed_to(b"decode-1") == ["b"]
    sender.clock.advance(3.0)
    assert sender.expired() == ["a"]  # its lease began 2 s earlier
    assert sender.release("a", "lease") and not sender.release("a", "pulled, late")
    assert sender.release("b", "pulled") and not sender.release("b", "pulled twice")
    assert sender.released == 2 and sender.pages_used == 0
    assert sender.pool.free_pages == 8 and sender.pool.free_states == 2


def test_renew_extends_only_the_renewing_peers_handed_off_leases(sender):
    for rid in ("a", "b", "c"):
        assert sender.reserve(rid, 4, needs_state=False)
    sender.hand_off("a", b"decode-0")
    sender.hand_off("b", b"decode-1")  # "c" is still prefilling: nothing to renew
    sender.clock.advance(4.0)
    assert sender.renew(["a", "b", "c", "gone"], b"decode-0") == 1  # b is decode-1's to renew
    sender.clock.advance(1.5)
    assert sender.expired() == ["b"]
    sender.clock.advance(3.4)
    assert sender.expired() == ["b"]
    sender.clock.advance(0.2)
    assert sorted(sender.expired()) == ["a", "b"]
    assert sender.release("a", "lease") and sender.renew(["a"], b"decode-0") == 0  # crossed a release


def test_register_names_both_regions():
    world = FakeWorld()
    layout = HostPoolLayout("pdserve-test-handoff-reg", "float32", 4, PAGE_SHAPE, 1, STATE_SHAPE)
    s = HandoffSender(HostPool.create(layout), 4, 1.0)
    try:
        s.register(FakeBackend("pre", world))
        assert set(world.regions) == {("pre", "kv_pages"), ("pre", "swa_states")}
    finally:
        s.close()


def test_released_pages_come_back_as_ascending_runs(sender):
    """A decode rank's pages come in ascending runs; the handoff pool's must too, so that a
    transfer merges a run into one descriptor."""
    for _ in range(3):
        assert sender.reserve("r", 20, needs_state=False)
        assert sender.entries["r"].pages == [0, 1, 2, 3, 4]
        sender.release("r", "pulled")
