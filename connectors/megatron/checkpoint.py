"""Learner checkpoints: model + optimizer + scheduler + RNG + policy version, saved atomically
(the HF export, written with the same atomic directory install, is connectors/megatron/hf_export.py).

Layout under a checkpoint root:

    <root>/latest                  "step_00000004\\n": the newest complete checkpoint
    <root>/step_00000004/
        sharded/                   megatron dist_checkpointing, torch_dist format:
            __<rank>_0.distcp      the tensors rank <rank> wrote: its shards of the parameters and
                                   of Adam's exp_avg / exp_avg_sq (one writer per shard)
            .metadata              torch.distributed.checkpoint's index of every shard (a pickle)
            common.pt              scheduler state and optimizer param groups (rank 0)
            metadata.json          megatron's format tag
        rng/rank_<rank>.pt         each rank's python / numpy / torch (+ CUDA) RNG states
        meta.json                  policy version, the caller's `extra`, the layout (world, tp, pp, ep,
                                   dp), Adam's common step, library versions
        manifest.json              size + sha256 of every file above, and a digest of itself

One format for every layout, one process included (one code path, and a single-process
checkpoint then loads at tp=2 with nothing to convert): a checkpoint saved with any tensor /
pipeline / data / expert-parallel layout loads into any other (tp2 -> tp1, dp2 -> dp1, pp2 -> pp1, ep2 -> ep1,
1 -> 2), because every tensor is stored by its global shape and offsets
(connectors/megatron/sharded.py). RNG states are per rank: restored where the layout matches,
otherwise every rank takes rank 0's python / numpy / torch CPU states (with a warning).
Small files go through `torch.save` of tensors and Python scalars, read back with
`torch.load(weights_only=True)`; the DCP `.metadata` pickle is read first by an unpickler that
admits only its metadata classes, so a tampered run directory cannot run code on load (the
manifest's sha256 guards against damage, not tampering: whoever can rewrite a file can
rewrite the manifest).

Ranks. With world size > 1 `save_checkpoint` / `load_checkpoint` are collective: every rank
calls them at once. Each rank writes its own shards and RNG file; rank 0 alone creates the
temporary directory, writes meta.json and the manifest, renames, and moves `latest`, between
collectives that pass its outcome (or its error) to every rank, so all return the same value or
raise. Hashing (save) and verification (load) are split across the ranks. The root must be
one filesystem every rank sees. Without torch.distributed (no learner) only verification runs.

Atomicity. A checkpoint is written into a temporary sibling `<root>/.tmp-step_...`, every
file and the directory are fsynced, then the directory is renamed to `step_<version>` (one
atomic rename), the root is fsynced, and `latest` is replaced atomically (temp file + fsync +
rename + fsync of the root). A crash at any point leaves `latest` naming either the previous
complete checkpoint or the new complete one; leftovers (`.tmp-*`, `.trash-*`) are ignored by
`load_checkpoint` and removed by the next `save_checkpoint`. One learner per root is assumed
(its rank 0 runs the directory protocol). Re-saving an existing version swaps the directories with
renameat2(RENAME_EXCHANGE) where the kernel and filesystem allow it; elsewhere the old one is
moved aside first, and a crash in that short window makes `load_checkpoint` fall back to the
newest complete checkpoint it finds.

Damage. `load_checkpoint` checks every file against the manifest (presence, size, sha256)
before touching the learner and raises `CheckpointError` naming the file; the learner is
restored only from a checkpoint that verified completely.

Long file: atomic save, collective load and retention share one on-disk layout and its crash points.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from streamrl.connectors.megatron import sharded as ms

T = TypeVar("T")

FORMAT = "streamrl-mcore-checkpoint/2"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"

# Test seam: called with the name of each stage of a save ("files", "synced", "renamed",
# "latest_tmp", "latest", "retention"); tests set it to SIGKILL the process at that moment.
_crash_point: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged (the message names the file)."""


def step_dir_name(version: int) -> str:
    return f"step_{version:08d}"


# ---------------------------------------------------------------- filesystem helpers


