"""Recipes: YAML files decoded into typed msgspec Structs, with `key.sub=value` overrides.

    streamrl check recipes/quickstart.yaml rollout.n_samples=4

Every problem is reported as `FILE:LINE: key.path: what is wrong` and raises RecipeError
(the CLI exits with code 2) before any work starts. Extension points are dotted function
paths `pkg.module:function`, imported and checked at load time.

Long file: the whole recipe schema is one typed tree a reader should see in one place, next to the loader that reports every problem by file, line and key.
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import re
import socket
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from streamrl.core import corrections
from streamrl.core.staleness import mode_bound
from streamrl.core.types import ConsumptionPolicy, PartialRolloutPolicy

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Prob = Annotated[float, msgspec.Meta(gt=0, le=1)]
FnPath = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats (`1e-5` is a number, not a string) and no silently repeated keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for k, _ in node.value:
            key = self.construct_object(k, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} repeats the one on line {seen[key]}", k.start_mark)
            seen[key] = k.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


class RecipeError(Exception):
    """A recipe problem the user must fix; the message names the file, line and key path."""


class _Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class FnRef(_Cfg):
    """A user function and the keyword arguments it is called with."""

    fn: FnPath  # `pkg.module:function`, imported and checked when the recipe loads
    args: dict[str, Any] = {}  # keyword arguments it is called with


class RunCfg(_Cfg):
    """The run: its mode, length, directory, checkpoints and evaluations."""

    name: str = "run"  # names the run directory: runs/<name>-<date>-<time>, with runs/<name> linking to the newest
    dir: str | None = None  # the run directory (as --run-dir); default a fresh one as above
    seed: int = 0  # seeds the learner, the SFT warm-start and the engines' sampling
    # stream: train under staleness.max_staleness while generation goes on; lockstep: generate a
    # batch, train, push (on-policy); one_step_off: generate the next batch while training this one
    mode: Literal["stream", "lockstep", "one_step_off"] = "stream"
    steps: PosInt = 20  # learner steps: claimed batches, one policy version each
    checkpoint_every: NonNegInt = 10  # learner steps between checkpoints; 0 = only at the end
    eval_every: NonNegInt = 0  # learner steps between evaluations (besides before and after); 0 = none
    # background: a dedicated engine evaluates the exact version while training goes on;
    # inline: the rollout engines evaluate between steps (training waits)
    eval_mode: Literal["background", "inline"] = "background"
    keep_checkpoints: NonNegInt = 3  # newest checkpoints kept; 0 = all (replay needs one at or before its steps)
    loggers: list[Literal["tensorboard", "wandb"]] = []  # optional mirrors of metrics.jsonl/eval.jsonl
    wandb_project: str | None = None  # default: run.name


class RayCfg(_Cfg):
    """The Ray cluster the run's actors live on."""

    address: str | None = None  # join this cluster (e.g. "auto"); default: start a local one
    num_cpus: PosInt | None = None  # logical CPUs of the local cluster; default: enough for every actor


class GroupPlacement(_Cfg):
    """A Ray placement group: one bundle per learner rank / engine / rollout worker."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # custom Ray resources each bundle also asks for, e.g. {trainer: 1}: the group then goes only to
    # nodes started with them (`ray start --resources '{"trainer": 8}'`)
    resources: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = {}


class LearnerPlacement(GroupPlacement):
    """The learner's ranks: STRICT_PACK keeps them on one node (tensor parallel wants NVLink)."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "STRICT_PACK"


class PlacementCfg(_Cfg):
    """Where the run's actors go on a Ray cluster; checked against its nodes before anything starts."""

    learner: LearnerPlacement = msgspec.field(default_factory=LearnerPlacement)
    # the engines (SPREAD: over as many nodes as can take one); rollout workers go where these resources are
    engines: GroupPlacement = msgspec.field(default_factory=GroupPlacement)


class ModelInit(_Cfg):
    """Build the model directory locally when it does not exist (connectors/megatron/model_kit.py)."""

    preset: Literal["tiny", "small"] = "tiny"
    seed: int = 0


