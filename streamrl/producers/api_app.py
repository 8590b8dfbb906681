"""The producer API: an HTTP service through which other processes stream finished sample groups
into a run's experience pool (`streamrl produce serve RUN_DIR`; SDK: streamrl/producers/sdk.py).

It holds the external producers' share of the admission capacity (recipe `producer_api`): a
producer leases slots before generating (`POST /v1/leases`, 429 while the staleness bound is
reached), then submits each group under its lease (`POST /v1/groups`). Group ids are idempotency
keys, so a producer may retry any submission, also after either side was killed.

Files in RUN_DIR: reads recipe.yaml, events.jsonl (the published version), endpoints.json
(router_url and the router's API key, handed to authenticated producers; if there); writes producer_token (0600, created once), producer.json ({url, pid,
token_file} while serving), producer.lock (one service per run) and logs/producer.log (one line
per refused submission).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from streamrl.connectors.auth import create_private
from streamrl.core import routing, staleness
from streamrl.core.staleness import capacity_shares, claimed_per_step
from streamrl.core.types import from_json, from_msgpack
from streamrl.pools import open_pool
from streamrl.pools.reads import quote
from streamrl.producers import intake
from streamrl.recipe import Recipe

TOKEN_FILE, INFO_FILE, LOCK_FILE, LOG_FILE = "producer_token", "producer.json", "producer.lock", "logs/producer.log"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
RETRY_AFTER_S = 0.5  # a 429's advice: the bound moves when the learner publishes a version
VERSION_POLL_S = 0.1
PUBLISH_GRACE_S = 5.0  # how long a group one version ahead waits for that version's publish to be logged
SHA_CACHE = 65536  # content hashes kept in memory; older duplicates are checked against the pool


class ServiceError(Exception):
    """The service cannot start (exit code 2); the message says why."""


class Refused(Exception):
    """A request the service answers with a 4xx/5xx: `key` names the reason in the counters."""

    def __init__(self, status: int, key: str, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.status, self.key, self.reason, self.extra = status, key, reason, extra


def _error(status: int, reason: str, **extra: Any) -> web.Response:
    headers = {"Retry-After": str(max(1, round(extra["retry_after_s"])))} if "retry_after_s" in extra else None
    return web.json_response({"error": {"code": status, "reason": reason, **extra}}, status=status, headers=headers)


def read_token(run_dir: Path) -> str:
    """RUN_DIR/producer_token, created (mode 0600) by the first caller."""
    return create_private(run_dir / TOKEN_FILE, secrets.token_urlsafe(32)).strip()


def model_limits(recipe: Recipe) -> tuple[int, int, tuple[int, int, int]]:
    """(vocab_size, max_position_embeddings, (layers, experts per token, experts)) of the run's model."""
    cfg = Path(recipe.model.path) / "config.json"
    try:
        c = json.loads(cfg.read_text())
        return int(c["vocab_size"]), int(c["max_position_embeddings"]), routing.experts_of(c)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ServiceError(f"cannot read vocab_size and max_position_embeddings from {cfg} ({type(e).__name__}: "
                           f"{e}); the service checks token ids and lengths against the model (paths in the "
                           "recipe are relative to the directory the run was started in: start it there)") from None


class VersionTail:
    """The newest policy version in RUN_DIR/events.jsonl, read incrementally (only new bytes)."""

    def __init__(self, path: Path) -> None:
        self.path, self.version, self._offset, self._rest, self._inode = path, 0, 0, b"", None

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:  # replaced: read it from the start
                    self.version, self._offset, self._rest, self._inode = 0, 0, b"", st.st_ino
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.version
        self._offset += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        for line in lines:
            if b'"version_published"' in line or b'"run_resumed"' in line:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("type") in ("version_published", "run_resumed") and isinstance(ev.get("version"), int):
                    self.version = max(self.version, ev["version"])
        return self.version


