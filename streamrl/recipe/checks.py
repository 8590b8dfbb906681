"""Settings that are valid alone but not together (exit 2 naming the key), and the learner's
one-line summary."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from pathlib import Path
from typing import Any

from streamrl.connectors.megatron.model_kit import PRESETS
from streamrl.core import corrections, routing
from streamrl.core import lora as lora_names
from streamrl.recipe.schema import Recipe, learner_layout

def _every_interface(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return False


SECRET_WORDS = ("secret", "token", "password", "access_key_id", "account_key", "service_account_key", "sas_key")


def conflicts(r: Recipe) -> list[tuple[str, str]]:
    """(key path, problem) for settings that are valid alone but not together."""
    out = []
    if r.rollout.workers == 0 and not r.producer_api.enabled:
        out.append(("rollout.workers", "is 0 and producer_api.enabled is false, so nothing would produce groups; "
                                       "set rollout.workers >= 1 or enable producer_api"))
    if r.producer_api.enabled and r.run.mode != "stream":
        out.append(("producer_api.enabled", f"external producers need run.mode: stream (got {r.run.mode!r}): "
                                            "the other modes generate each batch with the rollout workers"))
    out += _learner_conflicts(r)
    out += _engine_conflicts(r)
    if routing.mode(r.rollout.routing) == "on" and (shape := _model_shape(r)) is not None and not routing.is_moe(shape):
        out.append(("rollout.routing", f"is on but {r.model.path} is not a mixture-of-experts model (its config has "
                                       "no num_experts_per_tok): there is no routing to record; use auto or off"))
    for key, host in (("engines.host", r.engines.host), ("producer_api.host", r.producer_api.host)):
        if _every_interface(host):
            out.append((key, f"is {host!r}, every interface of the machine; give the one address to listen on "
                             "(or network.bind: node for each node's cluster address)"))
    if r.network.bind == "node":
        for key, host in (("engines.host", r.engines.host), ("producer_api.host", r.producer_api.host)):
            if host != "127.0.0.1":
                out.append((key, f"is {host!r} and network.bind is node, which binds each node's cluster address: "
                                 "set one of the two"))
    for key in r.pool.storage_options:
        if any(w in key.lower() for w in SECRET_WORDS):
            out.append((f"pool.storage_options.{key}", "credentials do not belong in a recipe (it is copied into the "
                        "run directory and sent to every node); set them in the environment of the driver and of "
                        f"every Ray node instead (for S3: {key.upper()})"))
    for name in ("learner", "engines"):
        for res in getattr(r.placement, name).resources:
            if res in ("CPU", "GPU", "memory", "object_store_memory"):
                out.append((f"placement.{name}.resources", f"{res!r} is set by the run (learner.num_gpus, "
                                                           "engines.*): name only custom resources here"))
    return out


def _engine_conflicts(r: Recipe) -> list[tuple[str, str]]:
    """engines.python: an absolute path to an executable file (checked on the machine that loads the
    recipe; engines on other nodes need it at the same path), for SGLang engines only."""
    exe = r.engines.python
    if exe is None:
        return []
    key = "engines.python"
    if r.engines.backend == "embedded":
        return [(key, f"is {exe!r} but engines.backend is embedded, which runs in StreamRL's own interpreter: "
                      "set backend: sglang (or auto), or remove engines.python")]
    if not os.path.isabs(exe):
        found = shutil.which(exe)
        return [(key, f"is {exe!r}, not an absolute path (engines start in Ray workers, whose working directory "
                      "and PATH are not yours)" + (f"; on this machine that name is {found}" if found else ""))]
    if not os.path.isfile(exe):
        return [(key, f"is {exe!r}, which " + ("is a directory, not an interpreter (give .../bin/python)"
                                                 if os.path.isdir(exe) else "does not exist on this machine"))]
    if not os.access(exe, os.X_OK):
        return [(key, f"is {exe!r}, which is not executable")]
    return []


def _learner_conflicts(r: Recipe) -> list[tuple[str, str]]:
    """Off-policy keys set for a correction that does not read them, bands that are empty, and
    mini-batches that cannot each hold a whole group."""
    lc, out = r.learner, []
    chosen = corrections.resolve(lc.off_policy, r.max_staleness)
    why = "" if lc.off_policy != "auto" else f" (auto, for run.mode {r.run.mode}" + (
        f" with staleness.max_staleness {r.staleness.max_staleness})" if r.run.mode == "stream" else ")")
    for key in corrections.DEFAULTS:  # a user's correction (a function path) reads none of them
        if getattr(lc, key) is None or key in corrections.USES.get(chosen, ()):
            continue
        users = " or ".join(k for k, keys in corrections.USES.items() if key in keys)
        out.append((f"learner.{key}", f"is read only by learner.off_policy {users}, but off_policy is {chosen!r}{why}; "
                                      "remove it or choose one of those"))
    if chosen == "mis" and lc.seq_ratio is not None and (lc.mis_level or "token") == "token":
        out.append(("learner.seq_ratio", "has no effect with learner.mis_level token; set mis_level: sequence or remove it"))
    used = corrections.params(chosen, lc)
    for low, high in (("mis_low", "mis_high"), ("icepop_low", "icepop_high")):
        if low in used and not used[low] < used[high]:
            key = low if getattr(lc, low) is not None else high  # the one the recipe set
            out.append((f"learner.{key}", f"the band [{low} {used[low]}, {high} {used[high]}] is empty: "
                                          f"{low} must be below {high}"))
    out += _parallel_conflicts(r)
    out += _lora_conflicts(r)
    if lc.mini_batches > r.rollout.groups_per_step:
        out.append(("learner.mini_batches", f"{lc.mini_batches} exceeds rollout.groups_per_step "
                                            f"{r.rollout.groups_per_step}: each mini-batch holds whole groups"))
    return out


def _model_shape(r: Recipe) -> dict[str, Any] | None:
    """The model's config.json (or the preset model.init will build), None when neither is there yet."""
    cfg = Path(r.model.path) / "config.json"
    if cfg.exists():
        try:
            return dict(json.loads(cfg.read_text()))
        except (OSError, ValueError):
            return None  # the run reports an unreadable model directory itself
    if r.model.init is not None:
        return dict(PRESETS[r.model.init.preset])
    return None


