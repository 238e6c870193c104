"""uvicorn's httptools protocol with a deadline on request headers (slow-header slowloris) and a
bound on open connections.

uvicorn arms no timer between a connection's opening and its first request's headers, nor
while a request's headers trickle in: a client that sends half a request line holds the
connection (and a file descriptor) forever, and the app never sees it, so the body guard in
security.py cannot help. This protocol arms a timer when the connection opens and when a
request begins (between requests uvicorn's keep-alive timeout closes an idle connection);
headers complete in time disarm it. On expiry: a 408 in OpenAI's error shape
if some of a request arrived, then the connection is closed (silently if nothing came).

Connections: at most `max_connections` (--max-connections; by default what the open-file limit
allows, which the router first raises to its hard limit: connection_limit). One past it closes
the oldest idle keep-alive connection to make room (closing an idle connection is ordinary HTTP:
its client reconnects), else it is answered 503 and closed, so a flood of idle connections can
never take the router's last descriptor.
"""
from __future__ import annotations

import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_server.errors import APIError, error_body
from pd_server.responses import to_json


RESERVED_FDS = 512  # descriptors the router keeps for everything else (rank sockets, files, pipes)


def connection_limit(requested: int) -> int:
    """--max-connections: `requested` when > 0; else the open-file limit (raised to the hard limit
    first, as a server does) less RESERVED_FDS, at least 64."""
    if requested > 0:
        return requested
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return max(64, soft - RESERVED_FDS)


def _canned(status: str, err: APIError) -> bytes:
    body = to_json(error_body(err))
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status.encode(), len(body), body))


def header_timeout_protocol(timeout_s: float, max_connections: int = 0) -> type[HttpToolsProtocol]:
    """The protocol class to hand to uvicorn.Config(http=...); max_connections 0: no bound."""
    response = _canned("408 Request Timeout", APIError(408, f"the request headers did not arrive within "
                                                              f"{timeout_s:g} s", code="timeout"))
    full = _canned("503 Service Unavailable", APIError(503, f"this server holds its maximum of {max_connections} "
                                                             "connections, none idle; retry shortly",
                                                        code="too_many_connections"))

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline = None
        _partial = False

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self._partial:
                self.transport.write(response)
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()
            if max_connections and len(self.connections) > max_connections and not self._make_room():
                transport.write(full)
                transport.close()

        def _idle(self) -> bool:
            """Between requests on a keep-alive connection (uvicorn's keep-alive timer runs)."""
            return self.timeout_keep_alive_task is not None and not self.transport.is_closing()

        def _make_room(self) -> bool:
            """Close one idle keep-alive connection (the one idle longest); False when none is."""
            idle = [p for p in self.connections if p is not self and p._idle()]
            if not idle:
                return False
            oldest = min(idle, key=lambda p: p.timeout_keep_alive_task.when())
            oldest.transport.close()
            return True

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._partial = True
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._partial = False
            super().on_headers_complete()

    return HeaderDeadlineProtocol
