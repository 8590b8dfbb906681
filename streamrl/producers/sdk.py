"""SDK for external producers: stream finished sample groups into a run's experience pool.

Over HTTP (the run's `streamrl produce serve`, started with `producer_api.enabled: true`):

    import asyncio
    from streamrl.producers.sdk import ProducerClient
    from streamrl.core.types import Sample, SampleGroup, VersionSpan, make_group_id

    async def main() -> None:
        client = ProducerClient.from_run_dir("runs/myrun", "my-env")
        try:
            st = await client.status()                    # version, n_samples, room, router_url, ...
            for i, prompt in enumerate(my_prompts):      # a fixed order: group ids are deterministic
                gid = make_group_id("my-env", 0, i)       # "my-env:e0:p<i>"
                if await client.stored(gid):              # submitted before a restart
                    continue
                lease = await client.lease(1)             # waits while the staleness bound is reached
                samples = []
                for k in range(st["n_samples"]):
                    out = my_generate(prompt, version=lease.version)  # token ids, log-probs, version
                    samples.append(Sample(index=k, response_tokens=out.ids, rollout_logprobs=out.logprobs,
                                          spans=[VersionSpan(out.version, 0, len(out.ids))],
                                          reward=my_reward(out), finish_reason="stop"))
                group = SampleGroup(group_id=gid, prompt_id=f"p{i}", prompt_tokens=prompt, samples=samples)
                await client.submit(group, lease)         # retried on network errors and 5xx
        finally:
            await client.close()

    asyncio.run(main())

Rules a group must follow (streamrl.producers.intake.check_group): its id starts with "<producer_id>:", status
"complete", exactly rollout.n_samples samples indexed 0..n-1, token ids below the model's vocabulary,
prompt+response within max_position_embeddings, each sample not `failed` has >= 1 response token, a
finite reward and version spans, and no span's version is newer than the run has published. On a MoE
model a sample may carry `routed_experts` (routing replay): int32 [P + n - 1, layers, top_k] expert ids
(the engine's meta_info["routed_experts"] decoded: streamrl.core.routing.decode; over JSON, nested lists),
checked against the model's layers, top_k and number of experts. A
refused group raises ProducerError with the service's reason. `lease.version` is the version the
learner had when the lease was granted; `status()["router_url"]` is the run's sglang-router, which
serves the current policy and needs `status()["router_api_key"]` (`SGLangClient(url,
keys=Keys(api=key))`, or `Authorization: Bearer <key>`).

With direct access to the pool's storage, `DirectProducer` appends without the service.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from streamrl.core.types import SampleGroup, to_msgpack
from streamrl.pools import open_pool
from streamrl.producers import intake
from streamrl.producers.intake import Lease

__all__ = ["DirectProducer", "Lease", "ProducerClient", "ProducerError"]


class ProducerError(Exception):
    """The service refused a request (4xx), or could not be reached in time."""

    def __init__(self, status: int, reason: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {reason}")
        self.status, self.reason, self.body = status, reason, body or {}


class ProducerClient:
    """Async client of one run's producer API (one aiohttp session, opened on first use)."""

    def __init__(self, url: str, token: str, producer_id: str, timeout_s: float = 60) -> None:
        if (problem := intake.producer_id_problem(producer_id)) is not None:
            raise ValueError(problem)
        self.url, self.producer_id, self.timeout_s = url.rstrip("/"), producer_id, timeout_s
        self._headers = {"Authorization": f"Bearer {token}"}
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, producer_id: str, timeout_s: float = 60) -> ProducerClient:
        """URL and token from RUN_DIR/producer.json, written by the running service."""
        info_path = Path(run_dir) / "producer.json"
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError) as e:
            raise ProducerError(0, f"cannot read {info_path} ({e}): is the run's producer service running? "
                                   "(recipe producer_api.enabled: true, or `streamrl produce serve RUN_DIR`)") from None
        token = Path(info["token_file"]).read_text().strip()
        return cls(info["url"], token, producer_id, timeout_s)

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _call(self, method: str, path: str, *, data: bytes | None = None, json_body: Any = None,
                    content_type: str | None = None, ok: tuple[int, ...] = (200,), retry: bool = True
                    ) -> tuple[int, dict[str, Any]]:
        """One request; network errors and 5xx are retried with backoff until timeout_s has passed."""
        session = await self._http()
        loop = asyncio.get_running_loop()
        deadline, attempt = loop.time() + self.timeout_s, 0
        headers = {"Content-Type": content_type} if content_type else None
        while True:
            try:
                async with session.request(method, self.url + path, data=data, json=json_body, headers=headers) as r:
                    try:
                        body = await r.json(content_type=None)
                    except ValueError:
                        body = {"error": {"reason": (await r.text())[:500]}}
                    if r.status in ok:
                        return r.status, body
                    reason = (body.get("error") or {}).get("reason", "") if isinstance(body, dict) else str(body)
                    if r.status < 500:
                        return r.status, body if isinstance(body, dict) else {"error": {"reason": reason}}
                    err: Exception = ProducerError(r.status, reason, body)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                err = e
            attempt += 1
            wait = min(5.0, 0.1 * 2**attempt) * (0.5 + random.random() / 2)
            if not retry or loop.time() + wait > deadline:
                if isinstance(err, ProducerError):
                    raise err
                raise ProducerError(0, f"{method} {self.url}{path}: {type(err).__name__}: {err}") from err
            await asyncio.sleep(wait)

    @staticmethod
    def _raise(status: int, body: dict[str, Any]) -> ProducerError:
        return ProducerError(status, (body.get("error") or {}).get("reason", json.dumps(body)[:500]), body)

    async def status(self) -> dict[str, Any]:
        status, body = await self._call("GET", "/v1/status")
        if status != 200:
            raise self._raise(status, body)
        return body

    async def lease(self, groups: int = 1, wait: bool = True) -> Lease:
        """Reserve up to `groups` slots (the service may grant fewer). While the staleness bound is
        reached: wait=True waits and asks again; wait=False raises ProducerError(429)."""
        while True:
            status, body = await self._call("POST", "/v1/leases", json_body={"producer_id": self.producer_id,
                                                                             "groups": groups})
            if status == 200:
                return Lease(lease_id=body["lease_id"], producer_id=body["producer_id"], version=body["version"],
                             slots=body["slots"], expires_at=body["expires_at_s"])
            if status != 429 or not wait:
                raise self._raise(status, body)
            await asyncio.sleep(float(body["error"].get("retry_after_s", 1.0)))

    async def submit(self, group: SampleGroup, lease: Lease | str) -> dict[str, Any]:
        """Store one group under a lease: {"stored": True, ...} or, when it was stored before (a retry),
        {"stored": False, "duplicate": True}. Raises ProducerError with the reason when refused.
        A stored group counts against `lease.used` (so `lease.used < lease.slots` says if it has room)."""
        lease_id = lease if isinstance(lease, str) else lease.lease_id
        body = to_msgpack(intake.Submission(lease_id=lease_id, group=group))
        status, out = await self._call("POST", "/v1/groups", data=body, content_type="application/msgpack")
        if status == 409 and out.get("error", {}).get("lease_error") and not isinstance(lease, str):
            # The lease expired or the service restarted (leases live in its memory): the work is
            # done, so take a new slot (waiting for the bound like any lease) and submit again.
            fresh = await self.lease(1)
            lease.lease_id, lease.version, lease.slots, lease.used = fresh.lease_id, fresh.version, fresh.slots, 0
            return await self.submit(group, lease)
        if status != 200:
            raise self._raise(status, out)
        if out.get("stored") and not isinstance(lease, str):
            lease.used += 1
        return out

    async def stored(self, group_id: str) -> str | None:
        """The pool status of a group this run's external producers stored, or None (submit it)."""
        status, body = await self._call("GET", "/v1/groups/" + urllib.parse.quote(group_id, safe=""), ok=(200, 404))
        return body["status"] if status == 200 else None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> ProducerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class DirectProducer:
    """Append groups straight to a LanceDB pool, for producers with access to its storage.

    Groups are checked like the service checks them (limits left None are not checked) and group
    ids already admitted are skipped, so re-running a producer is safe. It bypasses the staleness
    leases: nothing stops it from running ahead of the learner; the learner's consumption policy
    (staleness.policy: drop/mask/keep) still bounds the staleness of what is trained on. Do not
    use one producer_id both here and through a running service (each keeps its own record of the
    ids it stored)."""

    def __init__(self, pool_uri: str | Path, producer_id: str, n_samples: int | None = None,
                 vocab_size: int | None = None, max_tokens: int | None = None,
                 experts: tuple[int, int, int] | None = None) -> None:
        """`experts`: (layers, experts per token, experts) of the model (streamrl.core.routing.experts_of),
        to check submitted routed experts against; None: not checked."""
        if (problem := intake.producer_id_problem(producer_id)) is not None:
            raise ValueError(problem)
        self.producer_id, self.n_samples, self.vocab_size, self.max_tokens = producer_id, n_samples, vocab_size, max_tokens
        self.experts = experts
        self.pool = open_pool(pool_uri, create=True, compact_every=0)
        self._known = {g: st for g, (st, _) in self.pool.producer_groups(producer_id).items()}

    def append(self, groups: Sequence[SampleGroup], version: int | None = None) -> dict[str, list[str]]:
        """Validate (against published `version` when given) and store; returns {"stored": ids,
        "duplicates": ids}. Raises ValueError naming the first invalid group and why (nothing is stored)."""
        new, readmit, dup, seen = [], [], [], set()
        for g in groups:
            reason = intake.check_group(g, producer_id=self.producer_id, n_samples=self.n_samples,
                                        vocab_size=self.vocab_size, max_tokens=self.max_tokens,
                                        published_version=version, experts=self.experts)
            if reason is not None:
                raise ValueError(f"group {g.group_id}: {reason}")
            g.producer_id = self.producer_id
            g.metadata = {**g.metadata, "submission_sha256": intake.content_sha256(g)}
            if g.group_id in seen:
                dup.append(g.group_id)
            elif g.group_id not in self._known:
                new.append(g)
            elif self._known[g.group_id] is None:
                readmit.append(g)  # admitted, never stored: a crash between the two commits
            else:
                dup.append(g.group_id)
            seen.add(g.group_id)
        if new:
            self.pool.append(new, admit=True)
        if readmit:
            self.pool.append(readmit)
        for g in new + readmit:
            self._known[g.group_id] = "complete"
        return {"stored": [g.group_id for g in new + readmit], "duplicates": dup}

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> DirectProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
