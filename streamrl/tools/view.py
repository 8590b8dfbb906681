"""`streamrl view RUN`: a local web page over a run's pool, or `--html FILE`, a static report.

    streamrl view runs/quickstart                 # prints http://127.0.0.1:PORT/?token=...
    streamrl view runs/quickstart --html report.html --where "reward > 0"

The server listens on 127.0.0.1 only, on a free port, and answers only requests that carry the
random token of the URL it prints (`?token=` or `Authorization: Bearer`, compared in constant
time), like Jupyter. The page is one HTML file with its script and style inlined
(view_static/), so nothing is fetched from anywhere else and the Content-Security-Policy forbids
it. Its data comes from the JSON routes below (streamrl/tools/view_data.py): a page of samples
at a time, never the whole pool. The filter a page sends is untrusted SQL: view_data runs it
sandboxed, and a refused one is a 400 that says why.

    GET /                     the page
    GET /api/summary          run at a glance: per-step reward, length, staleness, accuracy, ledger
    GET /api/samples          where, step, version, reward_min, reward_max, offset, limit -> {total, rows}
    GET /api/sample?uid=      one sample: tokens with versions, log-probs, loss mask, advantage
    GET /api/group?group_id=  the n samples of one prompt instance
    GET /api/prompt?prompt_id= the groups of one prompt, oldest version first
  every /api route takes as_of_step=N: the pool as learner step N read it (pools/asof.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from streamrl.connectors.ports import LOOPBACK, listen_socket, port_of
from streamrl.pools import RECORDED_RECIPE, PoolError, open_pool
from streamrl.tools.view_data import PAGE_MAX, Page, RunData, ViewError

__all__ = ["Page", "ViewError", "ViewServer", "open_run", "page_html", "running", "serve", "write_html"]

STATIC = Path(__file__).resolve().parent / "view_static"
# The page and its data come from this server alone; the token never leaves in a Referer.
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                      "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
           "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}
REPORT_SAMPLES = 200  # samples a static report holds (their groups whole, up to REPORT_GROUPS)
REPORT_GROUPS = 50

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def open_run(target: str) -> RunData:
    """A run directory (its pool, metrics.jsonl, eval.jsonl) or a bare pool URI, opened to read."""
    p = Path(target)
    run_dir = p if "://" not in target and ((p / RECORDED_RECIPE).is_file() or (p / "pool").is_dir()) else None
    return RunData(open_pool(target, create=False, compact_every=0), run_dir)


def page_html(data: dict[str, Any] | None = None) -> str:
    """The page, its script and style inlined; `data` embedded makes it a static report."""
    html = (STATIC / "index.html").read_text()
    embedded = "null" if data is None else json.dumps(data, separators=(",", ":"))
    # Inside <script>, "</" could close the element: JSON allows "<\/" for it.
    embedded = embedded.replace("</", "<\\/").replace("<!--", "<\\!--")
    return (html.replace("/*STYLE*/", (STATIC / "view.css").read_text())
                .replace("/*SCRIPT*/", (STATIC / "view.js").read_text())
                .replace("/*DATA*/null", embedded))


def _number(q: Any, name: str, kind: type = int) -> Any:
    """Query parameter `name` as a `kind` (None when absent); ViewError naming it otherwise."""
    v = q.get(name)
    if v in (None, ""):
        return None
    try:
        return kind(v)
    except ValueError:
        raise ViewError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v[:40]!r}") from None


def page_of(q: Any) -> Page:
    return Page(where=q.get("where") or None, step=_number(q, "step"), version=_number(q, "version"),
                reward_min=_number(q, "reward_min", float), reward_max=_number(q, "reward_max", float),
                offset=_number(q, "offset") or 0, limit=_number(q, "limit") or 50)


class ViewServer:
    """The HTTP side: token check, routes, JSON. Blocking reads run in threads."""

    def __init__(self, data: RunData, token: str | None = None) -> None:
        self.data = data
        self.token = token or secrets.token_urlsafe(32)
        self.url = ""
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        for name in ("summary", "samples", "sample", "group", "prompt"):
            app.router.add_get(f"/api/{name}", self._api)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else request.query.get("token", "")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            resp: web.StreamResponse = web.json_response(
                {"error": "missing or wrong token: open the URL `streamrl view` printed"}, status=401)
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                resp = web.json_response({"error": e.reason}, status=e.status)
        resp.headers.update(HEADERS)
        return resp

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html")

    async def _api(self, request: web.Request) -> web.Response:
        q, name = request.query, request.path.rsplit("/", 1)[-1]
        try:
            as_of = _number(q, "as_of_step")
            call: Callable[[], Any] = {
                "summary": lambda: self.data.summary(as_of),
                "samples": lambda: self.data.samples(page_of(q), as_of),
                "sample": lambda: self.data.sample(q.get("uid", ""), as_of),
                "group": lambda: self.data.group(q.get("group_id", ""), as_of),
                "prompt": lambda: self.data.prompt(q.get("prompt_id", ""), as_of),
            }[name]
            body = await asyncio.to_thread(call)
        except ViewError as e:
            return web.json_response({"error": str(e)}, status=400)
        except PoolError as e:
            return web.json_response({"error": f"the pool cannot be read: {e}"}, status=500)
        return web.json_response(body, dumps=lambda o: json.dumps(o, allow_nan=False))

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1:`port` (0: a free one); returns the URL with the token."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        sock = listen_socket(LOOPBACK, port)
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{LOOPBACK}:{port_of(sock)}/?token={self.token}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.contextmanager
def running(data: RunData, port: int = 0) -> Iterator[ViewServer]:
    """Serve `data` from a thread of this process while the block runs (tests, benchmarks, notebooks);
    the server's `url` holds the token."""
    loop = asyncio.new_event_loop()
    server = ViewServer(data)
    thread = threading.Thread(target=loop.run_forever, name="streamrl-view", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(port), loop).result(30)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


