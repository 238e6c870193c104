"""pd_server/http_protocol.py's bound on open connections, on a real uvicorn server: one past
--max-connections closes the longest-idle keep-alive connection to make room, or, with none idle,
is answered 503 in OpenAI's error shape and closed; and the default bound follows the open-file
limit."""
from __future__ import annotations

import asyncio
import json
import resource
import socket

import uvicorn

from pd_server.http_protocol import RESERVED_FDS, connection_limit, header_timeout_protocol


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _get(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"ok")
    return reader, writer, head


def test_one_past_the_limit_takes_an_idle_connections_place_or_is_503():
    async def run():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, lifespan="off", timeout_keep_alive=30,
                                               http=header_timeout_protocol(30, 2)))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            first = await _get(port)
            await asyncio.sleep(0.05)
            second = await _get(port)  # both idle now, keep-alive
            third = await _get(port)  # takes the place of the first, idle longest
            assert b"200 OK" in third[2]
            assert await asyncio.wait_for(first[0].read(), 5) == b""  # closed
            first[1].close()
            # two connections that sent nothing yet are not idle: a third is a 503
            for r, w, _ in (second, third):
                w.close()
            await asyncio.sleep(0.05)
            quiet = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            await asyncio.sleep(0.05)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 5)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
            for _, w in quiet + [(reader, writer)]:
                w.close()
            for _, w in quiet + [(reader, writer), first[:2], second[:2], third[:2]]:
                try:
                    await w.wait_closed()
                except OSError:
                    pass
        finally:
            server.should_exit = True
            await serving

    asyncio.run(run())


def test_the_default_limit_follows_the_open_file_limit():
    assert connection_limit(100) == 100
    n = connection_limit(0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert n == max(64, soft - RESERVED_FDS)
