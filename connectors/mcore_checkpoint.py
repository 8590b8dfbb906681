"""Learner checkpoints: model + optimizer + scheduler + RNG + policy version, saved atomically;
and an HF `save_pretrained` export of the current weights.

Layout under a checkpoint root:

    <root>/latest                  "step_00000004\\n": the newest complete checkpoint
    <root>/step_00000004/
        model.safetensors          the megatron state dict's tensors (megatron names)
        model_extra.pt             its non-tensor entries (megatron `_extra_state`s, None on CPU)
        optimizer.pt               torch.optim state_dict
        scheduler.pt               LR scheduler state_dict
        rng.pt                     torch CPU (+ CUDA, megatron tracker) / python random / numpy states
        meta.json                  policy version, the caller's `extra`, library versions
        manifest.json              size + sha256 of every file above, and a digest of itself

Weights go to safetensors (no pickle, mmap-able, readable by any tool); the optimizer,
scheduler and RNG states are nested dicts of tensors and Python scalars, which `torch.save`
stores as is and `torch.load(weights_only=True)` reads back without running pickled code.

Atomicity. A checkpoint is written into a temporary sibling `<root>/.tmp-step_...`, every
file and the directory are fsynced, then the directory is renamed to `step_<version>` (one
atomic rename), the root is fsynced, and `latest` is replaced atomically (temp file + fsync +
rename + fsync of the root). A crash at any point leaves `latest` naming either the previous
complete checkpoint or the new complete one; leftovers (`.tmp-*`, `.trash-*`) are ignored by
`load_checkpoint` and removed by the next `save_checkpoint`. One writer per root is assumed
(the learner process). Re-saving an existing version swaps the directories with
renameat2(RENAME_EXCHANGE) where the kernel and filesystem allow it; elsewhere the old one is
moved aside first, and a crash in that short window makes `load_checkpoint` fall back to the
newest complete checkpoint it finds.

Damage. `load_checkpoint` checks every file against the manifest (presence, size, sha256)
before touching the learner and raises `CheckpointError` naming the file; the learner is
restored only from a checkpoint that verified completely.

Single process only (world size 1, as the CPU learner runs): sharded tensor-/pipeline-parallel
state would need one file set per rank.

Long file: atomic save, load, retention and the HF export share one on-disk layout and its crash points.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FORMAT = "streamrl-mcore-checkpoint/1"
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


def _fsync_path(path: Path) -> None:
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


def _write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: temp file + fsync + rename + fsync of the directory."""
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _at("latest_tmp")
    os.replace(tmp, path)
    _fsync_path(path.parent)


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
    _fsync_path(path.parent)
    _at("retention")
    shutil.rmtree(trash, ignore_errors=True)


def _install_dir(tmp: Path, final: Path) -> None:
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
    _fsync_path(final.parent)
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


def _clean_leftovers(directory: Path, name: str | None = None) -> None:
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


