"""Nothing reachable that should not be: the engines and the router want the run's keys (SGLang's
rules, connectors/auth.py), JSON bodies only, weights only from the run's weights directory, and
one request's bad numbers never hurt the others; a 4xx is not retried; pool text output cannot be
turned into markup or terminal escapes."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from streamrl.connectors import auth
from streamrl.connectors.auth import ADMIN_PATHS, Keys, create_private, write_private
from streamrl.connectors.sglang.client import EngineError, SGLangClient, retryable

from enginekit import EngineProc

KEYS = Keys("api-key-for-tests", "admin-key-for-tests")


def _call(url: str, path: str, body: object | None = None, key: str | None = None,
          ctype: str = "application/json") -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": ctype, **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, _body(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read())


def _body(raw: bytes) -> dict:
    try:
        return json.loads(raw) if raw else {}
    except ValueError:  # the router answers some errors in plain text
        return {"text": raw.decode(errors="replace")}


def test_keys_follow_sglangs_rules():
    assert KEYS.for_path("/health") is None and KEYS.for_path("/health_generate") is None
    assert KEYS.for_path("/generate") == KEYS.api and KEYS.for_path("/model_info") == KEYS.api
    assert all(KEYS.for_path(p) == KEYS.admin for p in ADMIN_PATHS)
    assert KEYS.for_path("/workers/abc") == KEYS.admin  # the router's control plane
    assert Keys(api="a").for_path("/pause_generation") == "a"  # no admin key: the API key unlocks control
    assert Keys().allows("/update_weights_from_disk", None)  # no keys: open, as SGLang without --api-key
    assert not KEYS.allows("/generate", "Bearer admin-key-for-tests")  # the admin key is not the API key
    assert not KEYS.allows("/generate", f"Basic {KEYS.api}") and KEYS.allows("/generate", f"bearer {KEYS.api}")


def test_a_private_file_is_replaced_whole_never_truncated_in_place(tmp_path):
    """A reader polling for endpoints.json once read it empty (CI, a two-node run: the file existed,
    its text not yet written). Replaced whole, a reader holding the old file still reads the old text."""
    path = tmp_path / "endpoints.json"
    write_private(path, '{"router_url": "http://old"}')
    with path.open() as before:
        write_private(path, '{"router_url": "http://new"}')
        assert before.read() == '{"router_url": "http://old"}'  # in place, it would read the new text (or none)
    assert path.read_text() == '{"router_url": "http://new"}'
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["endpoints.json"]  # no temporary left beside it


def test_a_private_file_created_twice_keeps_the_first_text_and_both_read_it(tmp_path, monkeypatch):
    """The producer token: of two creators, the second reads the first one's whole token, never an empty file."""
    path = tmp_path / "producer_token"
    seen: list[int] = []
    real_link = auth.os.link

    def link_then_look(src, dst):  # the moment a second creator could look: right as the first one creates
        real_link(src, dst)
        seen.append(len(Path(dst).read_text()))

    monkeypatch.setattr(auth.os, "link", link_then_look)
    assert create_private(path, "first-token") == "first-token"
    assert seen == [len("first-token")]  # the file appeared with its text already in it
    assert create_private(path, "second-token") == "first-token"
    assert path.read_text() == "first-token" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["producer_token"]


@pytest.mark.parametrize("status,again", [(400, False), (401, False), (422, False), (404, False), (408, True),
                                          (429, True), (500, True), (503, True)])
def test_a_4xx_is_not_retried(status: int, again: bool):
    assert retryable(EngineError("http://x", status, "m")) is again
    assert retryable(aiohttp.ClientConnectionError()) and retryable(asyncio.TimeoutError())


@pytest.fixture(scope="module")
def locked_engine(model_dirs, tmp_path_factory):
    """An embedded engine with keys and a weights directory (seed-1 weights inside it)."""
    root = tmp_path_factory.mktemp("run-weights")
    shutil.copytree(model_dirs[1], root / "v000001")
    proc = EngineProc(model_dirs[0], root.parent / "locked-engine.log", env=KEYS.env(),
                      weights_root=str(root)).wait_ready()
    yield proc, root
    proc.stop()


def test_engine_wants_its_keys_and_json(locked_engine):
    eng, _ = locked_engine
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert _call(eng.url, "/health")[0] == 200  # probes need no key
    assert _call(eng.url, "/generate", body)[0] == 401
    assert _call(eng.url, "/generate", body, KEYS.admin)[0] == 401  # the admin key does not generate
    st, out = _call(eng.url, "/generate", body, KEYS.api)
    assert st == 200 and len(out["output_ids"]) == 2
    assert _call(eng.url, "/model_info")[0] == 401
    for path, payload in (("/pause_generation", {"mode": "abort"}), ("/update_weight_version", {"new_version": "9"}),
                          ("/abort_request", {"abort_all": True})):
        st, err = _call(eng.url, path, payload, KEYS.api)  # the API key cannot control
        assert st == 401 and "key" in err["error"]["message"], (path, st, err)
    assert _call(eng.url, "/model_info", key=KEYS.api)[1]["weight_version"] == "0"  # nothing changed
    # A web page can post text/plain or a form without asking first; the engine takes JSON only.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        st, err = _call(eng.url, "/generate", body, KEYS.api, ctype=ctype)
        assert st == 415 and "application/json" in err["error"]["message"], ctype