def _parallel_conflicts(r: Recipe) -> list[tuple[str, str]]:
    """A layout the GPUs or the model cannot hold: ranks != learner GPUs, or heads, KV heads, MLP
    width or layers that do not divide by tp or pp."""
    lc, out = r.learner, []
    p = lc.parallel
    if p.dp == "auto" and lc.num_gpus and lc.num_gpus % (p.tp * p.pp):
        out.append(("learner.parallel.dp", f"auto needs learner.num_gpus ({lc.num_gpus}) to be a multiple of "
                                           f"tp * pp = {p.tp * p.pp}"))
    tp, pp, dp = learner_layout(r)
    if lc.num_gpus and lc.num_gpus != tp * pp * dp:
        out.append(("learner.num_gpus", f"{lc.num_gpus} GPUs but learner.parallel asks for tp {tp} x pp {pp} x dp {dp} "
                                        f"= {tp * pp * dp} ranks (one GPU each); make them equal or set dp: auto"))
    if dp % p.ep:
        out.append(("learner.parallel.ep", f"{p.ep} does not divide dp ({dp}): expert parallel ranks are data-parallel "
                                           "ranks (megatron), so raise dp or choose a divisor of it"))
    shape = _model_shape(r)
    if shape is None:
        return out
    experts = shape.get("num_local_experts") or shape.get("num_experts")  # transformers 5 writes the former
    if p.ep > 1 and not experts:
        out.append(("learner.parallel.ep", f"{p.ep} but {r.model.path} is not a mixture-of-experts model; use 1"))
    elif experts and experts % p.ep:
        out.append(("learner.parallel.ep", f"{p.ep} does not divide the model's {experts} experts; choose a divisor"))
    heads = shape.get("num_attention_heads", 1)
    for key, size, what in (("tp", tp, ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                                         "moe_intermediate_size")),
                            ("pp", pp, ("num_hidden_layers",))):
        for field in what:
            n = shape.get(field, heads if field == "num_key_value_heads" else None)
            if n is not None and n % size:
                out.append((f"learner.parallel.{key}", f"{size} does not divide the model's {field} ({n}, "
                                                       f"{r.model.path}); choose a divisor of {n}"))
    return out


def _lora_conflicts(r: Recipe) -> list[tuple[str, str]]:
    """target_modules that megatron cannot adapt exactly, MoE experts, pipeline stages."""
    lc = r.learner
    if lc.lora is None:
        return []
    layers, problem = lora_names.targets(lc.lora.target_modules)
    if problem:
        return [("learner.lora.target_modules", problem)]
    out = []
    if lc.parallel.pp > 1:
        out.append(("learner.lora", f"with learner.parallel.pp {lc.parallel.pp}: LoRA supports tp and dp, "
                                    "not pipeline stages yet; use pp: 1"))
    shape = _model_shape(r)
    mlp = [k for k in layers if k not in lora_names.ATTENTION]
    if shape is not None and routing.is_moe(shape) and mlp:
        out.append(("learner.lora.target_modules", f"adapts the MLP ({', '.join(lora_names.hf_modules(mlp))}) but "
                    f"{r.model.path} is a mixture-of-experts model: LoRA on experts is not supported; "
                    "name attention modules only (q_proj, k_proj, v_proj, o_proj)"))
    return out


def learner_summary(r: Recipe) -> str:
    """One line: the off-policy correction the learner will apply (`auto` resolved, unset keys
    at their defaults), its optimizer steps per claimed batch, the advantage and the loss."""
    lc = r.learner
    chosen = corrections.resolve(lc.off_policy, r.max_staleness)
    keys = ", ".join(f"{k} {v}" for k, v in corrections.params(chosen, lc).items())
    auto = f" (auto, for run.mode {r.run.mode})" if lc.off_policy == "auto" else ""
    steps = lc.mini_batches * lc.epochs
    tp, pp, dp = learner_layout(r)
    ep = f", ep {lc.parallel.ep}" if lc.parallel.ep > 1 else ""
    layout = f"{tp * pp * dp} ranks (tp {tp} x pp {pp} x dp {dp}{ep}); " if tp * pp * dp > 1 else ""
    lora = ""
    if lc.lora is not None:
        lora = (f"LoRA rank {lc.lora.rank} alpha {lc.lora.alpha} on "
                f"{', '.join(lora_names.targets(lc.lora.target_modules)[0])}; ")
    return (f"{layout}{lora}off-policy correction {chosen}{auto}{': ' + keys if keys else ''}; {steps} optimizer step"
            f"{'s' if steps > 1 else ''} per claimed batch ({lc.mini_batches} mini-batch(es) x {lc.epochs} epoch(s)); "
            f"advantage {lc.advantage}, loss {lc.loss}")