async def _serve(data: RunData, port: int, as_of_step: int | None) -> None:
    server = ViewServer(data)
    url = await server.start(port) + ("" if as_of_step is None else f"&as_of_step={as_of_step}")
    print(f"streamrl view: {data.pool.uri}\n  open {url}\n  (127.0.0.1 only; the token is the key: do not share "
          "the URL; Ctrl-C stops)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.close()


def serve(target: str, port: int = 0, as_of_step: int | None = None) -> None:
    """`streamrl view RUN`: serve until SIGINT/SIGTERM; the printed URL opens the page as of
    `as_of_step` when given (ViewError, before serving, when the pool cannot be read so)."""
    data = open_run(target)
    try:
        if as_of_step is not None:
            data.source(as_of_step)
        asyncio.run(_serve(data, port, as_of_step))
    finally:
        data.close()


def report(data: RunData, page: Page, as_of_step: int | None = None, samples: int = REPORT_SAMPLES) -> dict[str, Any]:
    """What a static report embeds: the summary, up to `samples` rows `page` selects, and the whole
    groups (and prompt histories) of the first REPORT_GROUPS groups among them."""
    rows: list[dict[str, Any]] = []
    offset = page.offset
    while len(rows) < samples:
        got = data.samples(Page(**{**page.__dict__, "offset": offset, "limit": min(PAGE_MAX, samples - len(rows))}),
                           as_of_step)
        rows += got["rows"]
        offset += len(got["rows"])
        if not got["rows"] or offset >= got["total"]:
            break
    groups = list(dict.fromkeys(r["group_id"] for r in rows))[:REPORT_GROUPS]
    detail = {g: data.group(g, as_of_step) for g in groups}
    prompts = {p: data.prompt(p, as_of_step) for p in dict.fromkeys(d["prompt_id"] for d in detail.values())}
    return {"summary": data.summary(as_of_step), "where": page.where, "rows": [r for r in rows if r["group_id"] in detail],
            "groups": detail, "prompts": prompts, "as_of_step": as_of_step}


def write_html(target: str, out: str | Path, page: Page, as_of_step: int | None = None,
               samples: int = REPORT_SAMPLES) -> int:
    """`streamrl view RUN --html FILE`: one self-contained file; returns the samples it holds."""
    data = open_run(target)
    try:
        body = report(data, page, as_of_step, samples)
    finally:
        data.close()
    Path(out).write_text(page_html(body))
    return len(body["rows"])

