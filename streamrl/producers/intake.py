"""External producers' intake rules: which submitted groups a run accepts, staleness leases, and
how much admission capacity the external producers hold.

Pure functions and one small state machine (`LeaseBook`); no HTTP, clock, Ray or Lance: time is
an argument. The HTTP service is streamrl/producers/api_app.py; the SDK streamrl/producers/sdk.py.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Annotated

import msgspec
import numpy as np

from streamrl.core import staleness
from streamrl.core import routing
from streamrl.core.types import SampleGroup, number_problem, to_msgpack

PRODUCER_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RESERVED_PREFIX = "rollout-"  # the run's own rollout workers
# Metadata is stored as JSON beside every row and parsed by every reader of the pool: bounded so that
# a producer cannot make the pool slow or impossible to read.
MAX_METADATA_DEPTH = 16
MAX_METADATA_BYTES = 64 * 1024


# Wire bodies of the producer API (streamrl/producers/api_app.py).
class LeaseRequest(msgspec.Struct, forbid_unknown_fields=True):
    producer_id: str
    groups: Annotated[int, msgspec.Meta(ge=1)] = 1


class Submission(msgspec.Struct, forbid_unknown_fields=True):
    lease_id: str
    group: SampleGroup

    def __post_init__(self) -> None:  # checked at decoding, before leases and dedup look at the group
        if (why := metadata_problem(self.group)) is not None:
            raise ValueError(why)


def producer_id_problem(producer_id: str) -> str | None:
    if not PRODUCER_ID.match(producer_id):
        return f"producer_id {producer_id!r} must match {PRODUCER_ID.pattern} (letters, digits, _ . -; 1-64 chars)"
    if producer_id.startswith(RESERVED_PREFIX):
        return f"producer_id {producer_id!r} must not start with {RESERVED_PREFIX!r}: that is the run's rollout workers'"
    return None


def content_sha256(group: SampleGroup) -> str:
    """A group's content hash, the same whether it arrived as JSON or msgpack: what it was stored
    under (metadata["submission_sha256"]) tells a retry from a different group reusing an id.
    Fields the pool sets (producer, created time) are left out."""
    meta = {k: v for k, v in group.metadata.items() if k != "submission_sha256"}
    canon = msgspec.structs.replace(group, producer_id="", created_at=0, metadata=meta)
    return hashlib.sha256(to_msgpack(canon)).hexdigest()


def _depth_over(obj: object, limit: int) -> int | None:
    """How deep `obj` nests, when deeper than `limit` (iterative: no recursion limit to hit)."""
    stack, deepest = [(obj, 1)], 0
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return None


def metadata_problem(group: SampleGroup) -> str | None:
    """Why the group's or a sample's metadata is too deep or too big, or None."""
    for where, meta in (("group.metadata", group.metadata),
                        *((f"group.samples[{i}].metadata", s.metadata) for i, s in enumerate(group.samples))):
        if (depth := _depth_over(meta, MAX_METADATA_DEPTH)) is not None:
            return f"{where} nests more than {MAX_METADATA_DEPTH} levels deep ({depth} at least); flatten it"
        if (size := len(msgspec.json.encode(meta))) > MAX_METADATA_BYTES:
            return f"{where} is {size} bytes as JSON; the limit is {MAX_METADATA_BYTES} (keep large data elsewhere)"
    return None


def check_group(group: SampleGroup, *, producer_id: str, n_samples: int | None, vocab_size: int | None,
                max_tokens: int | None, published_version: int | None,
                experts: tuple[int, int, int] | None = None) -> str | None:
    """Why a decoded group is refused, or None when the run can train on it. A None limit is not
    checked (DirectProducer without a model config or a version). Lengths, masks, span tiling and
    routed experts' row counts were already checked when the group was decoded (streamrl.core.types);
    `experts` (layers, top_k, experts of the model: streamrl.core.routing.experts_of) checks their shape and ids."""
    if (why := metadata_problem(group)) is not None:
        return why
    if not group.group_id.startswith(f"{producer_id}:"):
        return (f"group_id {group.group_id!r} must start with '{producer_id}:' (the producer id), e.g. "
                f"make_group_id({producer_id!r}, epoch, prompt_index)")
    if group.status != "complete":
        return f"status is {group.status!r}; external producers submit finished groups only (status 'complete')"
    for name in ("consumed_step", "consumed_version", "drop_reason"):
        if getattr(group, name) is not None:
            return f"{name} is {getattr(group, name)!r}; it must be null (the learner sets it)"
    indices = sorted(s.index for s in group.samples)
    if n_samples is not None and len(group.samples) != n_samples:
        return f"the group has {len(group.samples)} samples; this run's groups have rollout.n_samples={n_samples}"
    if indices != list(range(len(group.samples))):
        return f"sample indices are {indices}; they must be 0..{len(group.samples) - 1}, each once"
    if len(group.prompt_tokens) == 0:
        return "prompt_tokens is empty"
    if vocab_size is not None and (bad := _bad_token(group.prompt_tokens, vocab_size)):
        return f"prompt_tokens {bad}"
    if all(s.failed for s in group.samples):
        return "every sample is failed; such a group has nothing to train on (do not submit it)"
    for s in sorted(group.samples, key=lambda s: s.index):
        where = f"samples[{s.index}]"
        if vocab_size is not None and (bad := _bad_token(s.response_tokens, vocab_size)):
            return f"{where}.response_tokens {bad}"
        total = len(group.prompt_tokens) + s.num_tokens
        if max_tokens is not None and total > max_tokens:
            return (f"{where}: {len(group.prompt_tokens)} prompt + {s.num_tokens} response tokens = {total} exceed "
                    f"the model's max_position_embeddings={max_tokens}")
        if experts is not None and s.routed_experts is not None and (
                why := routing.shape_problem(s.routed_experts, experts)):
            return f"{where}.routed_experts {why}"
        if any(sp.version < 0 for sp in s.spans):
            return f"{where}.spans has a negative version {min(sp.version for sp in s.spans)}; versions are >= 0"
        if s.failed:
            continue
        if s.num_tokens == 0:
            return f"{where} has no response tokens; every sample that is not failed needs at least one"
        if s.reward is None:
            return f"{where}.reward is None; every sample that is not failed needs a reward"
        if why := number_problem(s.reward):
            return f"{where}.reward {why}"
        if not s.spans:
            return f"{where}.spans is empty; every sample that is not failed needs version spans"
    top = group.max_version
    if published_version is not None and top is not None and top > published_version:
        return (f"version {top} is from the future: the run has published version {published_version} "
                "(generate with a published policy; GET /v1/status says which)")
    return None


def _bad_token(tokens: np.ndarray, vocab_size: int) -> str | None:
    if len(tokens) == 0:
        return None
    out = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if len(out) == 0:
        return None
    i = int(out[0])
    return f"has token id {int(tokens[i])} at position {i}; ids must be in [0, vocab_size={vocab_size})"


def room(version: int, max_staleness: int, groups_per_step: int, shares: int, share_index: int, started: int,
         outstanding: int) -> int:
    """Groups the external producers may still start: their share of the admission capacity at
    learner `version` (streamrl.core.staleness), less the groups they started and the leased slots
    not used yet."""
    total = staleness.admission_capacity(version, max_staleness, groups_per_step)
    return max(0, staleness.capacity_share(total, share_index, shares) - started - outstanding)


class Lease(msgspec.Struct, kw_only=True):
    """`slots` groups a producer may submit until `expires_at` (the service's clock, seconds)."""

    lease_id: str
    producer_id: str
    version: int  # learner version when granted (generate with it or a newer one)
    slots: int
    used: int = 0
    expires_at: float


class LeaseError(Exception):
    """A submission's lease cannot be used; the message says why."""


class LeaseBook:
    """Staleness leases: a producer reserves admission slots before generating, so the groups
    it then submits are within the bound; unused slots return to the capacity on expiry."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}

    def grant(self, producer_id: str, want: int, room: int, version: int, now: float) -> Lease | None:
        self._prune(now)
        slots = min(want, room)
        if slots <= 0:
            return None
        lease = Lease(lease_id=uuid.uuid4().hex, producer_id=producer_id, version=version, slots=slots,
                      expires_at=now + self.lease_s)
        self._leases[lease.lease_id] = lease
        return lease

    def outstanding(self, now: float) -> int:
        return sum(x.slots - x.used for x in self._leases.values() if x.expires_at > now)

    def check(self, lease_id: str, now: float) -> Lease:
        """The lease if one more group may be submitted under it, else LeaseError (nothing is used)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError(f"unknown lease {lease_id!r} (never granted, or granted by a service that has "
                          "restarted since); ask for a new one with POST /v1/leases")
        if lease.expires_at <= now:
            raise LeaseError(f"lease {lease_id} expired {now - lease.expires_at:.1f}s ago (leases last "
                          f"{self.lease_s:g}s); its unused slots went back to the capacity: ask for a new one")
        if lease.used >= lease.slots:
            raise LeaseError(f"lease {lease_id} has used all of its {lease.slots} slots; ask for a new one")
        return lease

    def use(self, lease_id: str, now: float) -> Lease:
        lease = self.check(lease_id, now)
        lease.used += 1
        return lease

    def refund(self, lease_id: str) -> None:
        """Give back a slot whose group was not admitted after all (the pool write failed)."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.used > 0:
            lease.used -= 1

    def _prune(self, now: float) -> None:
        # Expired leases are kept one more lease_s, so a late submission hears "expired", not "unknown".
        for lid in [lid for lid, x in self._leases.items() if x.expires_at + self.lease_s <= now]:
            del self._leases[lid]