def _at(stage: str) -> None:
    if _crash_point is not None:
        _crash_point(stage)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def tmp_sibling(path: Path) -> Path:
    """A name beside `path` for writing what becomes `path` (`clean_leftovers` knows it: pid and a nonce)."""
    return path.with_name(f"{_TMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: temp file + fsync + rename + fsync of the directory."""
    tmp = tmp_sibling(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _at("latest_tmp")
    os.replace(tmp, path)
    fsync_path(path.parent)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_dir(path: Path) -> None:
    """Rename aside (one atomic step that makes it invisible), then delete."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_path(path.parent)
    _at("retention")
    shutil.rmtree(trash, ignore_errors=True)


def install_dir(tmp: Path, final: Path) -> None:
    """Put the complete directory `tmp` at `final` atomically (replacing one that exists)."""
    old = None
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif _rename_exchange(tmp, final):
        old = tmp  # now holds the replaced contents
    else:  # no RENAME_EXCHANGE: a short window without `final` (see _resolve)
        old = final.with_name(f"{_TRASH_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers from an earlier failed save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(directory: Path, name: str | None = None) -> None:
    """Remove `.tmp-*` / `.trash-*` entries left by crashed saves (not a live process's);
    with `name`, only those of that entry (`.tmp-<name>-...`)."""
    stem = f"{name}-" if name else ""
    for p in directory.iterdir():
        if not p.name.startswith((_TMP_PREFIX + stem, _TRASH_PREFIX + stem)):
            continue
        m = re.search(r"-(\d+)-[0-9a-f]{8}$", p.name)
        if m and _pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


# ---------------------------------------------------------------- manifest


def _manifest_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _files(d: Path) -> list[str]:
    """Every file under `d` (relative names), the manifest excepted."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(d: Path, version: int, names: list[str], hashed: dict[str, dict] | None = None) -> None:
    hashed = hashed or {}
    body = {"format": FORMAT, "version": version,
            "files": {n: hashed.get(n) or {"size": (d / n).stat().st_size, "sha256": _sha256(d / n)} for n in names}}
    with open(d / MANIFEST, "w") as f:
        json.dump({**body, "digest": _manifest_digest(body)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(d: Path) -> dict[str, Any]:
    mpath = d / MANIFEST
    if not d.is_dir():
        raise CheckpointError(f"checkpoint {d}: not a directory")
    try:
        manifest = json.loads(mpath.read_text())
        body = {k: v for k, v in manifest.items() if k != "digest"}
        ok = manifest.get("digest") == _manifest_digest(body)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {d}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {d}: {MANIFEST} is damaged ({mpath}): {e}") from None
    if not ok:
        raise CheckpointError(f"checkpoint {d}: {MANIFEST} is damaged ({mpath}): digest mismatch")
    if manifest.get("format") != FORMAT:
        old = " (a single-process checkpoint from before sharded checkpoints; it is no longer read)" \
            if manifest.get("format") == "streamrl-mcore-checkpoint/1" else ""
        raise CheckpointError(f"checkpoint {d}: {MANIFEST}: unknown format {manifest.get('format')!r}{old}")
    return manifest


def _check_files(d: Path, manifest: dict[str, Any], names: list[str], checksums: bool) -> None:
    for name in names:
        want, f = manifest["files"][name], d / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {d}: file {name} is missing ({f})")
        size = f.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"checkpoint {d}: file {name} is damaged ({f}): "
                                  f"{size} bytes, manifest says {want['size']}")
        if checksums and _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {d}: file {name} is damaged ({f}): sha256 mismatch")


def verify_checkpoint(path: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Check a step directory against its manifest; returns the manifest or raises
    `CheckpointError` naming the first missing / wrong-size / wrong-checksum file."""
    d = Path(path)
    manifest = _read_manifest(d)
    _check_files(d, manifest, sorted(manifest["files"]), checksums)
    return manifest


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(version, path) of the `step_*` directories under root, oldest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` names, or None when there is no `latest` yet."""
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    if not _STEP_RE.match(name):
        raise CheckpointError(f"checkpoint root {root}: {LATEST} is damaged ({root / LATEST}): {name[:80]!r}")
    return root / name


# ---------------------------------------------------------------- ranks acting together


def _group() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    lay = ms.layout()
    return lay["rank"], lay["world"]


def _on_rank0(fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 alone; every rank returns its result, or raises (rank 0 its own error,
    the others a CheckpointError quoting it), so no rank waits for one that gave up."""
    rank, world = _group()
    res: Any = None
    err: BaseException | None = None
    if rank == 0:
        try:
            res = fn()
        except BaseException as e:
            err = e
    if world > 1:
        box = [(res, None if err is None else f"{type(err).__name__}: {err}")]
        dist.broadcast_object_list(box, src=0)
        res, msg = box[0]
        if msg is not None and rank != 0:
            raise CheckpointError(f"rank 0 failed: {msg}")
    if err is not None:
        raise err
    return res


def _on_every_rank(fn: Callable[[int, int], T], gather: bool = False) -> Any:
    """`fn(rank, world)` on every rank; returns this rank's result (`gather`: every rank's, in
    rank order), or, when any rank failed, every rank raises the error of the lowest one."""
    rank, world = _group()
    res: Any = None
    err: BaseException | None = None
    try:
        res = fn(rank, world)
    except BaseException as e:
        err = e
    if world == 1:
        if err is not None:
            raise err
        return [res] if gather else res
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (res if gather else None, None if err is None else f"{type(err).__name__}: {err}"))
    failed = [(r, m) for r, (_, m) in enumerate(every) if m is not None]
    if failed:
        if err is not None and failed[0][0] == rank:
            raise err
        r, msg = failed[0]
        raise CheckpointError(msg.removeprefix("CheckpointError: ") if msg.startswith("CheckpointError")
                              else f"rank {r} failed: {msg}")
    return [v for v, _ in every] if gather else res


def _hash_share(d: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size + sha256 of every file, each rank fsyncing and hashing its share of them."""
    def share(rank: int, world: int) -> dict[str, dict[str, Any]]:
        out = {}
        for n in names[rank::world]:
            fsync_path(d / n)
            out[n] = {"size": (d / n).stat().st_size, "sha256": _sha256(d / n)}
        return out

    return {k: v for part in _on_every_rank(share, gather=True) for k, v in part.items()}


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sharded learner checkpoints need torch.distributed (init_single_process() "
                           "for one process, init_distributed() for each rank)")


# ---------------------------------------------------------------- save / load


def _rng_name(rank: int) -> str:
    return f"rng/rank_{rank:05d}.pt"


def save_checkpoint(learner: Any, root: str | Path, extra: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Write `<root>/step_<learner.version:08d>/` atomically and point `<root>/latest` at it.

    Collective with more than one rank: every rank calls it at once, each writes its own
    shards and RNG state, rank 0 alone runs the directory protocol; all return the same path.
    `extra` (JSON-serialisable, e.g. the data cursor) comes back from `load_checkpoint`.
    `keep_last`: afterwards delete all but the newest `keep_last` checkpoints (by version;
    the one `latest` names is always kept). Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing

    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    _require_process_group()
    lay = ms.layout()
    version = int(learner.version)
    opt_common = ms.optimizer_common(learner.opt)
    meta = {"version": version, "extra": extra or {}, "saved_at": time.time(), "torch": torch.__version__,
            "model_class": type(learner.model).__name__, "layout": {k: lay[k] for k in ("world", "tp", "pp", "dp", "ep")},
            "optimizer": {k: opt_common[k] for k in ("step", "state_keys")}}
    meta_text = json.dumps(meta, indent=1, sort_keys=True)  # fail before writing anything if not JSON

    def state() -> dict[str, Any]:
        model = ms.model_sharded(learner.model)
        return {"model": model, "optimizer": ms.optimizer_sharded(learner.opt, model, opt_common),
                "optimizer_groups": opt_common["param_groups"], "scheduler": learner.opt.scheduler_state()}

    sharded = _on_every_rank(lambda r, w: state())
    root = Path(root)
    final = root / step_dir_name(version)

    def begin() -> str:
        root.mkdir(parents=True, exist_ok=True)
        clean_leftovers(root)
        tmp = tmp_sibling(final)
        (tmp / "sharded").mkdir(parents=True)
        (tmp / "rng").mkdir()
        return str(tmp)

    tmp = Path(_on_rank0(begin))
    try:
        dist_checkpointing.save(sharded, str(tmp / "sharded"), sharded_strategy=ms.save_strategy())
        del sharded
        _on_every_rank(lambda r, w: torch.save(ms.rng_state(), tmp / _rng_name(r)))
        def listing() -> list[str]:
            (tmp / "meta.json").write_text(meta_text)
            return _files(tmp)

        names = _on_rank0(listing)
        hashed = _hash_share(tmp, names)

        def finish() -> str:
            _at("files")
            for sub in ("sharded", "rng", "."):
                fsync_path(tmp / sub)
            _write_manifest(tmp, version, names, hashed)  # last: its presence marks a complete directory
            fsync_path(tmp)
            _at("synced")
            install_dir(tmp, final)
            return str(final)

        _on_rank0(finish)
    except BaseException:
        if lay["rank"] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    def publish() -> str:
        _at("renamed")
        _write_text_atomic(root / LATEST, final.name + "\n")
        _at("latest")
        if keep_last is not None:
            for _, p in list_checkpoints(root)[:-keep_last]:
                if p.name != final.name:
                    _remove_dir(p)
        return str(final)

    return Path(_on_rank0(publish))


def _resolve(root: Path, step: int | None) -> Path:
    if (root / MANIFEST).exists() or _STEP_RE.match(root.name):
        if step is not None and root.name != step_dir_name(step):
            raise CheckpointError(f"{root} is the checkpoint of another step than {step}")
        return root  # a step directory itself
    if step is not None:
        d = root / step_dir_name(step)
        if not d.is_dir():
            have = ", ".join(str(v) for v, _ in list_checkpoints(root)) or "none"
            raise CheckpointError(f"checkpoint root {root}: no checkpoint for step {step} (have: {have})")
        return d
    d = latest_checkpoint(root)
    if d is None:
        raise CheckpointError(f"checkpoint root {root}: no {LATEST} file (no checkpoint saved)")
    if d.is_dir():
        return d
    # only a crash while re-saving an existing version on a filesystem without
    # RENAME_EXCHANGE leaves `latest` naming nothing: take the newest complete checkpoint
    for _, p in reversed(list_checkpoints(root)):
        with contextlib.suppress(CheckpointError):
            verify_checkpoint(p)
            warnings.warn(f"{root / LATEST} names missing {d.name}; loading {p.name}", stacklevel=3)
            return p
    raise CheckpointError(f"checkpoint root {root}: {LATEST} names {d.name}, which does not exist")


def _read(d: Path, name: str, fn: Callable[[Path], T]) -> T:
    try:
        return fn(d / name)
    except Exception as e:  # verified but unreadable: a writer bug, a format change, or tampering
        raise CheckpointError(f"checkpoint {d}: file {name} cannot be read: {e}") from e


def _verified(d: Path, checksums: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Every rank checks its share of the files against the manifest, then reads what is read
    before megatron's loader: (manifest, meta, this rank's RNG state). Nothing that could
    run code is read (see connectors/megatron/sharded.py)."""
    manifest = _on_every_rank(lambda r, w: _read_manifest(d))
    names = sorted(manifest["files"])
    _on_every_rank(lambda r, w: _check_files(d, manifest, names[r::w], checksums))

    def read(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
        meta = _read(d, "meta.json", lambda p: json.loads(p.read_text()))
        if meta["version"] != manifest["version"] or (_STEP_RE.match(d.name) and int(d.name[5:]) != meta["version"]):
            raise CheckpointError(f"checkpoint {d}: meta.json version {meta['version']} does not match the directory")
        _read(d, "sharded/.metadata", ms.check_dcp_metadata)
        _read(d, "sharded/common.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
        lay, saved = ms.layout(), meta["layout"]
        same = all(lay[k] == saved.get(k, 1) for k in ("world", "tp", "pp", "dp", "ep"))  # ep: 1 before MoE
        rng = _read(d, _rng_name(rank if same else 0),
                    lambda p: torch.load(p, map_location="cpu", weights_only=True))
        return meta, {"state": rng, "same_layout": same}

    meta, rng = _on_every_rank(read)
    return manifest, meta, rng


def load_checkpoint(learner: Any, root: str | Path, step: int | None = None, checksums: bool = True) -> dict:
    """Restore model, optimizer, scheduler, RNG and `learner.version` from the checkpoint
    `latest` names (or `step`; `root` may also be a step directory), whatever the tensor /
    pipeline / data-parallel layout it was saved with. Collective with more than one rank.
    Verifies every file against the manifest first and raises `CheckpointError` naming a
    damaged one; the learner is untouched unless everything verified and read. Returns the
    saved `extra`."""
    d = Path(_on_rank0(lambda: str(_resolve(Path(root), step))))
    _, meta, rng = _verified(d, checksums)
    _require_process_group()
    from megatron.core import dist_checkpointing

    saved_lay = meta["layout"]
    opt_common = {**meta["optimizer"]}

    def read(rank: int, world: int) -> dict[str, Any]:
        model = ms.model_sharded(learner.model)
        optimizer = ms.optimizer_sharded(learner.opt, model, opt_common, template=True)
        template = {"model": ms.detach_template(model), "optimizer": optimizer}
        try:
            return dist_checkpointing.load(template, str(d / "sharded"))
        except Exception as e:
            raise CheckpointError(f"checkpoint {d}: sharded state cannot be read: {e}") from e

    loaded = _on_every_rank(read)
    missing, unexpected = learner.model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {d}: model state does not match: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    ms.load_optimizer(learner.opt, loaded.get("optimizer", {}), opt_common)
    learner.opt.load_scheduler_state(loaded["scheduler"])
    learner.version = int(meta["version"])
    ms.set_rng_state(rng["state"], process_only=not rng["same_layout"])
    if not rng["same_layout"] and _group()[0] == 0:
        now = {k: v for k, v in ms.layout().items() if k != "rank"}
        warnings.warn(f"checkpoint {d} was saved with layout {saved_lay}, loaded with {now}: every rank took "
                      "rank 0's python / numpy / torch CPU RNG state; device and model-parallel RNG states "
                      "were not restored", stacklevel=2)
    return meta["extra"]