class ModelCfg(_Cfg):
    """The policy: a Hugging Face model directory the learner and the engines load."""

    path: str  # the model directory (config.json, weights, tokenizer)
    tokenizer: str | None = None  # default: the model directory
    init: ModelInit | None = None  # build a tiny model at `path` first if it is missing


class DataCfg(_Cfg):
    """Prompts to train on (JSONL or Parquet rows) and the held-out prompts to evaluate on."""

    path: str  # JSONL or Parquet file of prompt rows
    prompt_key: str = "prompt"  # the row's prompt
    label_key: str = "label"  # the row's label, passed to the reward function
    shuffle: bool = True  # shuffle the prompts each epoch (seeded by data.seed)
    seed: int = 0
    epochs: PosInt = 1  # passes over the prompts
    on_error: Literal["fail", "skip"] = "fail"  # malformed rows: stop before any work, or skip with a warning
    eval_path: str | None = None  # held-out prompts (same keys), evaluated before and after training
    eval_samples: PosInt = 4  # sampled responses per eval prompt (accuracy = mean over them)
    eval_size: PosInt | None = None  # use only the first N eval prompts
    generate: FnRef | None = None  # called as fn(out_dir=<dir of path>, **args) when `path` is missing


class SftCfg(_Cfg):
    """Supervised warm-start before RL (rows: prompt_key -> response_key)."""

    path: str  # JSONL or Parquet rows of prompt and response
    steps: PosInt = 100  # optimizer steps
    lr: PosFloat = 1e-3
    # cosine: the learning rate falls from lr to lr/10 over the steps, so the warm-started policy
    # does not depend on where the last few high-lr steps happened to leave it
    lr_schedule: Literal["constant", "cosine"] = "constant"
    batch_size: PosInt = 64  # rows per step
    prompt_key: str = "prompt"
    response_key: str = "response"


class RolloutCfg(_Cfg):
    """Generation: group size, batch size, sampling, and the rollout workers."""

    n_samples: PosInt = 8  # responses per prompt (group size)
    groups_per_step: PosInt = 4  # groups the learner consumes per step
    max_new_tokens: PosInt = 32  # the longest response, in tokens
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # sampling, as SGLang's sampling_params
    top_p: Prob = 1.0
    top_k: int = -1  # -1 = off
    max_concurrency: PosInt = 64  # groups generating at once per worker
    # claim this many x groups_per_step, train on the groups_per_step with the largest reward std
    # (slime's over-sampling filter); the rest are dropped
    over_sampling: Annotated[float, msgspec.Meta(ge=1)] = 1.0
    workers: NonNegInt = 1  # rollout worker actors; 0 = only external producers (producer_api) feed the run


class StalenessCfg(_Cfg):
    """How many versions behind trained data may be, and what a new version does to requests in flight."""

    max_staleness: NonNegInt = 1  # the bound (AReaL's eta): versions a group may lag the learner when claimed (stream mode); 0 = on-policy
    # groups over the bound when claimed: drop them, mask their stale tokens, or keep them
    # (the off-policy correction reweights what is kept)
    policy: ConsumptionPolicy = "drop"
    # requests in flight when a version is published: abort_resume (abort, keep the tokens, resume on
    # the new weights), in_place (pause, update, continue), restart (generate again), finish_old (below)
    partial_rollout: PartialRolloutPolicy = "abort_resume"
    # finish_old: after a new version is ready, engines keep generating on the old weights for this
    # long before the abort; requests that finish meanwhile are single-version (no resume, no re-prefill)
    finish_window_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.05


class ProducerApiCfg(_Cfg):
    """External producers: other processes submit groups over HTTP (`streamrl produce serve`)."""

    enabled: bool = False  # reserve a share of the admission capacity for them and start the service with the run
    host: str = "127.0.0.1"  # another address exposes it beyond this machine (bearer token still required); not 0.0.0.0
    port: NonNegInt = 0  # 0 = any free port; the URL is written to RUN_DIR/producer.json
    max_body_mb: PosFloat = 16.0  # larger submissions are refused with 413
    lease_s: PosFloat = 120.0  # a lease's unused slots return to the capacity after this long (a dead producer's too)


