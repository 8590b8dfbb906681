"""Per-run keys for the engines and the router, with SGLang's rules (sglang 0.5.23
`srt/utils/auth.py`, `decide_request_auth`), so the same keys work for real SGLang
(`--api-key`, `--admin-api-key`), the sglang-router (`--api-key`, `--control-plane-api-keys`) and
the embedded engine:

- `/health*`, `/ready*` and `/metrics*` need no key (probes);
- control endpoints (weights, pause, abort, flush, ...) need the admin key when one is set, else
  the API key;
- every other endpoint (generate, chat, model and server info) needs the API key when one is set.

A run holds two keys: the API key lets a client generate (rollout workers, external producers),
the admin key lets the driver control engines and register router workers. Keys are compared in
constant time and never put on a command line (`ps` shows command lines to every local user).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import msgspec

API_KEY_ENV, ADMIN_KEY_ENV = "STREAMRL_API_KEY", "STREAMRL_ADMIN_KEY"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
# SGLang's control endpoints (marked AuthLevel.ADMIN_OPTIONAL in its http_server.py), as far as
# StreamRL uses them or the embedded engine serves them.
ADMIN_PATHS = frozenset({
    "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation", "/abort_request",
    "/pause_generation", "/continue_generation", "/set_internal_state", "/configure_logging",
    "/begin_weight_update", "/end_weight_update",
})
ROUTER_ADMIN_PREFIX = "/workers"  # the sglang-router's control plane (its --control-plane-api-keys)


class Keys(msgspec.Struct, frozen=True):
    """A run's engine and router keys (None: no key, as an SGLang server started without one)."""

    api: str | None = None
    admin: str | None = None

    @staticmethod
    def new() -> Keys:
        return Keys(secrets.token_hex(32), secrets.token_hex(32))

    @staticmethod
    def from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> Keys:
        return Keys(env.get(API_KEY_ENV) or None, env.get(ADMIN_KEY_ENV) or None)

    def env(self) -> dict[str, str]:
        """The keys as environment variables, for a child process (see `from_env`)."""
        return {k: v for k, v in ((API_KEY_ENV, self.api), (ADMIN_KEY_ENV, self.admin)) if v}

    def for_path(self, path: str) -> str | None:
        """The key a client sends for `path` (None: send none)."""
        path = path.split("?", 1)[0]
        if path.startswith(OPEN_PREFIXES):
            return None
        if path in ADMIN_PATHS or path.startswith(ROUTER_ADMIN_PREFIX):
            return self.admin or self.api
        return self.api

    def allows(self, path: str, authorization: str | None) -> bool:
        """Whether a request to `path` with this Authorization header may proceed."""
        want = self.for_path(path)
        if want is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), want.encode())


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _private_temp(path: Path, text: str) -> Path:
    """`text` in a new file beside `path`, mode 0600 from the start (not chmod-ed after)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return tmp


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Write a file only its owner can read. Written beside it and renamed over it: a reader polling for
    the file (a test, an external producer, the producer API) sees no file or the whole text, never an
    empty or half-written one."""
    path = Path(path)
    tmp = _private_temp(path, text)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_private(path: str | os.PathLike[str], text: str) -> str:
    """Create `path` (mode 0600) holding `text` unless it exists; return what the file holds. Linked into
    place whole, so of several processes creating it at once one wins and every one reads the winner's text
    (an O_EXCL create would let the others read it before its owner had written)."""
    path = Path(path)
    tmp = _private_temp(path, text)
    try:
        os.link(tmp, path)
        return text
    except FileExistsError:
        return path.read_text()
    finally:
        tmp.unlink(missing_ok=True)
