"""uvicorn's httptools protocol with a deadline on request headers (slow-header slowloris).

uvicorn arms no timer between a connection's opening and its first request's headers, nor
while a request's headers trickle in: a client that sends half a request line holds the
connection (and a file descriptor) forever, and the app never sees it, so the body guard in
security.py cannot help. This protocol arms a timer when the connection opens and when a
request begins (between requests uvicorn's keep-alive timeout closes an idle connection);
headers complete in time disarm it. On expiry: a 408 in OpenAI's error shape
if some of a request arrived, then the connection is closed (silently if nothing came).
"""
from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_server.errors import APIError, error_body
from pd_server.responses import to_json


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to hand to uvicorn.Config(http=...)."""
    body = to_json(error_body(APIError(408, f"the request headers did not arrive within {timeout_s:g} s",
                                       code="timeout")))
    response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))

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
