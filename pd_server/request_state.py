"""What the dispatcher keeps per request: a Pending per sub-request it has sent, the Handle an
HTTP handler reads, its Inbox, and the Failure that ends a sub-request early (dispatcher.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.protocol.rank_router import TokenEvent
from cluster.protocol.router_rank import Generate
from pd_server.errors import APIError
from pd_server.ranks import Rank

if TYPE_CHECKING:
    from pd_server.dispatcher import Dispatcher


@dataclass(frozen=True)
class Failure:
    status: int
    message: str


class ClientGone(Exception):
    """The HTTP client went away (Handle.client_gone); nothing more can reach it."""


_GONE = object()  # the item client_gone() puts


class Inbox:
    """What the dispatcher puts for one HTTP request: (choice index, TokenEvent | Failure).

    An asyncio.Queue cut down to one reader that takes everything pending at once: a put only
    appends and, if the reader waits, completes its one future (no per-item futures or loop
    look-ups: this runs once per token per stream on the router's hot path).

    With an `eager` writer set (sse_response.SSEStream), the dispatcher holds() token events
    instead and flush()es every held inbox once per receive round: the writer gets all of
    them at once, and the reader is woken only if the writer declines them."""

    __slots__ = ("_items", "_waiter", "_held", "eager")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._held = False
        # Takes every pending item (the reader waits, so nothing else is pending) and returns True
        # once it has handled them itself, or False to leave them to the reader.
        self.eager: Callable[[list], bool] | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        self._wake()

    def hold(self, item) -> bool:
        """put_nowait without the wake-up, where an eager writer may take the item: True when
        the caller must flush() this inbox later (once, however many items it holds)."""
        self._items.append(item)
        if self._waiter is None or self._held:
            return False
        if self.eager is None:
            self._wake()
            return False
        self._held = True
        return True

    def flush(self) -> None:
        """Offer the held items to the eager writer; wake the reader if it declines them."""
        self._held = False
        if self._waiter is None or not self._items:
            return
        if self.eager is not None and self.eager(self._items):
            self._items = []
        else:
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not self._held:
            self._waiter = None
            if not w.done():  # a cancelled reader leaves a cancelled future
                w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self):
        """The oldest item; raises asyncio.QueueEmpty when none (as asyncio.Queue)."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.pop(0)

    async def take_all(self) -> list:
        """Every pending item, oldest first; waits while there is none."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


@dataclass
class Pending:
    """One sub-request the router has sent and not yet seen finish."""

    msg: Generate
    queue: Inbox  # its Handle's
    index: int  # choice index in the HTTP response
    rank: Rank  # the rank that prefills: colocated, prefill, or (PD, --disagg placed it there) decode
    arrival: float  # perf_counter at HTTP arrival
    decode: Rank | None = None  # PD mode with a handoff: the decode rank
    last: float = 0.0  # perf_counter of the last token event; 0 before the first
    migrations: int = 0  # times it moved from a dead rank (migration.py)
    received: int = 0  # output tokens delivered so far
    tokens: list[int] = field(default_factory=list)  # their ids (a migration resumes from them)
    early: dict[int, TokenEvent] = field(default_factory=dict)  # PD: events ahead of the first token, by offset
    prefill_s: float = 0.0  # --disagg auto: its estimated prefill seconds on `rank` (queued work until `last`)

    def ranks(self) -> list[Rank]:
        return [self.rank] if self.decode is None else [self.rank, self.decode]


@dataclass
class Handle:
    """One HTTP request's sub-requests. Read `next_batch()` (or iterate `batches()`); always
    `close()` (idempotent)."""

    dispatcher: "Dispatcher"
    sub_ids: list[str]
    rank: Rank  # the rank that prefills (colocated, prefill, or a decode rank prefilling itself)
    decode: Rank | None = None  # PD mode with a handoff
    queue: Inbox = field(default_factory=Inbox)
    _open: int = -1  # sub-requests not finished yet

    def __post_init__(self) -> None:
        self._open = len(self.sub_ids)

    async def next_batch(self) -> list[tuple[int, TokenEvent]] | None:
        """Every (choice index, TokenEvent) that arrived since the last call, oldest first
        (waits for one); None once every sub-request finished. Raises APIError on a Failure and
        ClientGone after client_gone() (the caller then closes the handle)."""
        if not self._open:
            return None
        items = await self.queue.take_all()
        for _, item in items:
            if item.__class__ is TokenEvent:
                if item.finish_reason is not None:
                    self._open -= 1
            elif item is _GONE:
                raise ClientGone
            else:
                raise APIError(item.status, item.message)
        return items

    @property
    def finished(self) -> bool:
        """Every sub-request delivered its last event."""
        return not self._open

    async def batches(self):
        """next_batch() as an async iterator."""
        while (items := await self.next_batch()) is not None:
            yield items

    def client_gone(self) -> None:
        """Wake the reader with ClientGone (the HTTP client disconnected)."""
        self.queue.put_nowait((-1, _GONE))

    def close(self) -> None:
        for sid in self.sub_ids:
            self.dispatcher.abort(sid)