class NetworkCfg(_Cfg):
    """The addresses the run's servers listen on."""

    # loopback: every server on 127.0.0.1 (one machine). node: the engines, the router, the producer
    # API and the weight group's store bind their own node's cluster address (Ray's node IP), so
    # other nodes reach them; never 0.0.0.0, and the run's API keys are still required
    bind: Literal["loopback", "node"] = "loopback"


class PoolCfg(_Cfg):
    """The experience pool: a LanceDB database every producer appends to and the learner claims from."""

    uri: str | None = None  # default <run dir>/pool; any LanceDB URI, e.g. s3://bucket/prefix/pool
    # object-store settings for uri (Lance's names: aws_endpoint, aws_region, allow_http, ...);
    # credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never from the recipe
    storage_options: dict[str, str] = {}
    commit_max_rows: PosInt = 8192  # group commit: at most this many rows in one Lance commit
    commit_linger_ms: Annotated[float, msgspec.Meta(ge=0)] = 2.0  # group commit: wait this long for company
    compact_every: NonNegInt = 64  # compact once this many small fragments accumulate; 0 = never
    # producers' appends return once in a per-process write-ahead log, committed to Lance behind
    # them (local pools only): 2-4x the appends/s of one producer, 2.5x for 8 producer processes;
    # other processes see rows up to ~50 ms later (docs/pool.md)
    write_ahead: bool = False


class ParallelCfg(_Cfg):
    """The learner's Megatron layout: tp * pp * dp ranks, one Ray actor each (one GPU each on GPU)."""

    tp: PosInt = 1  # tensor parallel: attention heads, MLP and vocabulary split over tp ranks
    pp: PosInt = 1  # pipeline parallel: the layers split into pp stages (1F1B over micro-batches)
    dp: PosInt | Literal["auto"] = 1  # data parallel replicas; auto = learner.num_gpus / (tp * pp), 1 on CPU
    # with dp > 1: each DP rank keeps 1/dp of Adam's moments (megatron's distributed optimizer, ZeRO-1)
    distributed_optimizer: bool = True


class LearnerCfg(_Cfg):
    """Optimisation and the RL objective (formulas: streamrl/core/algorithms/)."""

    parallel: ParallelCfg = msgspec.field(default_factory=ParallelCfg)
    lr: PosFloat = 1e-5
    warmup_steps: NonNegInt = 0
    threads: PosInt = 1  # torch CPU threads of the learner process
    num_gpus: NonNegInt = 0  # GPUs for the whole learner (one per rank: tp * pp * dp); 0 = CPU
    cpus: list[NonNegInt] = []  # pin the learner to these cores (Linux; rank r takes cpus[r::ranks]); empty = no pinning
    micro_batch_size: PosInt = 8
    # Padded tokens (rows x longest row) a micro-batch may hold; null = rows alone decide. Rows are
    # grouped by length either way, so a long-tailed batch does not pad every row to its longest.
    max_tokens_per_micro_batch: PosInt | None = None
    grad_clip: PosFloat = 1.0
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    loss_agg: Literal["token", "seq", "group"] = "token"
    eps_clip_low: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
    eps_clip_high: Annotated[float, msgspec.Meta(ge=0)] = 0.28
    dual_clip: Annotated[float, msgspec.Meta(gt=1)] | None = None
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # > 0 loads a frozen reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Optimizer steps per claimed batch: `mini_batches` (whole groups each) x `epochs` passes; the
    # proximal log-probs are taken once per batch, so the PPO clip acts from the second step on.
    # The policy version moves by one per claimed batch.
    mini_batches: PosInt = 1
    epochs: PosInt = 1
    # Off-policy correction (formulas: streamrl/core/algorithms/offpolicy.py; README "Which off-policy
    # correction?"). auto = tis when the mode trains stale data (stream with max_staleness > 0,
    # one_step_off), none when it is on-policy (lockstep, max_staleness 0).
    off_policy: Literal["auto", "none", "tis", "tis_seq", "mis", "decoupled", "icepop"] = "auto"
    # Each key below belongs to the corrections named; unset (null) = the default in brackets.
    tis_cap: Annotated[float, msgspec.Meta(ge=1)] | None = None  # tis, tis_seq: weights truncated here [2.0]
    seq_ratio: Literal["geometric", "product"] | None = None  # tis_seq, mis (sequence): a sequence's weight [geometric]
    mis_level: Literal["token", "sequence"] | None = None  # mis: mask tokens or whole sequences [token]
    mis_low: PosFloat | None = None  # mis: weights outside [mis_low, mis_high] leave the loss [0.5]
    mis_high: PosFloat | None = None  # [2.0]
    decoupled_cap: Annotated[float, msgspec.Meta(gt=1)] | None = None  # decoupled: weights over it -> 0 [no cap]
    icepop_low: PosFloat | None = None  # icepop: weights outside [icepop_low, icepop_high] -> 0 [0.5]
    icepop_high: PosFloat | None = None  # [5.0]