def _write_manifest(d: Path, version: int, names: list[str]) -> None:
    body = {"format": FORMAT, "version": version,
            "files": {n: {"size": (d / n).stat().st_size, "sha256": _sha256(d / n)} for n in names}}
    with open(d / MANIFEST, "w") as f:
        json.dump({**body, "digest": _manifest_digest(body)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Check a step directory against its manifest; returns the manifest or raises
    `CheckpointError` naming the first missing / wrong-size / wrong-checksum file."""
    d = Path(path)
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
        raise CheckpointError(f"checkpoint {d}: {MANIFEST}: unknown format {manifest.get('format')!r}")
    for name, want in manifest["files"].items():
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {d}: file {name} is missing ({f})")
        size = f.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"checkpoint {d}: file {name} is damaged ({f}): "
                                  f"{size} bytes, manifest says {want['size']}")
        if checksums and _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {d}: file {name} is damaged ({f}): sha256 mismatch")
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


# ---------------------------------------------------------------- state capture / restore


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
        with contextlib.suppress(Exception):
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
            if all(isinstance(v, torch.Tensor) for v in tracker.values()):
                state["megatron_tracker"] = {k: v.cpu() for k, v in tracker.items()}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if torch.cuda.is_available() and "cuda" in state:
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(f"checkpoint has CUDA RNG states for {len(cuda)} devices, this process sees "
                          f"{torch.cuda.device_count()}: CUDA RNG not restored", stacklevel=3)
        if "megatron_tracker" in state:
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _split_model_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, Any] = {}
    seen: set[int] = set()
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu()
            key = t.untyped_storage().data_ptr()
            if (t.numel() and key in seen) or not t.is_contiguous():  # safetensors refuses shared storage
                t = t.clone(memory_format=torch.contiguous_format)
            seen.add(key)
            tensors[k] = t
        elif isinstance(v, io.BytesIO):  # TransformerEngine's `_extra_state`: bytes, kept as a tensor
            other[k] = {_BYTES_KEY: torch.frombuffer(bytearray(v.getvalue()), dtype=torch.uint8)}
        else:
            other[k] = v
    return tensors, other


_BYTES_KEY = "__bytes__"  # marks a BytesIO saved as a uint8 tensor, so loading needs no pickle


def _restore_bytes(state: dict[str, Any]) -> dict[str, Any]:
    return {k: io.BytesIO(v[_BYTES_KEY].numpy().tobytes()) if isinstance(v, dict) and _BYTES_KEY in v else v
            for k, v in state.items()}


def _check_single_process() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise NotImplementedError("mcore_checkpoint saves a single-process learner (world size 1); "
                                  "model-parallel ranks need per-rank shards")


# ---------------------------------------------------------------- save / load


def save_checkpoint(learner: Any, root: str | Path, extra: dict | None = None,
                    keep_last: int | None = None) -> Path:
    """Write `<root>/step_<learner.version:08d>/` atomically and point `<root>/latest` at it.

    `extra` (JSON-serialisable, e.g. the data cursor) comes back from `load_checkpoint`.
    `keep_last`: afterwards delete all but the newest `keep_last` checkpoints (by version;
    the one `latest` names is always kept). Returns the checkpoint directory."""
    from safetensors.torch import save_file

    _check_single_process()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    version = int(learner.version)
    meta = {"version": version, "extra": extra or {}, "saved_at": time.time(),
            "torch": torch.__version__, "model_class": type(learner.model).__name__}
    meta_text = json.dumps(meta, indent=1, sort_keys=True)  # fail before writing anything if not JSON
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    final = root / step_dir_name(version)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors, other = _split_model_state(learner.model)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
        del tensors
        torch.save(other, tmp / "model_extra.pt")
        _at("files")
        torch.save(learner.opt.state_dict(), tmp / "optimizer.pt")
        torch.save(learner.sched.state_dict(), tmp / "scheduler.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "meta.json").write_text(meta_text)
        names = ["model.safetensors", "model_extra.pt", "optimizer.pt", "scheduler.pt", "rng.pt", "meta.json"]
        for n in names:
            _fsync_path(tmp / n)
        _write_manifest(tmp, version, names)  # last: its presence marks a complete directory
        _fsync_path(tmp)
        _at("synced")
        _install_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _at("renamed")
    _write_text_atomic(root / LATEST, final.name + "\n")
    _at("latest")
    if keep_last is not None:
        for _, p in list_checkpoints(root)[:-keep_last]:
            if p.name != final.name:
                _remove_dir(p)
    return final


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


def load_checkpoint(learner: Any, root: str | Path, step: int | None = None, checksums: bool = True) -> dict:
    """Restore model, optimizer, scheduler, RNG and `learner.version` from the checkpoint
    `latest` names (or `step`; `root` may also be a step directory). Verifies every file
    against the manifest first and raises `CheckpointError` naming a damaged one; the
    learner is untouched unless everything verified and read. Returns the saved `extra`."""
    from safetensors.torch import load_file

    _check_single_process()
    d = _resolve(Path(root), step)
    manifest = verify_checkpoint(d, checksums)

    def read(name: str, fn: Callable[[Path], Any]) -> Any:
        try:
            return fn(d / name)
        except Exception as e:  # verified but unreadable: a writer bug or a format change
            raise CheckpointError(f"checkpoint {d}: file {name} cannot be read: {e}") from e

    meta = read("meta.json", lambda p: json.loads(p.read_text()))
    if meta["version"] != manifest["version"] or (_STEP_RE.match(d.name) and int(d.name[5:]) != meta["version"]):
        raise CheckpointError(f"checkpoint {d}: meta.json version {meta['version']} does not match the directory")
    model_sd: dict[str, Any] = read("model.safetensors", lambda p: load_file(str(p), device="cpu"))

    # weights_only everywhere: a tampered run directory must not run code on --resume or replay.
    model_sd.update(read("model_extra.pt", lambda p: _restore_bytes(torch.load(p, map_location="cpu",
                                                                                weights_only=True))))
    opt_sd = read("optimizer.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
    sched_sd = read("scheduler.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
    rng = read("rng.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))

    learner.model.load_state_dict(model_sd, strict=True)
    learner.opt.load_state_dict(opt_sd)
    learner.sched.load_state_dict(sched_sd)
    learner.version = int(meta["version"])
    _set_rng_state(rng)
    return meta["extra"]


# ---------------------------------------------------------------- HF export

_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                    "chat_template.*", "*.tiktoken", "generation_config.json")


def export_hf(learner: Any, base_model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the learner's current weights as an HF `save_pretrained` directory (config from
    `base_model_dir`, its tokenizer and generation config copied), atomically: a temporary
    sibling directory renamed into place (replacing an existing `out_dir`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base, out = Path(base_model_dir), Path(out_dir)
    sd = learner.hf_state_dict()
    cfg = AutoConfig.from_pretrained(str(base))
    dtype = next((t.dtype for t in sd.values() if t.is_floating_point()), torch.float32)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    expected = set(model.state_dict())
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    unexpected = sorted(set(sd) - expected)
    missing = sorted(expected - set(sd) - ({"lm_head.weight"} if tied else set()))
    if unexpected or missing:
        raise ValueError(f"learner weights do not match {type(model).__name__} from {base}: "
                         f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    model.load_state_dict(sd, strict=False)
    if tied:
        model.tie_weights()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb.data_ptr() != head.data_ptr():
            raise RuntimeError("tie_word_embeddings is set but lm_head is not tied to the embedding")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(out.parent, out.name)  # only this export's leftovers: the parent may be shared
    tmp = out.with_name(f"{_TMP_PREFIX}{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(str(tmp))
        for pattern in _TOKENIZER_FILES:
            for f in base.glob(pattern):
                if f.is_file():
                    shutil.copy2(f, tmp / f.name)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_path(f)
        _fsync_path(tmp)
        _install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
