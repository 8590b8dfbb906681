"""The recipe schema: one typed tree of msgspec Structs, its defaults and what each key means
(docs/recipe-reference.md is generated from the comments here: streamrl/tools/recipe_reference.py).

Long file: every section's keys in one tree, each with its comment, which the reference page is made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from streamrl.core.staleness import mode_bound
from streamrl.core.types import ConsumptionPolicy, PartialRolloutPolicy

PosInt = Annotated[int, msgspec.Meta(ge=1)]


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


PosFloat = Annotated[float, msgspec.Meta(gt=0)]


Prob = Annotated[float, msgspec.Meta(gt=0, le=1)]


FN_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


FnPath = Annotated[str, msgspec.Meta(pattern=FN_PATH)]


class RecipeError(Exception):
    """A recipe problem the user must fix; the message names the file, line and key path."""


class _Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class FnRef(_Cfg):
    """A user function and the keyword arguments it is called with."""

    fn: FnPath  # `pkg.module:function`, imported and checked when the recipe loads
    args: dict[str, Any] = {}  # keyword arguments it is called with
    # slime: the function has slime's signature (reward fn(args, sample), filter fn(args, samples), env:
    # custom generate fn(args, sample, sampling_params)); `args` above become attributes of the slime
    # `args` namespace it gets (docs/slime.md)
    style: Literal["streamrl", "slime"] = "streamrl"


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
    # inline: the rollout engines evaluate between steps (training waits); after: each version is
    # exported when reached and the dedicated engine evaluates them all once training ends (no CPU
    # taken from training: for timing runs on a machine with few cores)
    eval_mode: Literal["background", "inline", "after"] = "background"
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

    preset: Literal["tiny", "small", "tiny-qwen3", "tiny-moe", "small-moe"] = "tiny"  # model_kit.PRESETS
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
    epochs: PosInt = 1  # passes over the prompts (one group each); `streamrl run` refuses run.steps that claim more
    on_error: Literal["fail", "skip"] = "fail"  # malformed rows: stop before any work, or skip with a warning
    eval_path: str | None = None  # held-out prompts (same keys), evaluated before and after training
    eval_samples: PosInt = 4  # sampled responses per eval prompt (accuracy = mean over them)
    eval_size: PosInt | None = None  # use only the first N eval prompts
    # what held-out accuracy averages: the reward, or one of its components (e.g. `exact` when the
    # reward gives partial credit, so evaluations stay comparable across reward shapings)
    eval_metric: str = "reward"
    # called as fn(out_dir=<dir of path>, **args) when `path` is missing or its .generated.json differs
    generate: FnRef | None = None


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
    # the order prompts start in, chunk by chunk (streamrl/core/lengths.py): fifo (as drawn), longest_first
    # (longest predicted first: from the pool's history of the same prompt) or tail_batching (the chunk's
    # predicted-long prompts last, together); prompts never seen keep their drawn order
    schedule: Literal["fifo", "longest_first", "tail_batching"] = "fifo"
    schedule_window: NonNegInt = 0  # prompts per ordered chunk, all workers together; 0 = 4 x groups_per_step
    tail_fraction: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.25  # tail_batching: the chunk's longest share
    # claim this many x groups_per_step, train on the groups_per_step with the largest reward std
    # (slime's over-sampling filter); the rest are dropped
    over_sampling: Annotated[float, msgspec.Meta(ge=1)] = 1.0
    workers: NonNegInt = 1  # rollout worker actors; 0 = only external producers (producer_api) feed the run
    # MoE routing replay (R3): ask the engines which experts each token was routed to and store it with the
    # sample (the learner replays it). auto = on when the model's config.json names experts
    # (num_experts_per_tok); on: a response that comes back without routing fails its sample. YAML reads
    # unquoted on/off as true/false: both spellings work
    routing: Literal["auto", "on", "off"] | bool = "auto"


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
    # each compaction then removes all versions of each table but the newest keep_versions, those
    # a checkpoint tagged and those under 10 minutes old; `pool query --as-of-step N` reads the
    # versions step N read while they are kept (docs/pool.md#time-travel); 0 = keep every version
    keep_versions: NonNegInt = 1000
    # producers' appends return once in a per-process write-ahead log, committed to Lance behind
    # them (local pools only): 2-4x the appends/s of one producer, 2.5x for 8 producer processes;
    # other processes see rows up to ~50 ms later (docs/pool.md)
    write_ahead: bool = False


class ParallelCfg(_Cfg):
    """The learner's Megatron layout: tp * pp * dp ranks, one Ray actor each (one GPU each on GPU)."""

    tp: PosInt = 1  # tensor parallel: attention heads, MLP and vocabulary split over tp ranks
    pp: PosInt = 1  # pipeline parallel: the layers split into pp stages (1F1B over micro-batches)
    dp: PosInt | Literal["auto"] = 1  # data parallel replicas; auto = learner.num_gpus / (tp * pp), 1 on CPU
    # expert parallel (MoE models): each of ep ranks holds num_experts / ep experts and tokens travel
    # to their experts all-to-all. Carved out of the data-parallel ranks as in megatron: ep divides dp
    ep: PosInt = 1
    # with dp > 1: each DP rank keeps 1/dp of Adam's moments (megatron's distributed optimizer, ZeRO-1)
    distributed_optimizer: bool = True


