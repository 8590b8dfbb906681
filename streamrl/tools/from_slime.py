"""`streamrl recipe from-slime SCRIPT`: a StreamRL recipe from a slime launch script.

slime's run scripts build bash arrays of flags (`ROLLOUT_ARGS=( --prompt-data ... )`) and pass them
to `python3 train.py ${ROLLOUT_ARGS[@]} ...`. This reads such a script (or a plain argument list),
expands the arrays and simple `VAR=value` / `VAR="${VAR:-default}"` variables, and maps every flag
it knows onto recipe keys. Each flag ends up in one of two lists: mapped (with the key it set) or
not mapped, with the reason (colocation, Megatron performance settings, checkpoints StreamRL keeps
in its run directory, ...). The recipe it writes lists the unmapped flags as comments and loads
with `streamrl check` when its functions import (slime's own ones are replaced by StreamRL's
built-ins or marked `style: slime`)."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_ARRAY = re.compile(r"^\s*([A-Za-z_]\w*)=\(\s*(.*?)\s*\)\s*$", re.S | re.M)
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(\"[^\"]*\"|'[^']*'|[^\s;()]*)\s*$", re.M)
_DEFAULT = re.compile(r"^\$\{([A-Za-z_]\w*):?-([^}]*)\}$")
_TRAIN = re.compile(r"\b(train(?:_async)?\.py)\b")

# Flags that set nothing in StreamRL, with why (a prefix match: "--recompute-" covers its family).
UNMAPPED = {
    "--colocate": "StreamRL does not colocate: the learner and the engines each get their own GPUs "
                  "(streaming keeps both busy); the recipe gives the engines as many GPUs as the learner",
    "--offload": "no colocation, so nothing to offload",
    "--offload-train": "no colocation, so nothing to offload",
    "--offload-rollout": "no colocation, so nothing to offload",
    "--load": "StreamRL loads the Hugging Face model at model.path and keeps its checkpoints in the run directory",
    "--save": "checkpoints go to the run directory (run.dir)",
    "--ref-load": "the reference model (learner.kl_coef > 0) is built from model.path",
    "--apply-chat-template": "StreamRL applies the tokenizer's chat template when a prompt is a list of messages; "
                             "a text prompt is used as it is",
    "--balance-data": "the learner groups micro-batches by length itself",
    "--use-dynamic-batch-size": "learner.max_tokens_per_micro_batch (set from --max-tokens-per-gpu) does this",
    "--rollout-function-path": "no counterpart: the rollout loop is StreamRL's; put per-sample logic in an env "
                               "(a custom generate: env with style: slime)",
    "--eval-max-response-len": "evaluation samples with the rollout settings (rollout.max_new_tokens)",
    "--eval-top-p": "evaluation samples with the rollout settings (rollout.top_p)",
    "--eval-top-k": "evaluation samples with the rollout settings (and a greedy pass besides)",
    "--eval-temperature": "evaluation samples with the rollout settings (and a greedy pass besides)",
    "--skip-eval-before-train": "StreamRL evaluates before training when data.eval_path is set",
    "--weight-decay": "the learner's Adam has no weight decay setting",
    "--adam-beta1": "the learner's Adam betas are not a recipe setting",
    "--adam-beta2": "the learner's Adam betas are not a recipe setting",
    "--calculate-per-token-loss": "learner.loss_agg is token by default",
    "--sequence-parallel": "a Megatron performance setting StreamRL does not expose",
    "--context-parallel-size": "context parallelism is not supported",
    "--expert-model-parallel-size": "expert parallelism is not supported",
    "--expert-tensor-parallel-size": "expert parallelism is not supported",
    "--recompute-": "a Megatron memory setting StreamRL does not expose",
    "--attention-": "a Megatron model/kernel setting; the model's comes from model.path",
    "--hidden-dropout": "a Megatron model setting; StreamRL trains without dropout",
    "--accumulate-allreduce-grads-in-fp32": "a Megatron numerics setting StreamRL does not expose",
    "--num-gpus-per-node": "placement comes from the Ray cluster's nodes",
    "--actor-num-nodes": "learner.num_gpus counts GPUs, wherever Ray places them",
    "--rm-url": "used only with --rm-type remote_rm",
    "--wandb-group": "not a recipe setting (W&B reads WANDB_RUN_GROUP from the environment)",
}
# Megatron's model-shape flags (scripts/models/*.sh): the shape comes from model.path's config.json.
MODEL_SHAPE = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
               "--num-query-groups", "--kv-channels", "--vocab-size", "--rotary-base", "--normalization",
               "--norm-epsilon", "--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
               "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings", "--max-position-embeddings",
               "--seq-length", "--position-embedding-type", "--rotary-percent", "--use-rope-scaling", "--make-vocab-size-divisible-by")

ADVANTAGE = {"grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp"}
KL = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "k3"}
RM_TYPE = {"math": "streamrl.plugins.rewards:math_boxed", "deepscaler": "streamrl.plugins.rewards:math_boxed",
           "dapo": "streamrl.plugins.rewards:math_boxed", "f1": "streamrl.plugins.rewards:f1",
           "remote_rm": "streamrl.plugins.rewards:remote_rm"}
SLIME_NONZERO_STD = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


@dataclass
class Conversion:
    recipe: dict[str, Any] = field(default_factory=dict)
    mapped: list[tuple[str, str]] = field(default_factory=list)  # (flag with values, recipe keys it set)
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (flag with values, why)
    entry: str = ""  # train.py / train_async.py when the script names one

    def set(self, key: str, value: Any) -> None:
        node = self.recipe
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value


def sourced(text: str) -> list[str]:
    """The files a script `source`s (their flags, e.g. scripts/models/*.sh's MODEL_ARGS, are not read)."""
    return re.findall(r"^\s*(?:source|\.)\s+(\S+)", text, re.M)


def shell_words(text: str) -> tuple[list[str], str]:
    """The arguments a slime launch script passes to train.py (arrays and variables expanded),
    and the entry point it runs ("" when `text` is a bare argument list)."""
    text = re.sub(r"\\\n", " ", text)
    arrays = {}
    for name, body in _ARRAY.findall(text):
        lines = [ln for ln in body.splitlines() if not ln.strip().startswith("#")]
        arrays[name] = " ".join(lines)
    vars_: dict[str, str] = {}
    for name, raw in _ASSIGN.findall(text):
        val = raw[1:-1] if raw[:1] in "\"'" else raw
        if m := _DEFAULT.match(val):
            val = vars_.get(m.group(1), m.group(2)) if m.group(1) != name else m.group(2)
        vars_[name] = val
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("#")]
    call = next((ln for ln in lines if _TRAIN.search(ln)), None)
    entry = ""
    if call is not None:
        m = _TRAIN.search(call)
        entry, body = m.group(1), call[m.end():]
    else:
        body = " ".join(re.sub(r"#.*$", "", ln) for ln in lines)

    def expand(s: str) -> str:
        s = re.sub(r"\"?\$\{([A-Za-z_]\w*)\[@\]\}\"?", lambda m: " " + arrays.get(m.group(1), "") + " ", s)
        return re.sub(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", lambda m: vars_.get(m.group(1) or m.group(2), m.group(0)), s)

    body = expand(expand(body))
    return shlex.split(body, comments=True), entry


def flags(words: list[str]) -> list[tuple[str, list[str]]]:
    """(--flag, its values) in order; words before the first flag are ignored."""
    out: list[tuple[str, list[str]]] = []
    for w in words:
        if w.startswith("--"):
            name, eq, val = w.partition("=")
            out.append((name, [val] if eq else []))
        elif out:
            out[-1][1].append(w)
    return out


def convert(text: str) -> Conversion:
    words, entry = shell_words(text)
    c = Conversion(entry=entry)
    fl = flags(words)
    given = {f: v for f, v in fl}
    c.set("run.name", "from-slime")
    if entry:
        mode = "one_step_off" if entry == "train_async.py" else "lockstep"
        c.set("run.mode", mode)
        c.mapped.append((entry, f"run.mode {mode} (slime's {entry}; run.mode: stream is StreamRL's streaming mode)"))
    for flag, vals in fl:
        shown = " ".join([flag, *vals])
        try:
            why = _one(c, flag, vals, given)
        except ValueError:  # a number that is not one, e.g. a variable the script computes at run time
            why = f"a value is not a number ({' '.join(vals) or 'none given'}; a shell variable from-slime could " \
                  "not expand?)"
        if isinstance(why, str):
            c.unmapped.append((shown, why))
        else:
            c.mapped.append((shown, ", ".join(why)))
    _derived(c, given)
    for f in sourced(text):
        c.unmapped.append((f"(source {f})", "sourced files are not read; slime's model files hold Megatron's model "
                                            "shape, which StreamRL reads from model.path's config.json"))
    return c


def _fn(dotted: str) -> str:
    mod, _, name = dotted.rpartition(".")
    return f"{mod}:{name}"


def _one(c: Conversion, flag: str, vals: list[str], given: dict[str, list[str]]) -> list[str] | str:
    """Set what `flag` maps to; the keys it set, or why it maps to nothing."""
    v = vals[0] if vals else None
    if flag == "--wandb-key":
        return "credentials do not belong in a recipe: set WANDB_API_KEY in the environment of the run"
    if flag == "--rollout-function-path" and v and "fully_async" in v:
        c.set("run.mode", "stream")
        c.mapped = [(f, k) for f, k in c.mapped if not k.startswith("run.mode")]
        return ["run.mode stream (slime's fully async rollout; staleness.max_staleness bounds how far behind)"]
    if any("$" in x for x in vals):
        return f"its value {' '.join(vals)!r} is a shell expression from-slime could not expand; set the key by hand"
    simple = {
        "--hf-checkpoint": ("model.path", str), "--prompt-data": ("data.path", str),
        "--input-key": ("data.prompt_key", str), "--label-key": ("data.label_key", str),
        "--num-epoch": ("data.epochs", int), "--num-rollout": ("run.steps", int),
        "--rollout-batch-size": ("rollout.groups_per_step", int), "--n-samples-per-prompt": ("rollout.n_samples", int),
        "--rollout-max-response-len": ("rollout.max_new_tokens", int),
        "--rollout-temperature": ("rollout.temperature", float), "--rollout-top-p": ("rollout.top_p", float),
        "--rollout-top-k": ("rollout.top_k", int), "--save-interval": ("run.checkpoint_every", int),
        "--eval-interval": ("run.eval_every", int), "--n-samples-per-eval-prompt": ("data.eval_samples", int),
        "--entropy-coef": ("learner.entropy_coef", float), "--eps-clip": ("learner.eps_clip_low", float),
        "--eps-clip-high": ("learner.eps_clip_high", float), "--lr": ("learner.lr", float),
        "--lr-warmup-iters": ("learner.warmup_steps", int), "--clip-grad": ("learner.grad_clip", float),
        "--micro-batch-size": ("learner.micro_batch_size", int),
        "--max-tokens-per-gpu": ("learner.max_tokens_per_micro_batch", int),
        "--tensor-model-parallel-size": ("learner.parallel.tp", int),
        "--pipeline-model-parallel-size": ("learner.parallel.pp", int),
        "--rollout-num-gpus-per-engine": ("engines.tp", int), "--wandb-project": ("run.wandb_project", str),
        "--num-steps-per-rollout": ("learner.mini_batches", int), "--tis-clip": ("learner.tis_cap", float),
    }
    if flag in simple:
        key, typ = simple[flag]
        if v is None:
            return f"{flag} has no value"
        try:
            c.set(key, typ(v) if typ is not float else float(v))
        except ValueError:
            return f"{v!r} is not a {typ.__name__} (an unset shell variable?)"
        return [key]
    if flag in ("--rollout-seed", "--seed"):
        c.set("run.seed", int(v or 0))
        c.set("data.seed", int(v or 0))
        return ["run.seed", "data.seed"]
    if flag == "--rollout-shuffle":
        c.set("data.shuffle", True)
        return ["data.shuffle"]
    if flag == "--eval-prompt-data":
        if len(vals) < 2:
            return "expected NAME PATH pairs"
        c.set("data.eval_path", vals[1])
        return ["data.eval_path"] + ([] if len(vals) == 2 else [f"(only the first eval set; StreamRL has one: {vals[2:]} "
                                                              "left out)"])
    if flag == "--advantage-estimator":
        if v not in ADVANTAGE:
            return f"no StreamRL advantage {v!r} (built-ins: grpo, dr_grpo, rloo, reinforce_pp, or a function)"
        c.set("learner.advantage", ADVANTAGE[v])
        return ["learner.advantage"]
    if flag == "--use-kl-loss":
        return ["(learner.kl_coef from --kl-loss-coef)"]
    if flag == "--kl-loss-coef":
        c.set("learner.kl_coef", float(v or 0))
        return ["learner.kl_coef"]
    if flag == "--kl-loss-type":
        if v not in KL:
            return f"no StreamRL KL estimator {v!r} (k1, k2, k3)"
        c.set("learner.kl_estimator", KL[v])
        return ["learner.kl_estimator"]
    if flag == "--use-tis":
        c.set("learner.off_policy", "tis")
        return ["learner.off_policy"]
    if flag == "--optimizer":
        return ["(StreamRL's learner uses Adam)"] if v == "adam" else f"StreamRL's learner uses Adam, not {v}"
    if flag == "--lr-decay-style":
        return ["(constant learning rate after warmup, StreamRL's)"] if v == "constant" else \
            f"StreamRL's RL learning rate is constant after warmup (no {v} decay)"
    if flag == "--actor-num-gpus-per-node":
        gpus = int(v or 0) * int((given.get("--actor-num-nodes") or ["1"])[0])
        c.set("learner.num_gpus", gpus)
        c.set("learner.parallel.dp", "auto")
        return ["learner.num_gpus", "learner.parallel.dp auto"]
    if flag == "--rollout-num-gpus":
        per = int((given.get("--rollout-num-gpus-per-engine") or ["1"])[0])
        c.set("engines.num", max(1, int(v or 0) // per))
        return ["engines.num"]
    if flag == "--over-sampling-batch-size":
        base = int((given.get("--rollout-batch-size") or ["1"])[0])
        c.set("rollout.over_sampling", max(1.0, int(v or 0) / base))
        return ["rollout.over_sampling"]
    if flag == "--global-batch-size":
        if "--num-steps-per-rollout" in given:
            return ["(--num-steps-per-rollout sets learner.mini_batches)"]
        per = int((given.get("--rollout-batch-size") or ["0"])[0]) * int((given.get("--n-samples-per-prompt") or ["1"])[0])
        gbs = int(v or 0)
        if not gbs or not per or per % gbs:
            return f"{per} samples per rollout do not split into global batches of {gbs}"
        c.set("learner.mini_batches", per // gbs)
        return ["learner.mini_batches"]
    if flag == "--rm-type":
        base = (v or "").removeprefix("boxed_")
        if base not in RM_TYPE:
            return f"no StreamRL built-in for rm-type {v!r}; name your reward function under reward.fn"
        c.set("reward.fn", RM_TYPE[base])
        if base == "remote_rm" and "--rm-url" in given:
            c.set("reward.args", {"url": given["--rm-url"][0]})
        note = "" if base in ("f1", "remote_rm") else " (the last \\boxed{} answer against the label, numbers by value)"
        return [f"reward.fn{note}"]
    if flag == "--custom-rm-path":
        c.set("reward", {"fn": _fn(v or ""), "style": "slime"})
        extra = {k: x for k, x in (("group_rm", "--group-rm" in given),
                                   ("reward_key", (given.get("--reward-key") or [None])[0])) if x}
        if extra:
            c.recipe["reward"]["args"] = extra
        return ["reward.fn (style: slime)"]
    if flag in ("--group-rm", "--reward-key"):
        return ["reward.args." + flag[2:].replace("-", "_")] if "--custom-rm-path" in given else \
            "only a slime-style reward (--custom-rm-path) reads it"
    if flag == "--dynamic-sampling-filter-path":
        ref = {"fn": "streamrl.plugins.filters:nonzero_std"} if v == SLIME_NONZERO_STD else \
            {"fn": _fn(v or ""), "style": "slime"}
        c.set("filters", [ref])
        return ["filters[0]" + (" (StreamRL's nonzero_std)" if v == SLIME_NONZERO_STD else " (style: slime)")]
    if flag == "--custom-generate-function-path":
        c.set("env", {"fn": _fn(v or ""), "style": "slime"})
        return ["env (style: slime)"]
    if flag == "--use-wandb":
        c.set("run.loggers", ["wandb"])
        return ["run.loggers"]
    if flag == "--partial-rollout":
        c.set("staleness.partial_rollout", "abort_resume")
        return ["staleness.partial_rollout"]
    if flag.startswith("--sglang-"):
        c.recipe.setdefault("engines", {}).setdefault("extra_args", []).extend(["--" + flag[len("--sglang-"):], *vals])
        return ["engines.extra_args"]
    if flag in MODEL_SHAPE:
        return "the model's shape comes from model.path's config.json"
    for prefix, why in UNMAPPED.items():
        if flag == prefix or (prefix.endswith("-") and flag.startswith(prefix)):
            return why
    return "no StreamRL counterpart known to from-slime"


def _derived(c: Conversion, given: dict[str, list[str]]) -> None:
    """Settings that follow from several flags: GPU engines, and engines for a colocated run."""
    learner_gpus = c.recipe.get("learner", {}).get("num_gpus", 0)
    if learner_gpus or "--rollout-num-gpus" in given:
        c.set("engines.backend", "sglang")
    if "--rollout-num-gpus" not in given and learner_gpus:  # slime: colocated engines use the learner's GPUs
        per = int((given.get("--rollout-num-gpus-per-engine") or ["1"])[0])
        c.set("engines.num", max(1, learner_gpus // per))
    lc = c.recipe.get("learner", {})
    if "tis_cap" in lc and lc.get("off_policy") != "tis":
        del lc["tis_cap"]
        c.mapped = [(f, k) for f, k in c.mapped if k != "learner.tis_cap"]
        c.unmapped.append(("--tis-clip", "read only with --use-tis"))
    groups = c.recipe.get("rollout", {}).get("groups_per_step")
    mb = c.recipe.get("learner", {}).get("mini_batches")
    if groups and mb and mb > groups:
        c.recipe["learner"]["mini_batches"] = groups
        c.unmapped.append((f"(mini-batches {mb})", f"each StreamRL mini-batch holds whole groups: {groups} at most"))
    for key, default in (("model", {"path": "MODEL_PATH"}), ("data", {"path": "DATA_PATH"})):
        if "path" not in c.recipe.get(key, {}):
            c.recipe.setdefault(key, {}).update(default)
            c.unmapped.append((f"({key}.path)", f"no {'--hf-checkpoint' if key == 'model' else '--prompt-data'} "
                                                f"in the script; set {key}.path"))


ORDER = ("run", "model", "data", "rollout", "staleness", "reward", "filters", "env", "learner", "engines")


def render(c: Conversion, source: str) -> str:
    """The recipe as YAML, with what was mapped and what was not as comments."""
    data = {k: c.recipe[k] for k in ORDER if k in c.recipe}
    data.update({k: v for k, v in c.recipe.items() if k not in data})
    head = [f"# written by `streamrl recipe from-slime {source}`", "#",
            f"# mapped ({len(c.mapped)}):"] + [f"#   {f} -> {k}" for f, k in c.mapped]
    head += ["#", f"# not mapped ({len(c.unmapped)}):"] + [f"#   {f}: {why}" for f, why in c.unmapped]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False)


def from_slime(path: str) -> tuple[str, Conversion]:
    text = Path(path).read_text() if path != "-" else sys.stdin.read()
    c = convert(text)
    return render(c, path), c