def test_engine_loads_weights_only_from_the_runs_weights_directory(locked_engine, model_dirs):
    eng, root = locked_engine
    st, out = _call(eng.url, "/update_weights_from_disk", {"model_path": model_dirs[1], "weight_version": "5"},
                    KEYS.admin)
    assert st == 400 and out["success"] is False and "outside this engine's weights directory" in out["message"]
    escape = str(root / ".." / Path(model_dirs[1]).parent.name / Path(model_dirs[1]).name)
    assert _call(eng.url, "/update_weights_from_disk", {"model_path": escape}, KEYS.admin)[0] == 400
    assert _call(eng.url, "/model_info", key=KEYS.api)[1]["weight_version"] == "0"
    st, out = _call(eng.url, "/update_weights_from_disk", {"model_path": str(root / "v000001"), "weight_version": "1"},
                    KEYS.admin)
    assert st == 200 and out["success"] is True, out
    assert _call(eng.url, "/model_info", key=KEYS.api)[1]["weight_version"] == "1"


def test_a_tiny_temperature_is_greedy_not_a_crash(locked_engine):
    eng, _ = locked_engine

    async def main():
        async with SGLangClient(eng.url, keys=KEYS) as c:
            slow = asyncio.ensure_future(c.generate([8, 9, 10], {"max_new_tokens": 40, "temperature": 1.0,
                                                                  "ignore_eos": True}))
            tiny = await c.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 1e-300, "ignore_eos": True})
            greedy = await c.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
            with pytest.raises(EngineError) as nan:
                await c.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": float("inf")})
            return tiny, greedy, nan.value, await slow

    tiny, greedy, nan, slow = asyncio.run(main())
    assert tiny.output_ids == greedy.output_ids
    assert nan.status == 400 and "temperature" in nan.message
    assert slow.finish_type == "length" and len(slow.output_ids) == 40  # the request beside them was not hurt


def test_one_requests_sampling_error_fails_that_request_only(model_dirs):
    """The scheduler: a request whose numbers make sampling raise (a NaN temperature, past the
    server's validation) is finished with its error; the request decoded with it goes on."""
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest

    core = EngineCore(model_dirs[0], max_running=4)
    threading.Thread(target=core.run, daemon=True).start()
    done: dict[str, GenRequest] = {}
    ev = threading.Event()

    def cb(r: GenRequest) -> None:
        done[r.rid] = r
        if len(done) == 2:
            ev.set()

    core.submit(GenRequest(rid="bad", input_ids=[5, 6, 7], max_new_tokens=5, temperature=math.nan, on_done=cb))
    core.submit(GenRequest(rid="good", input_ids=[5, 6, 8], max_new_tokens=5, ignore_eos=True, on_done=cb))
    assert ev.wait(60)
    core.stop()
    assert done["bad"].error and "sampling failed" in done["bad"].error and done["bad"].finish["type"] == "abort"
    assert done["good"].error is None and len(done["good"].output_ids) == 5


@pytest.mark.parametrize("keys", [KEYS, Keys("-starts-like-an-option", "-admin"), Keys.new()],
                         ids=["plain", "leading-dash", "fresh"])
def test_router_wants_the_keys_and_never_shows_them(tmp_path, keys):
    from streamrl.connectors.sglang.router import Router

    router = Router(keys=keys, log_dir=tmp_path).start()
    try:
        cmdline = Path(f"/proc/{router.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert keys.api not in cmdline and keys.admin not in cmdline  # `ps` shows command lines to everyone
        assert _call(router.url, "/generate", {"input_ids": [1]})[0] == 401
        assert _call(router.url, "/workers", key=keys.api)[0] == 401  # the control plane wants the admin key
        assert _call(router.url, "/workers", key=keys.admin)[0] == 200
        assert asyncio.run(_list(router)) == []
    finally:
        router.stop()


async def _list(router) -> list:
    try:
        return await router.list_workers()
    finally:
        await router.client.close()


def test_pool_text_output_is_plain_text(tmp_path, capsys):
    """Group ids come from external producers: markup or escape sequences in them are shown, not run."""
    from streamrl.core.types import Admission, Sample, SampleGroup, VersionSpan
    from streamrl.pools import LancePool
    from streamrl.tools.cli import main

    from poolkit import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path / "tokenizer.json")
    ids = ["ext:[/]", "ext:[bold red]x", "ext:\x1b[2J\x1b[31mred", "ext:" + "y" * 500]
    with LancePool(tmp_path / "pool") as pool:
        pool.admit([Admission(group_id=g, prompt_id="p", n=1, producer_id="ext") for g in ids])
        pool.append([SampleGroup(group_id=g, prompt_id="p", prompt_tokens=tok.encode("1+1=").ids, producer_id="ext",
                                 samples=[Sample(index=0, response_tokens=[5], rollout_logprobs=[-0.1],
                                                 spans=[VersionSpan(0, 0, 1)], reward=1.0)]) for g in ids])
    assert main(["pool", "query", str(tmp_path), "SELECT group_id FROM pool ORDER BY group_id"]) == 0
    out = capsys.readouterr().out
    assert "ext:[/]" in out and "ext:[bold red]x" in out and "\x1b" not in out and "\\x1b[2J" in out
    assert main(["pool", "show", str(tmp_path), "ext:\x1b[2J\x1b[31mred"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "group ext:\\x1b[2J\\x1b[31mred" in out


def test_a_refused_request_is_not_sent_again(locked_engine, model_dirs):
    """An engine's 4xx says the request itself is wrong (here: no key): the episode fails at once
    instead of resubmitting it 30 times."""
    from transformers import AutoTokenizer

    from streamrl.producers.episode import Episode, EpisodeError

    eng, _ = locked_engine

    async def main():
        async with SGLangClient(eng.url) as c:  # no keys
            ep = Episode(c, AutoTokenizer.from_pretrained(model_dirs[0]), sampling={"temperature": 1.0},
                         max_new_tokens=4, max_context=64)
            ep.observe([5, 6, 7])
            with pytest.raises(EpisodeError, match="401"):
                await ep.generate()
            return ep.stats

    assert asyncio.run(main())["engine_errors"] == 1
