"""An object store that fails for a while: a plain HTTP proxy in front of the local S3 server
(benchmarks/_s3.py) that, once told to, answers every write (PUT, POST, DELETE) with S3's own
`503 SlowDown` until a deadline, and passes everything else through unchanged. What a throttled or
briefly unavailable S3 does; the chaos trials (benchmarks/chaos.py) point a run's pool at it."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
from aiohttp import web

from streamrl.connectors.ports import listen_socket, port_of

WRITES = frozenset({"PUT", "POST", "DELETE"})
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "host", "content-length"})


class FaultyS3:
    """`url` for a recipe's pool.storage_options.aws_endpoint; `fail_writes(seconds)` starts an outage;
    with `after=True` each write is done first and answered 503 all the same (a reply lost on the way back:
    the client cannot tell whether its write landed)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.failing_until, self.after = 0.0, False
        self.refused = 0  # writes answered 503 so far
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="faulty-s3")
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_writes(self, seconds: float, after: bool = False) -> None:
        self.failing_until, self.after = time.monotonic() + seconds, after

    async def _start(self) -> int:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=300))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        sock = listen_socket()  # the one way to get a port (connectors/ports.py): bound here, on 127.0.0.1
        await web.SockSite(self.runner, sock).start()
        return port_of(sock)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        failing = request.method in WRITES and time.monotonic() < self.failing_until
        if failing and not self.after:
            self.refused += 1
            await request.read()
            return web.Response(status=503, body=SLOW_DOWN, content_type="application/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                        data=await request.read(), allow_redirects=False) as up:
            body = await up.read()
            if failing:
                self.refused += 1
                return web.Response(status=503, body=SLOW_DOWN, content_type="application/xml")
            headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if request.method == "HEAD":  # no body, but the object's length (S3 clients read it from the HEAD)
                resp = web.StreamResponse(status=up.status, headers=headers)
                resp.content_length = int(up.headers.get("Content-Length", 0))
                await resp.prepare(request)
                await resp.write_eof()
                return resp
            return web.Response(status=up.status, body=body, headers=headers)

    def close(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()
            await self.session.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
