"""Which cached prefix a generation may reuse: none computed under older weights.

An `in_place` weight update swaps the weights under running requests without flushing SGLang's
radix cache (SGLang refuses to flush while requests run), so prefix KV computed under version
v-1 stays matchable. Every request therefore names the cache namespace of the newest version
its client has seen (SGLang's `extra_key`; `cache_key`): entries made under v-1 never match a
request keyed v, and age out of SGLang's LRU cache. What the key cannot cover is a request keyed
with the version before an update it then ran under (sent during the pause, or before its
client saw a token of the new version): `reused_older_prefix` finds those from the response,
and the client sends them again under a fresh key.

Why an observed version is safe as the key: the broadcaster resumes engines only after every
engine took the update, so a client that has seen a token of version v talks to engines at v or
later; and versions only go up, so an entry keyed v holds KV computed under v alone by the time
a request prefilled under v matches it.
"""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.core.types import VersionSpan


def cache_key(version: int) -> str:
    return f"v{version}"


def reused_older_prefix(key_version: int, spans: Sequence[VersionSpan], cached_tokens: int) -> bool:
    """True when a request keyed `key_version` started generating under a newer version (`spans`,
    the versions of its output) and took part of its prompt from the cache: that part was made
    under `key_version` or earlier, i.e. by older weights than the tokens it led to."""
    return cached_tokens > 0 and bool(spans) and spans[0].version != key_version


def newest(spans: Sequence[VersionSpan], seen: int) -> int:
    """The newest version seen so far, after a response with these spans."""
    return max([seen, *(s.version for s in spans)])