class EnginesCfg(_Cfg):
    """The rollout engines, behind sglang-router."""

    num: PosInt = 1  # engines
    # embedded: the CPU engine over transformers that speaks SGLang's API; sglang: SGLang (GPU);
    # auto: SGLang where the cluster has GPUs
    backend: Literal["embedded", "sglang", "auto"] = "embedded"
    host: str = "127.0.0.1"  # the address the engines bind; another exposes them beyond this machine; not 0.0.0.0
    router_policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "round_robin"  # sglang-router's
    weight_sync: Literal["distributed", "disk"] = "distributed"  # how new versions reach the engines
    tp: PosInt = 1  # tensor parallel size per engine: each TP rank joins the weight group (embedded: 1 process)
    max_running: PosInt = 64  # embedded engine: requests decoded together
    threads: PosInt = 1  # embedded engine: torch CPU threads
    extra_args: list[str] = []  # SGLang launch_server arguments
    keep_weights: NonNegInt = 2  # pushed versions kept under RUN_DIR/weights (disk sync); 0 = all
    cpus: list[NonNegInt] = []  # embedded engines: pin to these cores (Linux); empty = no pinning


class Recipe(_Cfg):
    """A recipe: sections, each with typed defaults; only model and data are required."""

    model: ModelCfg
    data: DataCfg
    run: RunCfg = msgspec.field(default_factory=RunCfg)
    rollout: RolloutCfg = msgspec.field(default_factory=RolloutCfg)
    staleness: StalenessCfg = msgspec.field(default_factory=StalenessCfg)
    # per sample fn(response, label, **args), or per group fn(responses, label, **args); it may also ask
    # for prompt and record by name; sync or async; returns a number or {"reward": r, ...components}
    reward: FnRef = msgspec.field(default_factory=lambda: FnRef(fn="streamrl.plugins.rewards:exact_match"))
    filters: list[FnRef] = []  # fn(group, **args) -> bool: False drops the group (kept in the pool, reason = its name)
    # agent environment: async fn(task, llm) running the turns of one sample (streamrl/producers/episode.py);
    # without it each sample is one generation from the prompt
    env: FnRef | None = None
    producer_api: ProducerApiCfg = msgspec.field(default_factory=ProducerApiCfg)
    pool: PoolCfg = msgspec.field(default_factory=PoolCfg)
    network: NetworkCfg = msgspec.field(default_factory=NetworkCfg)
    learner: LearnerCfg = msgspec.field(default_factory=LearnerCfg)
    engines: EnginesCfg = msgspec.field(default_factory=EnginesCfg)
    sft: SftCfg | None = None
    ray: RayCfg = msgspec.field(default_factory=RayCfg)
    placement: PlacementCfg = msgspec.field(default_factory=PlacementCfg)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    @property
    def pool_uri(self) -> str:
        return self.pool.uri or str(self.run_dir / "pool")

    @property
    def max_staleness(self) -> int:
        """The staleness bound the run trains under, computed here only: the mode's
        (lockstep 0, one_step_off 1) or, in stream mode, `staleness.max_staleness`."""
        return mode_bound(self.run.mode, self.staleness.max_staleness)


