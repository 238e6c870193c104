"""Stored Responses (the Responses API's `store`, default true, as OpenAI and vLLM keep them).

A finished response is kept under its id with the input items of the whole conversation that
produced it (the stored chain's, then the request's own; instructions are not carried, as OpenAI
defines), so `previous_response_id` continues it: the new request's input follows the chain's
input and the previous response's output items (openai_responses.with_previous). GET
/v1/responses/{id} returns the response object, GET .../input_items its input items, DELETE
removes it. Bounded: at most --responses-max-count responses and --responses-max-mb of JSON,
least recently used out first, and each expires --responses-ttl-s after it was stored. In the
router's memory: a restart forgets them (a 404 then, as for an evicted one). Each is its
tenant's (security.tenant: the API key it came with, where --api-key names several): another
tenant's id is a 404, as an unknown one.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec


@dataclass
class Stored:
    response: dict  # the Response object as it was returned
    input_items: list[dict]  # the conversation's input items, oldest first
    nbytes: int
    expires: float  # monotonic
    owner: str = ""  # its tenant (security.tenant_id of the key it came with; "" without keys)


class ResponseStore:
    """LRU by count and bytes, with a TTL. Not thread-safe: the router's event loop owns it."""

    def __init__(self, max_count: int, max_bytes: int, ttl_s: float) -> None:
        self.max_count, self.max_bytes, self.ttl_s = max_count, max_bytes, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, response: dict, input_items: list[dict], owner: str = "") -> bool:
        """Keep a finished response; False (nothing kept) when it alone is over the byte bound."""
        nbytes = len(msgspec.json.encode(response)) + len(msgspec.json.encode(input_items))
        if self.max_count <= 0 or nbytes > self.max_bytes:
            return False
        self.delete(rid)
        self._items[rid] = Stored(response, input_items, nbytes, time.monotonic() + self.ttl_s, owner)
        self.nbytes += nbytes
        while len(self._items) > self.max_count or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def get(self, rid: str, owner: str = "") -> Stored | None:
        """The response `rid` if `owner` stored it (and it has not expired), else None."""
        s = self._items.get(rid)
        if s is None or s.owner != owner:
            return None
        if time.monotonic() >= s.expires:
            self._drop(rid)
            return None
        self._items.move_to_end(rid)
        return s

    def delete(self, rid: str) -> bool:
        if rid not in self._items:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        self.nbytes -= self._items.pop(rid).nbytes