class MoeCfg(_Cfg):
    """Mixture-of-experts router losses (megatron's TransformerConfig defaults); MoE models only."""

    # aux_loss: load balancing over the micro-batch (Switch/GShard); seq_aux_loss: per sequence;
    # global_aux_loss: over the data-parallel batch; none
    load_balancing: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    # Weight of that loss (0 = none). Added per micro-batch, as megatron adds it with per-token losses
    aux_loss_coeff: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    z_loss_coeff: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # router z-loss (ST-MoE); 0 = none


class LoraCfg(_Cfg):
    """LoRA adapters on the learner's linear layers (docs/lora.md): only they train, and a version
    push sends only them (engines apply them by name, SGLang's lora_path). The SFT warm-start
    still trains the whole model; the adapters start after it."""

    rank: PosInt = 8  # r: A is [r, in], B is [out, r] (B starts at 0, so version 0 is the base model)
    alpha: PosFloat = 16.0  # B A x is scaled by alpha / rank (peft's lora_alpha)
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0  # on the adapter's input, while training
    # HF names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), SGLang's fused
    # qkv_proj / gate_up_proj, megatron's linear_qkv / linear_proj / linear_fc1 / linear_fc2, or
    # all-linear. Megatron fuses q/k/v and gate/up: name all of a fused layer's modules or none
    target_modules: list[str] = msgspec.field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class LearnerCfg(_Cfg):
    """Optimisation and the RL objective (formulas: streamrl/core/algorithms/)."""

    parallel: ParallelCfg = msgspec.field(default_factory=ParallelCfg)
    lora: LoraCfg | None = None  # null: train every weight; a mapping: LoRA adapters only (LoraCfg)
    moe: MoeCfg = msgspec.field(default_factory=MoeCfg)
    # MoE: each token goes to the experts the engine routed it to (R3: the samples' stored routing;
    # connectors/megatron/routing.py), so the learner's log-probs are those of the network that
    # sampled; samples without routing data are routed by the learner and counted
    # (routing_missing_rows). Off: the learner routes every token itself (routing_own_mismatch says
    # how often it disagrees with the engine)
    routing_replay: bool = True
    lr: PosFloat = 1e-5
    warmup_steps: NonNegInt = 0
    threads: PosInt = 1  # torch CPU threads of the learner process
    # fp32, or bf16: megatron's mixed precision (bf16 weights and activations, fp32 main weights in
    # the optimizer, gradients reduced in fp32; log-probs and the loss in fp32). Engines get the
    # weights in this dtype
    dtype: Literal["fp32", "bf16"] = "fp32"
    num_gpus: NonNegInt = 0  # GPUs for the whole learner (one per rank: tp * pp * dp); 0 = CPU
    cpus: list[NonNegInt] = []  # pin the learner to these cores (Linux; rank r takes cpus[r::ranks]); empty = no pinning
    micro_batch_size: PosInt = 8
    # Padded tokens (rows x longest row) a micro-batch may hold; null = rows alone decide. Rows are
    # grouped by length either way, so a long-tailed batch does not pad every row to its longest.
    max_tokens_per_micro_batch: PosInt | None = None
    grad_clip: PosFloat = 1.0
    # The RL step (streamrl/core/algorithms/step.py has the formulas and the plug-in contracts):
    # each of advantage, loss and off_policy names a built-in or a function `pkg.mod:fn`.
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | fn(rewards [G, n]) -> [G, n]
    loss: str = "ppo"  # ppo (PPO clip, eps_clip_*, dual_clip) | fn(logp, inputs, cfg) -> loss [, stats]
    loss_agg: Literal["token", "seq", "group"] = "token"
    # Where a sample's advantage goes: sequence = every token (GRPO); first_error, when the reward
    # returns the component `first_error` (character offset of the first wrong character): a
    # below-average sample trains on the token it blames alone, an above-average one on its tokens
    # before it (streamrl/core/credit.py says why)
    negative_credit: Literal["sequence", "first_error"] = "sequence"
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
    # one_step_off), none when it is on-policy (lockstep, max_staleness 0); or
    # fn(prox, behav, mask) -> (weight, mask, capped, dropped).
    off_policy: str = "auto"
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
    # embedded: the CPU engine over transformers that speaks SGLang's API; sglang: SGLang (on GPUs; where the cluster
    # has none, on the CPU from the venv `make sglang` builds, docs/engines.md); auto: SGLang where the cluster has GPUs
    backend: Literal["embedded", "sglang", "auto"] = "embedded"
    host: str = "127.0.0.1"  # the address the engines bind; another exposes them beyond this machine; not 0.0.0.0
    router_policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "round_robin"  # sglang-router's
    weight_sync: Literal["distributed", "disk"] = "distributed"  # how new versions reach the engines
    # distributed: the longest one bucket of a push (and the engines' joining) may take before the push
    # fails and falls back to disk; it bounds each bucket, not the push, so any model size passes
    push_timeout_s: PosFloat = 600.0
    push_bucket_mb: PosFloat = 512.0  # distributed: bucket size (an engine holds one beside its weights while receiving)
    tp: PosInt = 1  # tensor parallel size per engine: each TP rank joins the weight group (embedded: 1 process)
    max_running: PosInt = 64  # embedded engine: requests decoded together
    threads: PosInt = 1  # engines on CPU (embedded, or SGLang without a GPU): torch CPU threads
    extra_args: list[str] = []  # SGLang launch_server arguments
    keep_weights: NonNegInt = 2  # pushed versions kept under RUN_DIR/weights (disk sync); 0 = all
    cpus: list[NonNegInt] = []  # engines on CPU (embedded, or SGLang without a GPU): pin to these cores (Linux); empty = none
    # SGLang engines: the Python interpreter that starts them, for engines kept in their own environment
    # (docs/gpu.md); None = the one running StreamRL. Must exist and be executable on every engine node
    python: str | None = None


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


def learner_layout(r: Recipe) -> tuple[int, int, int]:
    """(tp, pp, dp) of the learner, `dp: auto` resolved (the recipe was validated)."""
    p = r.learner.parallel
    dp = p.dp if p.dp != "auto" else max(1, r.learner.num_gpus // (p.tp * p.pp))
    return p.tp, p.pp, dp