# ---------------------------------------------------------------- loading


def _line_index(text: str) -> dict[str, int]:
    """Key path ("a.b[0].c") -> 1-based line of that key in the YAML text."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                sub = f"{path}.{k.value}" if path else str(k.value)
                lines[sub] = k.start_mark.line + 1
                walk(v, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, f"{path}[{i}]")

    root = yaml.compose(text, Loader=_Loader)
    if root is not None:
        walk(root, "")
    return lines


def _parse_value(raw: str) -> Any:
    try:
        return yaml.load(raw, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, str]:
    """Set `a.b.c=value` (value parsed as YAML) in place; returns key path -> override text."""
    origin: dict[str, str] = {}
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.(\w+))*", key):
            raise RecipeError(f"override {ov!r}: expected key.sub=value, e.g. rollout.n_samples=4")
        node: Any = data
        parts = key.split(".")
        path = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError(f"override {ov!r}: {path} has no item {part}")
                path += f"[{part}]"
                if last:
                    node[int(part)] = _parse_value(raw)
                else:
                    node = node[int(part)]
                continue
            if not isinstance(node, dict):
                raise RecipeError(f"override {ov!r}: {path} is a value, not a section")
            path = f"{path}.{part}" if path else part
            if last:
                node[part] = _parse_value(raw)
            elif part in node:
                node = node[part]
            elif parts[i + 1].isdigit():
                raise RecipeError(f"override {ov!r}: {path} is not a list in the recipe, so it has no item {parts[i + 1]}")
            else:
                node[part] = {}
                node = node[part]
        origin[path] = ov
    return origin


_ERR_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(err: msgspec.ValidationError, where: str, lines: dict[str, int], origin: dict[str, str]) -> str:
    m = _ERR_PATH.match(str(err))
    msg, path = m.group("msg"), (m.group("path") or "").lstrip(".")
    path = re.sub(r"\['([^']*)'\]", r".\1", path)  # a mapping's key (storage_options['x']) as a dotted key
    field = re.search(r"(?:unknown|missing required) field `([^`]+)`", msg)
    if field:
        path = f"{path}.{field.group(1)}" if path else field.group(1)
        msg = msg.replace("Object contains unknown field", "unknown key").replace(
            "Object missing required field", "missing required key")
        if "unknown key" in msg:
            msg += " (check the spelling; `streamrl check` prints every valid key with its default)"
    elif "matching regex" in msg:
        msg = "must be a dotted function path like `mypkg.rewards:score`"
    elif msg.startswith("Invalid enum value"):
        msg += f"; choose one of {', '.join(map(repr, _choices(path)))}"
    elif msg.startswith("Expected `str`, got"):
        msg += " (quote it: YAML reads true, 1 or 1.5 unquoted as another type)"
    return f"{_locate(where, path, lines, origin)}: {path or '<top level>'}: {msg}"


def _choices(path: str) -> tuple[Any, ...]:
    """The allowed values of the Literal field at `path` in the Recipe schema."""
    typ: Any = Recipe
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        hints = typing.get_type_hints(typ, include_extras=True) if isinstance(typ, type) else {}
        typ = hints.get(part)
        while typing.get_origin(typ) in (list, typing.Annotated, types.UnionType, typing.Union):
            typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return typing.get_args(typ) if typing.get_origin(typ) is Literal else ()


def _locate(where: str, path: str, lines: dict[str, int], origin: dict[str, str]) -> str:
    for p, ov in origin.items():
        if any(a == b or a.startswith(b + ".") or a.startswith(b + "[") for a, b in ((path, p), (p, path))):
            return f"override {ov!r}"
    probe = path
    while probe and probe not in lines:  # the nearest enclosing key that is in the file
        shorter = re.sub(r"(^|\.)[^.\[]+$|\[[^\]]*\]$", "", probe)
        if shorter == probe:  # nothing left to strip (never loop forever on an odd path)
            break
        probe = shorter
    return f"{where}:{lines.get(probe, 1)}"


DRIVER_IMPORTED_ENV = "STREAMRL_FNS_CHECKED"  # set for a run's Ray workers: every fn imported on the driver


def resolve_fn(path: str) -> Any:
    """Import `pkg.module:function` and return the callable (raises ValueError saying why not)."""
    mod_name, _, attr = path.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to see
        hint = ""
        if isinstance(e, ModuleNotFoundError) and mod_name.split(".")[0] in ("recipes", "connectors", "pools"):
            # The example plugins and connectors are installed under streamrl. since the package layout change.
            hint = f"; the examples are installed as {'streamrl.' + path!r}"
        if os.environ.get(DRIVER_IMPORTED_ENV):  # in a run's Ray worker: the driver imported it when checking
            hint = (f"; it imported on the driver but not on this worker (node {socket.gethostname()}): keep your "
                    "modules in the recipe's directory or the working directory (runs ship those to every node) "
                    "or install them on every node")
        raise ValueError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}){hint}") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ValueError(f"module {mod_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{path} is a {type(fn).__name__}, not a function")
    return fn


def fn_paths(obj: Any, path: str = "") -> list[tuple[str, str]]:
    """(key path, dotted function path) for every function reference in a decoded recipe."""
    found: list[tuple[str, str]] = []
    if isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            val = getattr(obj, name)
            sub = f"{path}.{name}" if path else name
            if name == "fn" and isinstance(val, str):
                found.append((sub, val))
            else:
                found.extend(fn_paths(val, sub))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found.extend(fn_paths(v, f"{path}[{i}]"))
    return found


def _yaml_problem(e: yaml.YAMLError, where: str, text: str) -> str:
    """Locate a YAML error where the broken construct starts (an unclosed quote is reported
    at the end of the file by the parser, but the user has to look where it opened)."""
    mark, ctx = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    last = max(1, len(text.splitlines()))
    line = min(mark.line + 1, last) if mark is not None else 1
    detail = ""
    if ctx is not None and getattr(e, "context", None):
        detail = f" ({e.context} that starts here; the parser gave up on line {line})"
        line = ctx.line + 1
    return f"{where}:{line}: not valid YAML: {getattr(e, 'problem', None) or e}{detail}"


def parse_recipe(text: str, where: str = "<recipe>", overrides: list[str] | None = None,
                 resolve: bool = True) -> Recipe:
    """The recipe in `text`; with `resolve`, every function it names is imported (that runs the
    module's code: see streamrl/runtime/user_code.py for recipes from a run directory)."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
        lines = _line_index(text)
    except yaml.YAMLError as e:
        raise RecipeError(_yaml_problem(e, where, text)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where}:1: a recipe is a mapping of sections (model:, data:, ...), got {type(data).__name__}")
    origin = apply_overrides(data, list(overrides or []))
    try:
        recipe = msgspec.convert(data, Recipe)
    except msgspec.ValidationError as e:
        raise RecipeError(_explain(e, where, lines, origin)) from None
    for key, fn in fn_paths(recipe) if resolve else []:
        try:
            resolve_fn(fn)
        except ValueError as e:
            raise RecipeError(f"{_locate(where, key, lines, origin)}: {key}: {e}") from None
    for key, problem in _conflicts(recipe):
        raise RecipeError(f"{_locate(where, key, lines, origin)}: {key}: {problem}")
    return recipe


def _every_interface(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        return False


SECRET_WORDS = ("secret", "token", "password", "access_key_id", "account_key", "service_account_key", "sas_key")


def _conflicts(r: Recipe) -> list[tuple[str, str]]:
    """(key path, problem) for settings that are valid alone but not together."""
    out = []
    if r.rollout.workers == 0 and not r.producer_api.enabled:
        out.append(("rollout.workers", "is 0 and producer_api.enabled is false, so nothing would produce groups; "
                                       "set rollout.workers >= 1 or enable producer_api"))
    if r.producer_api.enabled and r.run.mode != "stream":
        out.append(("producer_api.enabled", f"external producers need run.mode: stream (got {r.run.mode!r}): "
                                            "the other modes generate each batch with the rollout workers"))
    out += _learner_conflicts(r)
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


def _learner_conflicts(r: Recipe) -> list[tuple[str, str]]:
    """Off-policy keys set for a correction that does not read them, bands that are empty, and
    mini-batches that cannot each hold a whole group."""
    lc, out = r.learner, []
    chosen = corrections.resolve(lc.off_policy, r.max_staleness)
    why = "" if lc.off_policy != "auto" else f" (auto, for run.mode {r.run.mode}" + (
        f" with staleness.max_staleness {r.staleness.max_staleness})" if r.run.mode == "stream" else ")")
    for key in corrections.DEFAULTS:
        if getattr(lc, key) is None or key in corrections.USES[chosen]:
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
    if lc.mini_batches > r.rollout.groups_per_step:
        out.append(("learner.mini_batches", f"{lc.mini_batches} exceeds rollout.groups_per_step "
                                            f"{r.rollout.groups_per_step}: each mini-batch holds whole groups"))
    return out


def learner_layout(r: Recipe) -> tuple[int, int, int]:
    """(tp, pp, dp) of the learner, `dp: auto` resolved (the recipe was validated)."""
    p = r.learner.parallel
    dp = p.dp if p.dp != "auto" else max(1, r.learner.num_gpus // (p.tp * p.pp))
    return p.tp, p.pp, dp


def _model_shape(r: Recipe) -> dict[str, Any] | None:
    """The model's config.json (or the preset model.init will build), None when neither is there yet."""
    import json

    cfg = Path(r.model.path) / "config.json"
    if cfg.exists():
        try:
            return dict(json.loads(cfg.read_text()))
        except (OSError, ValueError):
            return None  # the run reports an unreadable model directory itself
    if r.model.init is not None:
        from streamrl.connectors.megatron.model_kit import PRESETS

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
    shape = _model_shape(r)
    if shape is None:
        return out
    heads = shape.get("num_attention_heads", 1)
    for key, size, what in (("tp", tp, ("num_attention_heads", "num_key_value_heads", "intermediate_size")),
                            ("pp", pp, ("num_hidden_layers",))):
        for field in what:
            n = shape.get(field, heads if field == "num_key_value_heads" else None)
            if n is not None and n % size:
                out.append((f"learner.parallel.{key}", f"{size} does not divide the model's {field} ({n}, "
                                                       f"{r.model.path}); choose a divisor of {n}"))
    return out


def learner_summary(r: Recipe) -> str:
    """One line: the off-policy correction the learner will apply (`auto` resolved, unset keys
    at their defaults) and its optimizer steps per claimed batch."""
    lc = r.learner
    chosen = corrections.resolve(lc.off_policy, r.max_staleness)
    keys = ", ".join(f"{k} {v}" for k, v in corrections.params(chosen, lc).items())
    auto = f" (auto, for run.mode {r.run.mode})" if lc.off_policy == "auto" else ""
    steps = lc.mini_batches * lc.epochs
    tp, pp, dp = learner_layout(r)
    layout = f"{tp * pp * dp} ranks (tp {tp} x pp {pp} x dp {dp}); " if tp * pp * dp > 1 else ""
    return (f"{layout}off-policy correction {chosen}{auto}{': ' + keys if keys else ''}; {steps} optimizer step"
            f"{'s' if steps > 1 else ''} per claimed batch ({lc.mini_batches} mini-batch(es) x {lc.epochs} epoch(s))")


def load_recipe(path: str | Path, overrides: list[str] | None = None, resolve: bool = True) -> Recipe:
    """The recipe at `path`; its directory joins the end of sys.path, so `fn: my_rewards:score`
    may name a module kept next to the recipe (runs ship such modules to every Ray node).
    `resolve=False`: neither that nor any import, only the schema and the settings checked."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RecipeError(f"{p}: cannot read recipe ({e.strerror or e})") from None
    here = str(p.resolve().parent)
    if resolve and here not in sys.path:
        sys.path.append(here)
    return parse_recipe(text, str(p), overrides, resolve)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(msgspec.to_builtins(recipe), sort_keys=False)
