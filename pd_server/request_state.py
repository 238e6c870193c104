"""What the dispatcher keeps per request: a Pending per sub-request it has sent, the Handle an
HTTP handler iterates, and the Failure that ends a sub-request early (dispatcher.py)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd_server.errors import APIError
from pd_server.protocol.rank_router import TokenEvent
from pd_server.protocol.router_rank import Generate
from pd_server.ranks import Rank

if TYPE_CHECKING:
    from pd_server.dispatcher import Dispatcher


@dataclass(frozen=True)
class Failure:
    status: int
    message: str


@dataclass
class Pending:
    """One sub-request the router has sent and not yet seen finish."""

    msg: Generate
    queue: asyncio.Queue
    index: int  # choice index in the HTTP response
    rank: Rank  # the colocated or prefill rank
    arrival: float  # perf_counter at HTTP arrival
    decode: Rank | None = None  # PD mode: the decode rank
    last: float = 0.0  # perf_counter of the last token event; 0 before the first
    retried: bool = False
    received: int = 0  # output tokens delivered so far
    early: dict[int, TokenEvent] = field(default_factory=dict)  # PD: events ahead of the first token, by offset

    def ranks(self) -> list[Rank]:
        return [self.rank] if self.decode is None else [self.rank, self.decode]


@dataclass
class Handle:
    """One HTTP request's sub-requests. Iterate `batches()`; always `close()` (idempotent)."""

    dispatcher: "Dispatcher"
    sub_ids: list[str]
    rank: Rank  # the colocated or prefill rank
    decode: Rank | None = None  # PD mode
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _open: int = 0

    async def batches(self):
        """Yields lists of (choice index, TokenEvent) as they arrive, until every sub-request
        finished. Raises APIError on a Failure (the caller then closes the handle)."""
        self._open = len(self.sub_ids)
        q = self.queue
        while self._open:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            for _, item in items:
                if isinstance(item, Failure):
                    raise APIError(item.status, item.message)
                if item.finish_reason is not None:
                    self._open -= 1
            yield items

    def close(self) -> None:
        for sid in self.sub_ids:
            self.dispatcher.abort(sid)
