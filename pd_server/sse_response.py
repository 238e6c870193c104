"""The streaming response of both streaming routes: a pure ASGI app writing SSE from a Handle.

Per stream, in order:
  1. http.response.start (status 200, SSE headers, the route headers) through the normal
     send chain, so the middleware sees the status;
  2. the renderer's head (completions' echo chunks), if any, at once;
  3. each wake-up takes every event the dispatcher put since the last (Handle.next_batch),
     renders them (one SSE event per token event, never merged) and writes them with ONE
     send, straight to the server's send (`SERVER_SEND` below). While the task waits with
     nothing pending, a plain token (renderer.fast) is written by the dispatcher's own call
     instead (Inbox.eager): no wake-up of the task per token. Where uvicorn would write it at
     once (fanout.Direct), those bytes join the round's fanout.BATCH, which sends every stream's
     from native code before the dispatcher's round ends. The server's send is a
     coroutine that finishes without waiting unless the client stopped reading (flow
     control); it is run one step in place, and only if it waits does the rest go to a task
     (`_Rest`), which later events then wait for, so the order on the wire never changes;
  4. at the end, the tail (usage chunk) or an error event, then [DONE], in the last send
     (with the batch that finished the last choice);
  5. finally, always: the handle is closed (Abort for whatever did not finish).
A client that disconnects is seen in one place: a watcher awaiting receive() turns
http.disconnect into Handle.client_gone(), which ends step 3 at once (uvicorn's send returns
silently on a closed connection, so a failing send cannot be relied on).

Unlike Starlette's StreamingResponse there is no task group, no second task per stream and no
async generator between the dispatcher and the socket: a plain token costs one send, made in
the dispatcher's own call; the stream's task wakes for the first and last events, failures,
tokens off the fast path (tools, logprobs, token ids) and a client that reads slowly.

SERVER_SEND: `with_server_send()` wraps the whole app (outermost) and puts the server's own
send callable in the scope; the body goes straight to it. Every layer it skips (Starlette's
error and exception middleware, FastAPI's body limit, RequestCounter) only looks at
http.response.start, which still passes through them.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from starlette.responses import Response

from cluster.protocol.rank_router import TokenEvent
from pd_server import fanout, sse
from pd_server.errors import APIError
from pd_server.request_state import ClientGone, Handle

SERVER_SEND = "pdserve.server_send"  # scope key (an ASGI scope may carry server-specific keys)
_CONTENT_TYPE = (b"content-type", f"{sse.MEDIA_TYPE}; charset=utf-8".encode())


class StreamRenderer(Protocol):
    """Turns one request's events into SSE bytes (sse.event framing, one event per chunk).
    A renderer may set `done` (bytes after the tail; default sse.DONE, OpenAI's
    `data: [DONE]`): the Responses and Messages APIs end with their own last event, b""."""

    def head(self) -> bytes:
        """Events to send before the first token (b"": none)."""

    def fast(self, idx: int, ev: TokenEvent) -> bytes | None:
        """The event of one token that is not its choice's last, if it takes the per-token fast
        path (content only: a template, no state beyond usage counts); None otherwise."""

    def render(self, batch: list[tuple[int, TokenEvent]]) -> bytes:
        """The events of one batch (choice index, event), in order."""

    def tail(self) -> bytes:
        """Events after every choice finished (the usage chunk), without [DONE]."""

    def error(self, err: APIError) -> bytes:
        """The error event for a failure after the stream started, without [DONE]."""


def with_server_send(app):
    """Wrap an ASGI app so that SSEStream can send its body straight to the server."""

    async def outer(scope, receive, send):
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return outer


async def _watch_disconnect(receive, handle: Handle) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    handle.client_gone()


def watch_disconnect(receive, handle: Handle) -> asyncio.Task:
    """A task that wakes `handle` with ClientGone once the client disconnects; cancel it when done."""
    return asyncio.ensure_future(_watch_disconnect(receive, handle))


class _Rest:
    """Awaits the rest of a coroutine that already ran up to its first suspension, where it
    yielded `first` (what Python 3.12's eager tasks do): the task awaiting this waits on what
    the coroutine waits on, and results, exceptions and cancellation pass through."""

    def __init__(self, coro, first) -> None:
        self.coro, self.first = coro, first

    def __await__(self):
        coro, yielded = self.coro, self.first
        while True:
            try:
                value = yield yielded
            except BaseException as e:  # noqa: B036 - cancellation must reach the coroutine too
                step, arg = coro.throw, e
            else:
                step, arg = coro.send, value
            try:
                yielded = step(arg)
            except StopIteration as stop:
                return stop.value


class SSEStream(Response):
    """The ASGI response for one streamed request (steps above). `headers`: route headers.
    A Starlette Response only so that FastAPI passes it through; none of its machinery runs
    (no background tasks: the streaming routes declare none)."""

    background = None
    status_code = 200
    media_type = sse.MEDIA_TYPE

    def __init__(self, handle: Handle, renderer: StreamRenderer, headers: dict[str, str]) -> None:
        self.handle, self.renderer = handle, renderer
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in {**sse.HEADERS, **headers}.items()] + [_CONTENT_TYPE]
        self._out = None  # the send the body goes to
        self._busy: asyncio.Future | None = None  # an eager send that had to wait (flow control)
        self._error: BaseException | None = None  # an eager send's failure, raised by the stream task
        self._direct: fanout.Direct | None = None  # the connection, where eager bodies go to fanout.BATCH

    def _eager(self, items: list) -> bool:
        """Step 3 without waking the stream's task (Inbox.eager, called by the dispatcher at the
        end of a receive round while the task waits): writes the items at once, with one send,
        if every one is a fast-path token; returns False (the task takes them all) on anything
        else: a last event, a failure, the client gone, a token off the fast path, or while an
        earlier eager send still waits."""
        if self._busy is not None:
            return False
        fast, out = self.renderer.fast, []
        for idx, ev in items:
            if ev.__class__ is not TokenEvent or ev.finish_reason is not None:
                return False
            out.append(fast(idx, ev))
        if None in out:
            return False
        direct = self._direct
        if direct is not None and direct.ready():
            fanout.BATCH.add(direct, b"".join(out))  # sent within this round (fanout.Batch)
            return True
        coro = self._out({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        try:
            first = coro.send(None)
        except StopIteration:
            return True  # the usual case: the server wrote it without waiting
        except Exception as e:  # noqa: BLE001 - not the dispatcher's to handle: the stream task raises it
            self._error = e
            return False
        self._busy = asyncio.ensure_future(_Rest(coro, first))  # the client reads slowly: finish later
        return True

    async def _settle(self) -> None:
        """Wait for a pending eager send; raise its failure."""
        if self._busy is not None:
            await self._busy
            self._busy = None
        if self._error is not None:
            raise self._error

    async def __call__(self, scope, receive, send) -> None:
        handle, renderer = self.handle, self.renderer
        out = self._out = scope.get(SERVER_SEND, send)
        watch = watch_disconnect(receive, handle)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            self._direct = fanout.Direct.of(out)
            head = renderer.head()
            if head:
                await out({"type": "http.response.body", "body": head, "more_body": True})
            handle.queue.eager = self._eager
            body = b""
            try:
                while (batch := await handle.next_batch()) is not None:
                    await self._settle()
                    body = renderer.render(batch)
                    if handle.finished:  # the last events go out with the tail
                        break
                    await out({"type": "http.response.body", "body": body, "more_body": True})
                    body = b""
                body += renderer.tail()
            except APIError as e:
                body = renderer.error(e)
            except ClientGone:
                return
            finally:
                handle.queue.eager = None
            await self._settle()
            done = getattr(renderer, "done", sse.DONE)
            await out({"type": "http.response.body", "body": body + done, "more_body": False})
        finally:
            watch.cancel()
            if self._busy is not None:
                self._busy.cancel()
            handle.close()