class ProducerService:
    def __init__(self, run_dir: Path, recipe: Recipe, quiet: bool = False) -> None:
        self.dir, self.r, self.quiet, api = run_dir, recipe, quiet, recipe.producer_api
        self.token = read_token(run_dir).encode()
        self.vocab_size, self.max_tokens, self.experts = model_limits(recipe)
        self.max_staleness, self.gps, self.n = recipe.max_staleness, recipe.rollout.groups_per_step, recipe.rollout.n_samples
        self.per_step = claimed_per_step(self.gps, recipe.rollout.over_sampling)  # what capacity grows by per version
        self.shares, self.share_index = capacity_shares(recipe.rollout.workers, True), recipe.rollout.workers
        self.max_body = int(api.max_body_mb * 2**20)
        self.tail = VersionTail(run_dir / "events.jsonl")
        self.tail.poll()
        self.leases = intake.LeaseBook(api.lease_s)
        self.pool = open_pool(recipe.pool_uri, create=True, config=recipe.pool, compact_every=0,
                              write_ahead=recipe.pool.write_ahead)
        # External groups: id -> (producer id, pool status or None when admitted but not stored).
        self.known: dict[str, tuple[str, str | None]] = {}
        self.started = self.stored = 0
        self.sha: OrderedDict[str, str] = OrderedDict()  # content hashes of recent groups (retries come soon)
        self._uncertain: set[str] = set()  # groups whose pool write failed: admitted or not is looked up
        self._interned: dict[str, str] = {}  # one string object per producer id and status, for big pools
        self._busy: dict[str, asyncio.Event] = {}  # submissions in progress, by group id
        self.counters: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._load()
        (run_dir / "logs").mkdir(exist_ok=True)
        self._log = open(run_dir / LOG_FILE, "a", buffering=1)  # noqa: SIM115 - lives as long as the service

    def _load(self) -> None:
        where = f"producer_id NOT LIKE '{intake.RESERVED_PREFIX}%'"
        adm = self.pool.scan(["group_id", "producer_id"], where=where, table="admissions")
        rows = self.pool.scan(["group_id", "status"], where=where)
        status = dict(zip(rows["group_id"].to_pylist(), rows["status"].to_pylist()))
        for gid, pid in zip(adm["group_id"].to_pylist(), adm["producer_id"].to_pylist()):
            self._mark(gid, pid, status.get(gid))

    # ------------------------------------------------------------ state

    @property
    def version(self) -> int:
        return self.tail.version

    def _mark(self, gid: str, producer_id: str, status: str | None) -> None:
        """Record a group's state, keeping the counts room() needs at O(1)."""
        producer_id = self._interned.setdefault(producer_id, producer_id)
        status = self._interned.setdefault(status, status) if status is not None else None
        # Like a rollout worker's count: dropped and failed groups do not use up capacity.
        if (old := self.known.get(gid)) is not None:
            self.started -= old[1] not in ("dropped", "failed")
            self.stored -= old[1] is not None
        self.started += status not in ("dropped", "failed")
        self.stored += status is not None
        self.known[gid] = (producer_id, status)

    def room(self, now: float) -> int:
        return intake.room(self.version, self.max_staleness, self.per_step, self.shares, self.share_index, self.started,
                           self.leases.outstanding(now))

    def status(self) -> dict[str, Any]:
        now = time.time()
        endpoints = self.dir / "endpoints.json"
        try:
            ends = json.loads(endpoints.read_text()) if endpoints.exists() else {}
        except (OSError, ValueError):
            ends = {}
        return {"version": self.version, "max_staleness": self.max_staleness, "groups_per_step": self.gps,
                "n_samples": self.n, "room": self.room(now), "outstanding": self.leases.outstanding(now),
                "started": self.started, "stored": self.stored, "router_url": ends.get("router_url"),
                "router_api_key": ends.get("api_key"),  # generation only (the run's admin key stays with it)
                "vocab_size": self.vocab_size, "max_tokens": self.max_tokens, "lease_s": self.leases.lease_s,
                "max_body_bytes": self.max_body, "accepted": self.counters["accepted"],
                "duplicates": self.counters["duplicates"], "refused": dict(self.refused)}

    # ------------------------------------------------------------ HTTP

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._middleware])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/status", self._status)
        app.router.add_post("/v1/leases", self._lease)
        app.router.add_post("/v1/groups", self._submit)
        app.router.add_get("/v1/groups/{group_id:.+}", self._group)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
        try:
            if request.path != "/health":
                self._auth(request)
            return await handler(request)
        except Refused as e:
            if e.key != "not_found":  # a restarted producer asking what it stored is not refused
                self.refused[e.key] += 1
            if request.path == "/v1/groups" and e.status != 429:
                self._note(request, e)
            return _error(e.status, e.reason, **e.extra)
        except web.HTTPException as e:  # aiohttp's own (unknown route, wrong method): same JSON shape
            if e.status < 400:
                raise
            return _error(e.status, e.reason)

    def _auth(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or not self.token:
            raise Refused(401, "unauthorized", f"missing 'Authorization: Bearer <token>' header (the token is in "
                                               f"{self.dir / TOKEN_FILE})")
        if not hmac.compare_digest(token.encode(), self.token):
            raise Refused(401, "unauthorized", f"wrong bearer token (the token is in {self.dir / TOKEN_FILE})")

    def _note(self, request: web.Request, e: Refused) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} refused {e.status} {e.key} from {request.remote}: {e.reason}"
        self._log.write(line + "\n")
        if not self.quiet:
            print(f"streamrl produce: {line}", file=sys.stderr, flush=True)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _body(self, request: web.Request) -> bytes:
        size = request.content_length
        if size is not None and size > self.max_body:
            raise self._too_large(size)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large(None) from None

    def _too_large(self, size: int | None) -> Refused:
        got = f"{size} bytes" if size is not None else "more than that"
        return Refused(413, "too_large", f"body is {got}; the limit is {self.max_body} bytes "
                                         f"(producer_api.max_body_mb={self.r.producer_api.max_body_mb:g})",
                       limit_bytes=self.max_body, size_bytes=size)

    async def _lease(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        try:
            req = msgspec.json.decode(body, type=intake.LeaseRequest)
        except msgspec.DecodeError as e:
            raise Refused(400, "bad_request", f"lease request: {e}; expected {{\"producer_id\": str, \"groups\": "
                                              "int >= 1}") from None
        if (problem := intake.producer_id_problem(req.producer_id)) is not None:
            raise Refused(400, "bad_request", problem)
        now = time.time()
        lease = self.leases.grant(req.producer_id, req.groups, self.room(now), self.version, now)
        if lease is None:
            raise Refused(429, "staleness", self._full_reason(now), retry_after_s=RETRY_AFTER_S)
        return web.json_response({"lease_id": lease.lease_id, "producer_id": lease.producer_id,
                                  "version": lease.version, "slots": lease.slots, "expires_at_s": lease.expires_at})

    def _full_reason(self, now: float) -> str:
        total = staleness.admission_capacity(self.version, self.max_staleness, self.per_step)
        share = staleness.capacity_share(total, self.share_index, self.shares)
        return (f"staleness bound: learner at version {self.version} allows {share} started external groups "
                f"(share {self.share_index + 1} of {self.shares} of ({self.version}+{self.max_staleness}+1)*{self.per_step}"
                f"={total}); {self.started} started + {self.leases.outstanding(now)} leased; retry when the "
                "learner publishes the next version")

    def _decode(self, request: web.Request, body: bytes) -> intake.Submission:
        ctype = request.content_type
        if ctype in MSGPACK_TYPES:
            decode, what = from_msgpack, "msgpack"
        elif ctype == "application/json":
            decode, what = from_json, "JSON"
        else:
            raise Refused(415, "bad_request", f"Content-Type {ctype!r}: send application/json or application/msgpack")
        try:
            return decode(body, intake.Submission)
        except msgspec.ValidationError as e:
            raise Refused(422, "invalid", f"invalid submission: {e}") from None
        except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: nested deeper than msgspec decodes
            raise Refused(400, "undecodable", f"body is not valid {what}: {e}") from None

    async def _submit(self, request: web.Request) -> web.Response:
        sub = self._decode(request, await self._body(request))
        g, gid = sub.group, sub.group.group_id
        while (busy := self._busy.get(gid)) is not None:  # the same group arriving twice at once
            await busy.wait()
        sha = intake.content_sha256(g)
        if self.known.get(gid, (None, None))[1] is not None:
            return await self._duplicate(gid, sha)
        self._busy[gid] = asyncio.Event()
        try:
            if gid in self._uncertain:  # its last write failed: was the admission committed?
                if (pid := await asyncio.to_thread(self._admitted, gid)) is not None:
                    self._mark(gid, pid, None)
                self._uncertain.discard(gid)
            return await self._store(sub, sha, readmit=self.known.get(gid, (None, None))[0])
        finally:
            self._busy.pop(gid).set()

    async def _duplicate(self, gid: str, sha: str) -> web.Response:
        stored = self.sha.get(gid)
        if stored is None:
            rows = await asyncio.to_thread(self.pool.scan, ["group_metadata_json"], _is(gid))
            meta = json.loads(rows["group_metadata_json"][0].as_py() or "{}") if rows.num_rows else {}
            stored = meta.get("submission_sha256", sha)  # unknown: trust the id
        if stored != sha:
            raise Refused(409, "conflict", f"group {gid} is already stored with different content (sha256 "
                                           f"{stored[:12]}..., this one {sha[:12]}...); a group id names one group: "
                                           "give a new group a new id")
        self.counters["duplicates"] += 1
        return web.json_response({"stored": False, "duplicate": True, "group_id": gid})

    async def _await_publish(self, version: int | None) -> None:
        """Engines serve a version a moment before the broadcaster logs it as published (and this
        service reads the log every VERSION_POLL_S): a group one version ahead may come from a
        publish in progress, so wait briefly for the log before calling its version from the future."""
        deadline = time.monotonic() + PUBLISH_GRACE_S
        while version is not None and version == self.tail.poll() + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def _store(self, sub: intake.Submission, sha: str, readmit: str | None) -> web.Response:
        """`readmit`: the producer of a group admitted but never stored (the service died between the
        two commits): its rows are written now, under its first admission and lease slot."""
        g, now = sub.group, time.time()
        lease = None
        if readmit is None:
            try:
                lease = self.leases.check(sub.lease_id, now)
            except intake.LeaseError as e:
                raise Refused(409, "lease", str(e), lease_error=True) from None
        producer_id = readmit or lease.producer_id  # type: ignore[union-attr]
        await self._await_publish(g.max_version)
        reason = intake.check_group(g, producer_id=producer_id, n_samples=self.n, vocab_size=self.vocab_size,
                                    max_tokens=self.max_tokens, published_version=self.version, experts=self.experts)
        if reason is not None:
            raise Refused(422, "rejected", f"group {g.group_id}: {reason}")
        g.producer_id, g.created_at = producer_id, 0  # the pool stamps the time: claims go oldest-first
        g.metadata = {**g.metadata, "submission_sha256": sha}
        if lease is not None:
            self.leases.use(lease.lease_id, now)
        try:
            await self.pool.append_async([g], admit=readmit is None)
        except Exception as e:  # noqa: BLE001 - the producer retries; the group id makes that safe
            if lease is not None:
                # The slot goes back for the retry; if the admission did commit, the retry finds it.
                self.leases.refund(lease.lease_id)
                self._uncertain.add(g.group_id)
            raise Refused(503, "error", f"group {g.group_id}: the pool write failed ({type(e).__name__}: {e}); "
                                        "submit it again") from None
        self._mark(g.group_id, producer_id, "complete")
        self.sha[g.group_id] = sha
        if len(self.sha) > SHA_CACHE:
            self.sha.popitem(last=False)
        self.counters["accepted"] += 1
        return web.json_response({"stored": True, "group_id": g.group_id})

    def _admitted(self, gid: str) -> str | None:
        """The producer that admitted `gid`, or None."""
        rows = self.pool.scan(["producer_id"], where=_is(gid), table="admissions")
        return rows["producer_id"][0].as_py() if rows.num_rows else None

    async def _group(self, request: web.Request) -> web.Response:
        gid = request.match_info["group_id"]
        _, st = self.known.get(gid, (None, None))
        if st is None:
            why = "admitted but not stored (the service stopped in between): submit it again" if gid in self.known \
                else "no external producer's group has this id"
            raise Refused(404, "not_found", f"group {gid}: {why}")
        rows = await asyncio.to_thread(self.pool.scan, ["status"], _is(gid))
        return web.json_response({"group_id": gid, "status": rows["status"][0].as_py() if rows.num_rows else st})

    # ------------------------------------------------------------ lifetime

    async def follow_versions(self) -> None:
        while True:
            await asyncio.sleep(VERSION_POLL_S)
            self.tail.poll()

    def close(self) -> None:
        self.pool.close()
        self._log.close()


def _is(gid: str) -> str:
    """A Lance filter selecting one group."""
    return f"group_id = {quote([gid])}"
