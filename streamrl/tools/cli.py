"""`streamrl` command line. Exit codes: 0 ok, 1 unexpected failure, 2 bad input (recipe,
pool path, query) reported without a traceback.

Long file: the argparse parser holds the help text of every command, which users read with --help.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pyarrow.csv as pcsv
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from streamrl.connectors.auth import ADMIN_KEY_ENV, API_KEY_ENV, Keys
from streamrl.connectors.megatron.model_kit import PRESETS, init_model_dir
from streamrl.connectors.ports import is_loopback, is_wildcard
from streamrl.core.evalstats import with_ci
from streamrl.connectors.sglang.engine_process import serve_embedded
from streamrl.pools import PoolError, open_pool
from streamrl.pools import queries as pi
from streamrl.pools.experts import expert_stats
from streamrl.pools.export import export
from streamrl.pools.sql import QueryError
from streamrl.producers import api_process
from streamrl.recipe import RecipeError, dump_recipe, learner_summary, load_recipe
from streamrl.runtime import RunFailed, RunLost
from streamrl.sim.fromrun import RunReadError
from streamrl.sim.plan import PlanError
from streamrl.tools.from_slime import from_slime
from streamrl.tools.init import init_project
from streamrl.tools.plan import print_plan, run_plan
from streamrl.tools.plan_memory import memory_plan, model_config, print_memory
from streamrl.tools.report import report_command

EPILOG = """examples:
  streamrl init myproject                                    # a starter recipe + reward function to edit
  streamrl run recipes/quickstart.yaml                       # SFT warm-start, then streaming GRPO
  streamrl run recipes/quickstart.yaml run.mode=lockstep run.steps=10 --run-dir runs/lockstep
  streamrl run --resume runs/quickstart                      # continue a stopped or killed run
  streamrl run --resume runs/quickstart run.steps=400        # ... and train longer
  streamrl replay runs/quickstart --steps 120-125            # re-train steps from the pool, compare losses
  streamrl replay runs/quickstart --where "min_version BETWEEN 10 AND 12 AND reward_std = 0"
  streamrl report runs/quickstart                            # PNG plots + summary table
  streamrl check recipes/quickstart.yaml rollout.n_samples=4
  streamrl recipe from-slime run-qwen3-4B.sh -o qwen3.yaml      # a recipe from a slime launch script
  streamrl model init runs/models/tiny --preset tiny
  streamrl engine serve --model runs/models/tiny --port 30001
  streamrl produce serve runs/quickstart                     # external producers submit groups over HTTP
  streamrl pool stats runs/quickstart --json
  streamrl pool query runs/quickstart "SELECT status, count(*) FROM pool GROUP BY 1"
  streamrl pool query runs/quickstart --as-of-step 40 "SELECT count(*) FROM pool WHERE consumed_step = 40"
  streamrl view runs/quickstart                              # browse the run and its samples (127.0.0.1, token URL)
  streamrl pool show runs/quickstart <GROUP_ID>
  streamrl pool export runs/quickstart out.parquet --where "status = 'consumed'"
  streamrl pool export runs/quickstart pairs --kind dpo --format hf   # DPO pairs: datasets.load_dataset("pairs")
"""


class UsageError(Exception):
    """Bad input: printed as `streamrl: error: ...`, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamrl",
        description="StreamRL: bounded-off-policy streaming RL post-training with a persistent experience pool.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    ini = sub.add_parser("init", help="start a project: a starter recipe and a reward function to edit",
                         description="Write DIR/recipe.yaml (the quick-start task) and DIR/my_rewards.py (the reward "
                                     "function the recipe names as my_rewards:score). Then, in DIR: `streamrl check "
                                     "recipe.yaml`, `streamrl run recipe.yaml`. Existing files are never overwritten.")
    ini.add_argument("dir", help="project directory (created if missing)")
    c = sub.add_parser("check", help="validate a recipe and print it with every default filled in",
                       description="Validate RECIPE (types, ranges, function paths) and print the resolved "
                                   "recipe. Exit code 2 names the file, line and key of the first problem.")
    c.add_argument("recipe")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. rollout.n_samples=4 (YAML values)")

    rc = sub.add_parser("recipe", help="write recipes: from-slime turns a slime launch script into one")
    rsub = rc.add_subparsers(dest="recipe_cmd", required=True, metavar="SUBCOMMAND")
    fs = rsub.add_parser("from-slime", help="a recipe from a slime launch script (its flag arrays) or argument list",
                         description="Read a slime run script (the bash arrays of flags it passes to train.py, with "
                                     "simple variables expanded) or a file holding the arguments, and write a StreamRL "
                                     "recipe with every flag it maps. The flags it could not map are listed with the "
                                     "reason, on stderr and as comments in the recipe (docs/slime.md).")
    fs.add_argument("script", help="the launch script or argument file; - reads stdin")
    fs.add_argument("-o", "--output", help="write the recipe here (default: stdout); an existing file is not overwritten")

    r = sub.add_parser("run", help="train: engines + router + learner + rollout workers on Ray",
                       description="Run RECIPE: start a local Ray cluster (or join ray.address), the sglang-router, "
                                   "engines.num engines and the megatron learner; warm-start with SFT when the recipe "
                                   "has an sft: section; evaluate on data.eval_path; train run.steps steps in run.mode "
                                   "(stream, lockstep or one_step_off); evaluate again. Writes RUN_DIR/metrics.jsonl "
                                   "(one line per step), eval.jsonl, events.jsonl, run.log, checkpoints/, model/ (the "
                                   "trained policy), sft_model/, recipe.yaml and pool/. Without --run-dir or run.dir each run gets "
                                   "a new directory runs/<run.name>-<date>-<time> and runs/<run.name> links to the newest, so "
                                   "earlier runs are kept. A RUN_DIR that already holds a run is never replaced silently: "
                                   "`--resume RUN_DIR` continues it, --overwrite deletes it first.")
    r.add_argument("recipe", nargs="?", help="recipe file (not with --resume: the run's own recipe.yaml is used)")
    r.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. run.mode=lockstep staleness.max_staleness=4")
    r.add_argument("--run-dir", help="run directory (default: run.dir, else a new runs/<run.name>-<date>-<time>, "
                                     "with runs/<run.name> linking to it)")
    r.add_argument("--overwrite", action="store_true",
                   help="with --run-dir (or run.dir) naming a directory that holds a run: delete that run (pool, "
                        "checkpoints, logs, model) and start again there, without asking")
    r.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a stopped or killed run from its last checkpoint: learner, optimizer, version, "
                        "dataset positions and the pool (partial groups resume from their saved tokens; steps "
                        "trained after the checkpoint are trained again on the same groups). Run it from the "
                        "directory the run was started in (recipe paths are relative to it); KEY=VALUE "
                        "overrides apply, e.g. run.steps=400 to train longer")
    r.add_argument("--trust-run-dir", action="store_true",
                   help="with --resume: import the user code RUN_DIR/recipe.yaml names even where it is not what "
                        "the run loaded when it started (RUN_DIR/user_modules.json), e.g. a reward you edited, "
                        "or modules kept in RUN_DIR; only for a run directory whose contents you trust")
    r.add_argument("--quiet", action="store_true", help="no progress bar or log lines (summary only)")

    rp = sub.add_parser("replay", help="train past steps again from the pool; compare losses and grad norms",
                        description="Re-train steps of RUN_DIR on exactly the groups they consumed (the pool records "
                                    "the step and the pool version its claim read, so later appends and compactions "
                                    "do not change them), starting from the newest checkpoint at or before the first step, and "
                                    "print the loss and grad norm the run logged next to the replayed ones (identical "
                                    "on CPU). --where re-trains a SQL-selected set of groups instead, in batches of "
                                    "rollout.groups_per_step. The learner runs in this process; the pool is not "
                                    "changed.")
    rp.add_argument("run_dir")
    what = rp.add_mutually_exclusive_group(required=True)
    what.add_argument("--steps", metavar="A-B", help="learner steps to replay, e.g. 120-125 (or one step: 120)")
    what.add_argument("--where", metavar="SQL",
                      help="filter over one row per group, e.g. \"min_version BETWEEN 10 AND 12 AND reward_std = 0\"; "
                           "columns: group_id, prompt_id, producer_id, status, n_samples, min_version, max_version, "
                           "consumed_step, consumed_version, created_ns, drop_reason, reward_mean, reward_std, "
                           "reward_min, reward_max, tokens_mean, failed_samples")
    rp.add_argument("--json", action="store_true", help="print one JSON object per step/batch instead of a table")
    rp.add_argument("--trust-run-dir", action="store_true",
                    help="import user code the run did not load when it started (see `streamrl run --help`)")

    rep = sub.add_parser("report", help="PNG plots and a summary table of a run",
                         description="Write RUN_DIR/report/*.png (reward and eval accuracy vs version and wall time, "
                                     "staleness at consumption, generation/training throughput, drops by reason, "
                                     "learner loss/grad norm/KL/entropy) and print a summary table. Works on a run "
                                     "that is still going or was killed.")
    rep.add_argument("run_dir")
    rep.add_argument("--out", help="output directory (default RUN_DIR/report)")
    rep.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    pl = sub.add_parser(
        "plan", help="size a cluster for a run's workload: engine/learner split, staleness, partial rollout, schedule",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="With a recipe file: what each learner rank will hold for the model (weights, fp32 gradients, "
                    "fp32 main copies, Adam, a reference model) and its activations at the recipe's dtype, layout and "
                    "micro-batch, against --gpu-gb, before anything starts. With a run directory: read RUN_DIR's pool (the response lengths, how much of them each prompt explains) and its log "
                    "(the recipe's batch and settings; with --calibrate, what each step took), simulate that workload "
                    "on --gpus GPUs in lockstep, one_step_off and stream (max_staleness 1/2/4/8, abort_resume and "
                    "restart) at three engine/learner splits, then the prompt schedules on the best, and print the "
                    "configuration to run: the most tokens trained per second within 5%% with the least staleness. "
                    "The hardware is --model-size's preset (bf16 on H100s, scaled from a 7B model by parameter count) "
                    "or `run`: the machine the run ran on. A first-order model (no KV-cache limit, no stragglers): "
                    "compare configurations with it, then measure the one you pick.",
        epilog="""examples:
  streamrl plan recipes/gpu_qwen2.5_7b_math.yaml                 # GB per learner rank: does it fit?
  streamrl plan recipes/gpu_qwen2.5_7b_math.yaml learner.parallel.tp=4 learner.num_gpus=8 --json
  streamrl plan runs/longtail --gpus 64                          # a 7B model on 64 H100s
  streamrl plan runs/longtail --gpus 512 --model-size 32b --groups-per-step 512 --n-samples 16
  streamrl plan W/lockstep --gpus 2 --model-size run --calibrate W/stream   # vs what the runs measured
writes RUN_DIR/plan/plan.json and plan.png (or --out DIR)""")
    pl.add_argument("run_dir", help="a run directory (streamrl run, or a benchmark's); or a recipe file: what each "
                                    "learner rank will hold for the model (weights, gradients, optimizer), before launching")
    pl.add_argument("overrides", nargs="*", metavar="key=value", help="with a recipe: overrides, as `streamrl run` takes")
    pl.add_argument("--gpus", type=int, help="GPUs in all, engines and learner together (a run directory's plan)")
    pl.add_argument("--model-config", metavar="FILE",
                    help="with a recipe: the model's config.json, when model.path is not on this machine (the models "
                         "the GPU recipes name are known without it)")
    pl.add_argument("--gpu-gb", type=float, default=80.0, help="with a recipe: one learner GPU's memory (default 80)")
    pl.add_argument("--prompt-tokens", type=int, default=512,
                    help="with a recipe: the longest prompt in tokens; a micro-batch's rows are up to this plus "
                         "rollout.max_new_tokens long (activations grow with them; default %(default)s)")
    pl.add_argument("--model-size", default="7b",
                    help="parameters in billions (1.5b, 7b, 32b, 72b, ...): H100 preset; or `run`: the run's own "
                         "machine, each GPU one of its devices (default %(default)s)")
    pl.add_argument("--groups-per-step", type=int, help="prompts per step (default: the run's rollout.groups_per_step)")
    pl.add_argument("--n-samples", type=int, help="samples per prompt (default: the run's rollout.n_samples)")
    pl.add_argument("--steps", type=int, default=16,
                    help="learner steps simulated per configuration, the first quarter as warm-up (default 16)")
    pl.add_argument("--calibrate", nargs="*", metavar="OTHER_RUN",
                    help="also simulate the run's own configuration on the machine it ran on, fitted on RUN_DIR, "
                         "and set it against what RUN_DIR and each OTHER_RUN (the same recipe in other modes) "
                         "measured; fit on a lockstep run: its rates are the uncontended ones")
    pl.add_argument("--out", help="output directory (default RUN_DIR/plan)")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")

    m = sub.add_parser("model", help="build a tiny HF-format model and tokenizer locally (no download)")
    ms = m.add_subparsers(dest="model_cmd", required=True, metavar="ACTION")
    mi = ms.add_parser("init", help="write a Qwen2/Qwen3/Qwen3-MoE model + byte-level BPE tokenizer with save_pretrained",
                       description="Create OUT_DIR with config.json, model.safetensors and tokenizer files that load "
                                   "in transformers, the embedded engine, mbridge/megatron and SGLang.")
    mi.add_argument("out_dir")
    mi.add_argument("--preset", choices=list(PRESETS), default="tiny",
                    help="tiny: Qwen2, ~0.1M parameters (tests); small: ~3M (quick-start learner); tiny-qwen3: "
                         "Qwen3 dense, ~0.1M; tiny-moe / small-moe: Qwen3-MoE, top-2 of 4 experts, ~0.16M / ~4M")
    mi.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    mm = ms.add_parser("merge-lora", help="merge a LoRA adapter (PEFT directory) into an HF model directory",
                       description="Write OUT_DIR: BASE_DIR's model with ADAPTER_DIR's LoRA adapter merged into its "
                                   "weights (W + alpha / r * B A). A LoRA run publishes its adapters under "
                                   "RUN_DIR/weights/lora-v<version> and RUN_DIR/adapter; their base is RUN_DIR/sft_model "
                                   "after an SFT warm-start, else the recipe's model.path (docs/lora.md).")
    mm.add_argument("base_dir")
    mm.add_argument("adapter_dir")
    mm.add_argument("out_dir")

    e = sub.add_parser("engine", help="run the embedded CPU engine (SGLang's HTTP API)")
    es = e.add_subparsers(dest="engine_cmd", required=True, metavar="ACTION")
    ev = es.add_parser("serve", help="serve a model directory over SGLang's native HTTP API",
                       description="Serve /generate, /abort_request, /pause_generation, weight updates, "
                                   "/model_info and /v1/chat/completions like an SGLang server, on the CPU. With "
                                   "STREAMRL_API_KEY / STREAMRL_ADMIN_KEY in the environment it wants them as SGLang's "
                                   "--api-key / --admin-api-key do ('Authorization: Bearer KEY'; /health needs none).")
    ev.add_argument("--model", required=True, help="HF model directory (e.g. from `streamrl model init`)")
    ev.add_argument("--host", default="127.0.0.1",
                    help="bind address (default 127.0.0.1: this machine only). Another address needs "
                         "STREAMRL_API_KEY and STREAMRL_ADMIN_KEY in the environment; 0.0.0.0 is refused")
    ev.add_argument("--port", type=int, default=30000, help="port (0: any free port, printed)")
    ev.add_argument("--max-running", type=int, default=64, help="requests decoded together (continuous batching)")
    ev.add_argument("--weight-version", default="0")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: engines share the CPU; more only on an otherwise idle machine)")
    ev.add_argument("--weights-root", help="load weights (/update_weights_from_disk) only from under this directory "
                                           "(default: the --model directory)")

    pr = sub.add_parser("produce", help="let other processes stream sample groups into a run (producer API)")
    prs = pr.add_subparsers(dest="produce_cmd", required=True, metavar="ACTION")
    pv = prs.add_parser(
        "serve", help="serve the producer API of a run over HTTP",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve RUN_DIR's producer API: external producers (agent environments, other clusters) lease "
                    "staleness slots and submit finished sample groups, which are validated and appended to the "
                    "run's pool. The run must have producer_api.enabled=true (it then reserves the last share of "
                    "the admission capacity for them) and run.mode=stream. Start it from the directory the run "
                    "was started in (recipe paths are relative to it); `streamrl run` starts it itself.",
        epilog="""files in RUN_DIR:
  reads   recipe.yaml, events.jsonl (the published policy version), endpoints.json (router_url, api_key),
          the model's config.json (vocab_size, max_position_embeddings), the pool
  writes  producer_token (bearer token, mode 0600, created once), producer.json ({url, pid,
          token_file} while serving), producer.lock (one service per run), logs/producer.log
          (one line per refused submission)

routes (all but /health need 'Authorization: Bearer <token>'; errors are
{"error": {"code", "reason"}}):
  GET  /health                 200 when serving
  GET  /v1/status              version, max_staleness, groups_per_step, n_samples, room,
                               outstanding, started, stored, router_url, router_api_key, counters
  POST /v1/leases              {"producer_id", "groups"} -> {lease_id, slots, version, expires_at_s};
                               429 with retry_after_s while the staleness bound is reached
  POST /v1/groups              {"lease_id", "group": SampleGroup} as application/json or
                               application/msgpack; 200 {stored: true} or {duplicate: true} (group ids
                               are idempotency keys); 401, 400, 409, 413, 415, 422 say why not
  GET  /v1/groups/{group_id}   {group_id, status} of a stored group, or 404

SDK: streamrl.producers.sdk.ProducerClient.from_run_dir(RUN_DIR, "my-env")""")
    pv.add_argument("run_dir")
    pv.add_argument("--host", help="bind address (default producer_api.host, 127.0.0.1: this machine only)")
    pv.add_argument("--port", type=int, help="port (default producer_api.port; 0 = any free port)")
    pv.add_argument("--quiet", action="store_true", help="no start-up line, refusals only in logs/producer.log")

    vw = sub.add_parser(
        "view", help="browse a run in a web page: run at a glance, samples by SQL filter, tokens by version",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a local web page over RUN_DIR (or a pool URI, also on S3; read-only): reward, length, "
                    "staleness and accuracy against step and time and the ledger; a sample browser filtered by SQL "
                    "(the --where of `pool query`), step, version and reward; one sample's tokens coloured by the "
                    "policy version that sampled them (hover: version, log-probs, advantage, loss mask), agent turns "
                    "and tool output apart; a group side by side; a prompt across versions. It listens on 127.0.0.1 "
                    "only and prints a URL with a random token, which every request needs (like Jupyter). Pages "
                    "stream from the pool: the browser never holds more than a page of samples. Nothing is loaded "
                    "from the network.",
        epilog="""examples:
  streamrl view runs/quickstart                       # open the printed http://127.0.0.1:PORT/?token=... URL
  streamrl view runs/quickstart --as-of-step 40       # start at the pool as step 40 read it (the page can change it)
  streamrl view runs/quickstart --html report.html --where "status = 'consumed' AND reward > 0"
  ssh -L 8765:127.0.0.1:8765 cluster-head streamrl view runs/big --port 8765   # from another machine""")
    vw.add_argument("run_dir", help="run directory, or a pool URI (s3://...)")
    vw.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: any free port)")
    vw.add_argument("--as-of-step", type=int, metavar="N",
                    help="the pool as learner step N read it (see `pool query --help`): the page opens there "
                         "(its as-of box changes it), the --html report holds it")
    vw.add_argument("--html", metavar="FILE",
                    help="write a static, self-contained report to FILE instead of serving: the summary and up to "
                         "--samples samples (with their groups and prompts) to share; no server, no token")
    vw.add_argument("--where", metavar="SQL", help="with --html: the samples the report holds (SQL over the pool's "
                                                   "scalar columns, as `pool query` sees them)")
    vw.add_argument("--samples", type=int, default=200, help="with --html: at most this many samples (default 200)")

    pool = sub.add_parser("pool", help="inspect an experience pool (stats, query, show, export)")
    ps = pool.add_subparsers(dest="pool_cmd", required=True, metavar="ACTION")
    st = ps.add_parser("stats", help="rows/groups by status, versions, staleness, rewards, ledger",
                       description="Summarise the pool of RUN_DIR (or a LanceDB URI). --json prints the stable "
                                   "document described in docs/pool.md; `ledger.lost` and `ledger.duplicated` must be 0.")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    _as_of_args(st)
    q = ps.add_parser("query", help="DuckDB SQL over the pool (tables `pool`, `admissions`, `claims`)",
                      description="Run one SELECT over the pool, read-only (no COPY, ATTACH, INSTALL, LOAD or file "
                                  "functions). Only the columns the query names are read, so avoid "
                                  "SELECT * on big pools. Schema: pools/schema.py.")
    q.add_argument("run_dir")
    q.add_argument("sql")
    _table_format_args(q)
    _as_of_args(q)
    xp = ps.add_parser("experts", help="MoE routing: how often each expert was chosen, per policy version and layer",
                       description="Count the routed experts the pool stores (rollout.routing) per policy version, "
                                   "layer and expert: `chosen` times and `share` of that version and layer's choices. "
                                   "A position counts under the version that generated the token after it.")
    xp.add_argument("run_dir")
    xp.add_argument("--where", help="SQL filter on sample rows, e.g. \"status = 'consumed'\"")
    _table_format_args(xp)
    sh = ps.add_parser("show", help="one group: decoded text, versions, rewards")
    sh.add_argument("run_dir")
    sh.add_argument("group_id")
    sh.add_argument("--tokenizer", help="tokenizer.json or model dir (default: the one recorded in the pool)")
    _as_of_args(sh)
    ex = ps.add_parser(
        "export", help="write selected samples for SFT, rejection sampling, DPO or sharing (parquet, jsonl, hf)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the pool rows --where selects (SQL over the pool's columns, as `pool query` sees them) as "
                    "--kind rows in --format, streaming with a progress bar and bounded memory. Text columns are "
                    "decoded with the tokenizer the run recorded (or --tokenizer), special tokens kept; token "
                    "columns hold the exact ids the policy sampled.",
        epilog="""kinds:
  samples  one row per sample: prompt, completion, reward, rewards (JSON), versions, status, prompt_tokens,
           completion_tokens, loss_mask, rollout_logprobs, version_spans (TRL prompt-completion columns)
  best     the highest-reward sample of each group (best-of-n / rejection sampling), + group_size, group_reward_mean
  dpo      per group, best (chosen) vs worst (rejected) scored sample, groups whose rewards differ
           (TRL preference columns: prompt, chosen, rejected, + rewards, indices and tokens)
  raw      every pool column (to share or archive the pool)

formats (default from OUT: .parquet, .jsonl, anything else is an hf directory):
  parquet  one file          jsonl  one JSON object per line
  hf       OUT/data/train-*.parquet + OUT/README.md (dataset card): datasets.load_dataset("OUT")

examples:
  streamrl pool export runs/quickstart sft.parquet --kind best --where "status = 'consumed' AND reward > 0"
  streamrl pool export runs/quickstart pairs --kind dpo --format hf
  streamrl pool export runs/quickstart all.jsonl --kind raw --where "min_version >= 100"
""")
    ex.add_argument("run_dir")
    ex.add_argument("out", help="output file (.parquet, .jsonl) or directory (hf)")
    ex.add_argument("--where", help="SQL filter on sample rows, e.g. \"status = 'consumed' AND min_version >= 3\"")
    ex.add_argument("--kind", choices=["samples", "best", "dpo", "raw"], default="samples",
                    help="what one row is (default samples; see below)")
    ex.add_argument("--format", dest="fmt", choices=["parquet", "jsonl", "hf"],
                    help="output format (default: from OUT's suffix)")
    ex.add_argument("--tokenizer", help="tokenizer.json or model dir for the text columns (default: the one the "
                                        "run recorded)")
    ex.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _table_format_args(p: argparse.ArgumentParser) -> None:
    """--json / --csv for a command that prints a table (a rich table by default)."""
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="a JSON array of row objects")
    fmt.add_argument("--csv", action="store_true", help="CSV with a header row")


def _as_of_args(p: argparse.ArgumentParser) -> None:
    when = p.add_mutually_exclusive_group()
    when.add_argument("--as-of-step", type=int, metavar="N",
                      help="read the pool as learner step N read it when it claimed its batch: the pool table at "
                           "the version that claim read, with the claims of steps 0..N (so consumed_step = N "
                           "selects exactly what step N trained on); works after later appends and compactions "
                           "while that version is kept (pool.keep_versions, checkpoint tags: docs/pool.md)")
    when.add_argument("--version", metavar="V",
                      help="read the pool table at Lance version V (a number, or a tag such as checkpoint-v000010 "
                           "that a checkpoint made), with the claims made on versions <= V")


def _run_dir_plan(args: argparse.Namespace) -> dict[str, Any]:
    """`streamrl plan RUN_DIR --gpus N`: the flags checked, then the simulated sweep (streamrl/tools/plan.py)."""
    if args.gpus is None:
        raise UsageError("streamrl plan RUN_DIR needs --gpus N (a recipe file needs none)")
    if args.overrides:
        raise UsageError(f"streamrl plan RUN_DIR takes no overrides ({' '.join(args.overrides)}): they apply to a recipe")
    if args.gpus < 2:
        raise UsageError(f"--gpus {args.gpus}: a plan needs at least 2 (one learner GPU, one engine)")
    if args.steps < 4:
        raise UsageError(f"--steps {args.steps}: at least 4 (the first quarter is warm-up)")
    for flag, value in (("--groups-per-step", args.groups_per_step), ("--n-samples", args.n_samples)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: at least 1")
    try:
        out = run_plan(args.run_dir, args.gpus, args.model_size, args.steps, args.groups_per_step,
                       args.n_samples, args.calibrate, args.out, progress=not args.json)
    except (RunReadError, PlanError) as e:
        raise UsageError(str(e)) from None
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.getcwd() not in sys.path:  # recipes name functions in the user's modules (`streamrl.recipes.envs.calculator:solve`)
        sys.path.insert(0, os.getcwd())
    try:
        return _dispatch(args)
    except (RecipeError, PoolError, UsageError) as e:
        print(f"streamrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "init":
        try:
            written = init_project(args.dir)
        except FileExistsError as e:
            raise UsageError(str(e)) from None
        print("wrote " + ", ".join(str(p) for p in written))
        print(f"next: cd {args.dir} && streamrl check recipe.yaml && streamrl run recipe.yaml")
        return 0
    if args.cmd == "recipe":
        return _from_slime(args)
    if args.cmd == "check":
        recipe = load_recipe(args.recipe, args.overrides)
        print(dump_recipe(recipe), end="")
        print(f"# learner: {learner_summary(recipe)}")
        return 0
    if args.cmd == "run":
        # The runtime (Ray, torch, transformers: seconds) loads for `streamrl run` alone.
        from streamrl.runtime.run import resume, run

        try:
            if args.resume:
                overrides = ([args.recipe] if args.recipe else []) + args.overrides
                bad = [o for o in overrides if "=" not in o]
                if bad or args.run_dir or args.overwrite:
                    raise UsageError(f"--resume takes the run directory and KEY=VALUE overrides only, not "
                                     f"{(bad or ['--run-dir' if args.run_dir else '--overwrite'])[0]!r} (the run's own recipe.yaml is used)")
                summary = resume(args.resume, overrides, progress=not args.quiet, trust_run_dir=args.trust_run_dir)
            else:
                if not args.recipe:
                    raise UsageError("streamrl run needs a RECIPE (or --resume RUN_DIR)")
                if args.trust_run_dir:
                    raise UsageError("--trust-run-dir goes with --resume RUN_DIR")
                summary = run(load_recipe(args.recipe, args.overrides), args.run_dir, progress=not args.quiet,
                              overwrite=args.overwrite)
        except RunLost as e:
            print(f"streamrl: {e}", file=sys.stderr)
            return 1
        except (RunFailed, FileExistsError, FileNotFoundError) as e:
            raise UsageError(str(e)) from None
        _print_summary(summary)
        return 0
    if args.cmd == "replay":
        # The learner (torch, megatron: seconds) loads for `streamrl replay` alone; it trains in this process.
        from streamrl.tools import replay as rp

        try:
            if args.steps:
                a, b = rp.parse_steps(args.steps)
                rows = rp.replay_steps(args.run_dir, a, b, progress=not args.json, trust_run_dir=args.trust_run_dir)
                title = f"replay of steps {a}-{b} (from the checkpoint of version {rows[0]['start_version']})"
            else:
                rows = rp.replay_where(args.run_dir, args.where, progress=not args.json,
                                       trust_run_dir=args.trust_run_dir)
                title = f"replay of {sum(r['groups'] for r in rows)} groups where {args.where}"
        except rp.ReplayError as e:
            raise UsageError(str(e)) from None
        if args.json:
            for row in rows:
                print(json.dumps(row))
        else:
            rp.print_rows(rows, title)
        return 0
    if args.cmd == "report":
        try:
            return report_command(args.run_dir, args.out, args.json)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.cmd == "plan":
        if Path(args.run_dir).is_file():  # a recipe: the learner's memory per rank before launching
            recipe = load_recipe(args.run_dir, args.overrides, resolve=False)
            try:
                out = memory_plan(recipe, *model_config(recipe.model.path, args.model_config), args.gpu_gb,
                                  args.prompt_tokens)
            except ValueError as e:
                raise UsageError(str(e)) from None
            show = print_memory
        else:
            out = _run_dir_plan(args)
            show = print_plan
        if args.json:
            print(json.dumps(out))
        else:
            show(out)
        return 0
    if args.cmd == "model" and args.model_cmd == "merge-lora":
        # torch and transformers load for this command alone
        from streamrl.tools.merge_lora import merge_lora

        try:
            out = merge_lora(args.base_dir, args.adapter_dir, args.out_dir)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"merge-lora: {e}") from None
        print(f"wrote {out}: {args.base_dir} with {args.adapter_dir} merged in")
        return 0
    if args.cmd == "model":
        out = init_model_dir(args.out_dir, args.preset, args.seed)
        print(f"wrote {args.preset} model and tokenizer to {out}")
        return 0
    if args.cmd == "engine":
        if not (Path(args.model) / "config.json").is_file():
            raise UsageError(f"{args.model} is not a model directory (no config.json); create one with "
                             f"`streamrl model init {args.model}`")
        _check_engine_host(args.host)
        serve_embedded(model_dir=args.model, host=args.host, port=args.port, max_running=args.max_running,
                       weight_version=args.weight_version, seed=args.seed, threads=args.threads,
                       weights_root=args.weights_root or args.model)
        return 0
    if args.cmd == "view":
        return _view(args)
    if args.cmd == "produce":
        try:
            api_process.serve(args.run_dir, host=args.host, port=args.port, quiet=args.quiet)
        except api_process.ServiceError as e:
            raise UsageError(str(e)) from None
        return 0
    return _pool_cmd(args)


def _view(args: argparse.Namespace) -> int:
    # The viewer (aiohttp, torch for the advantages it shows) loads for `streamrl view` alone.
    from streamrl.tools import view

    if not args.html and args.where:
        raise UsageError("--where goes with --html (the page itself has a filter box)")
    try:
        if args.html:
            n = view.write_html(args.run_dir, args.html, view.Page(where=args.where), args.as_of_step, args.samples)
            print(f"wrote {args.html}: {n} samples" + (f" where {args.where}" if args.where else ""))
        else:
            view.serve(args.run_dir, args.port, args.as_of_step)
    except view.ViewError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot serve or write ({e.strerror or e})") from None
    return 0


def _from_slime(args: argparse.Namespace) -> int:
    try:
        text, conv = from_slime(args.script)
    except OSError as e:
        raise UsageError(f"cannot read {args.script} ({e.strerror or e})") from None
    if not conv.mapped:
        raise UsageError(f"{args.script}: no slime flags found (expected a script that runs train.py with --flags, "
                         "or a list of --flags)")
    if args.output:
        out = Path(args.output)
        if out.exists():
            raise UsageError(f"{out} exists; choose another -o or remove it")
        out.write_text(text)
    else:
        print(text, end="")
    print(f"from-slime: mapped {len(conv.mapped)} flags; not mapped {len(conv.unmapped)}:", file=sys.stderr)
    for flag, why in conv.unmapped:
        print(f"  {flag}: {why}", file=sys.stderr)
    return 0


def _check_engine_host(host: str) -> None:
    """An engine reachable from other machines serves only callers holding both keys."""
    if is_wildcard(host):
        raise UsageError(f"--host {host!r} listens on every interface of this machine; give the one address "
                         "to serve on (127.0.0.1 for this machine only)")
    keys = Keys.from_env()
    if not is_loopback(host) and not (keys.api and keys.admin):
        missing = " and ".join(k for k, v in ((API_KEY_ENV, keys.api), (ADMIN_KEY_ENV, keys.admin)) if not v)
        raise UsageError(f"--host {host} is reachable from other machines: set {missing} in the environment "
                         "(the keys callers must send; never on the command line, where `ps` shows them), "
                         "or serve on 127.0.0.1")


def _as_of(pool: Any, args: argparse.Namespace) -> Any:
    """The pool, or a view of it as of --as-of-step / --version (said on stderr, so stdout stays data)."""
    step, version = getattr(args, "as_of_step", None), getattr(args, "version", None)
    if step is None and version is None:
        return pool
    view = pool.as_of(step=step, version=int(version) if version and version.isdigit() else version)
    print(f"streamrl: reading {view.uri} {view.at.label()}", file=sys.stderr)
    return view


def _pool_cmd(args: argparse.Namespace) -> int:
    pool = open_pool(args.run_dir)
    try:  # closed: `main` also runs in other programs' processes (the tests' ledger checks)
        return _pool_subcommand(_as_of(pool, args), args)
    finally:
        pool.close()


def _pool_subcommand(pool: Any, args: argparse.Namespace) -> int:
    if args.pool_cmd == "stats":
        stats = pi.pool_stats(pool)
        if getattr(pool, "at", None) is not None:
            stats["as_of"] = {"step": pool.at.through_step, "pool_version": pool.at.pool_version}
        if args.json:
            print(json.dumps(stats, indent=2))
        else:
            _print_stats(stats)
        return 0 if stats["ledger"]["balanced"] else 3
    if args.pool_cmd == "query":
        try:
            table = pi.pool_query(pool, args.sql)
        except QueryError as e:
            raise UsageError(f"query failed: {e} (columns: see pools/schema.py)") from None
        _print_table(table, "json" if args.json else "csv" if args.csv else "text")
        return 0
    if args.pool_cmd == "experts":
        try:
            table = expert_stats(pool, args.where)
        except ValueError as e:
            raise UsageError(f"experts failed: {str(e).splitlines()[0]}") from None
        _print_table(table, "json" if args.json else "csv" if args.csv else "text")
        return 0
    if args.pool_cmd == "show":
        groups = pool.groups([args.group_id])
        if not groups:
            raise UsageError(f"no group {args.group_id!r} in {pool.uri} "
                             "(list some with: streamrl pool query RUN_DIR \"SELECT DISTINCT group_id FROM pool LIMIT 10\")")
        _print_group(groups[0], pi.load_decoder(args.tokenizer or pool.tokenizer))
        return 0
    if args.pool_cmd == "export":
        try:
            info = export(pool, args.out, where=args.where, kind=args.kind, fmt=args.fmt, tokenizer=args.tokenizer,
                          progress=not args.quiet)
        except (ValueError, OSError) as e:
            raise UsageError(f"export failed: {str(e).splitlines()[0]}") from None
        where = f" where {args.where}" if args.where else ""
        print(f"wrote {info['rows']} {args.kind} rows ({info['format']}, from {info['samples_read']} samples{where}) "
              f"to {args.out} in {info['seconds']:.1f}s")
        return 0
    raise AssertionError(args.pool_cmd)


def _print_summary(s: dict[str, Any]) -> None:
    b, a = s.get("eval_before"), s.get("eval_after")
    print(f"{s['mode']}: {s['steps']} steps -> policy version {s['policy_version']} in {s['rl_s']:.0f}s "
          f"({s['samples_per_s']:.1f} samples/s; set-up {s['setup_s']:.0f}s), max staleness {s['staleness_max']}, "
          f"engine restarts {s['engine_restarts']}")
    if b and a:
        print(f"held-out accuracy: {with_ci(b, 'accuracy')} -> {with_ci(a, 'accuracy')} (sampled, "
              f"{a['samples_per_prompt']} per prompt; ± 95% interval over {a['prompts']} prompts); "
              f"greedy {with_ci(b, 'greedy_accuracy')} -> {with_ci(a, 'greedy_accuracy')}")
    print(f"trained model: {s['model']}; metrics: {s['run_dir']}/metrics.jsonl; "
          f"pool: streamrl pool stats {s['run_dir']}")


def _print_table(table: Any, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps(table.to_pylist(), default=str))
    elif fmt == "csv":
        pcsv.write_csv(table, sys.stdout.buffer)
    else:
        t = Table()
        for c in table.column_names:
            t.add_column(_cell(c))
        for row in table.to_pylist():
            t.add_row(*(_cell(row[c]) for c in table.column_names))
        Console(width=200).print(t)
        print(f"{table.num_rows} rows")


def _plain(v: Any, limit: int | None = None) -> str:
    """A value from the pool, safe for a terminal: control characters shown escaped (an
    external producer's group id could otherwise move the cursor or recolour the screen)."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))
    return s if limit is None or len(s) <= limit else s[: limit - 3] + "..."


def _cell(v: Any, limit: int = 60) -> Any:
    """`_plain` as rich Text: never read as markup (a group id may hold '[/]')."""
    return Text(_plain(v, limit))


def _print_stats(s: dict[str, Any]) -> None:
    con = Console(width=120)
    led = s["ledger"]
    con.print(f"[bold]{escape(s['uri'])}[/bold]: {s['rows']} rows, {s['groups']} groups, "
              f"{s['response_tokens']} response tokens, versions {s['versions']['min']}..{s['versions']['max']}")
    t = Table("state", "groups", "rows", title="by status")
    for k in ("in_flight", "partial", "complete", "consumed", "dropped", "failed"):
        t.add_row(k, str(led[k]), str(s["rows_by_status"].get(k, 0)))
    con.print(t)
    if s["staleness_histogram"]:
        con.print("staleness at consumption (groups): " +
                  ", ".join(f"{k}: {v}" for k, v in s["staleness_histogram"].items()))
    if s["drops_by_reason"]:
        con.print(_cell("drops by reason: " + ", ".join(f"{k}: {v}" for k, v in s["drops_by_reason"].items()), 1000))
    if s["reward_by_version"]:
        t = Table("version", "groups", "mean reward", title="reward by version")
        for r in s["reward_by_version"]:
            t.add_row(str(r["version"]), str(r["groups"]), "-" if r["mean_reward"] is None else f"{r['mean_reward']:.3f}")
        con.print(t)
    ok = "[green]balanced[/green]" if led["balanced"] else "[red]NOT balanced[/red]"
    con.print(f"ledger: admitted {led['admitted']}, lost {led['lost']}, duplicated {led['duplicated']}, "
              f"unadmitted {led['unadmitted']} -> {ok}")


def _print_group(g: Any, tok: Any) -> None:
    def text(ids: Any) -> str:
        return tok.decode(ids.tolist(), skip_special_tokens=False) if tok is not None else str(ids.tolist())

    print(f"group {_plain(g.group_id)}  prompt {_plain(g.prompt_id)}  status {g.status}  producer {_plain(g.producer_id)}")
    print(f"versions {g.min_version}..{g.max_version}  consumed_step {g.consumed_step}  "
          f"drop_reason {g.drop_reason}")
    print(f"prompt: {text(g.prompt_tokens)!r}")
    for s in g.samples:
        spans = " ".join(f"v{sp.version}[{sp.start}:{sp.end})" for sp in s.spans)
        err = f"  FAILED: {_plain(s.error)}" if s.failed else ""
        masked = int((s.loss_mask == 0).sum())
        note = f" masked={masked} (shown in [[...]])" if masked else ""
        if s.routed_experts is not None:  # positions x layers x top_k (streamrl pool experts counts them)
            note += f" routed_experts={'x'.join(map(str, s.routed_experts.shape))}"
        print(f"  [{s.index}] reward={s.reward} finish={s.finish_reason or '-'} tokens={s.num_tokens} "
              f"spans={spans}{note}{err}")
        print(f"      {_masked_text(s, text)!r}")


def _masked_text(s: Any, text: Any) -> str:
    """The response with the runs the loss ignores (tool output, stale tokens) in [[...]]."""
    out, start = [], 0
    mask = s.loss_mask.tolist()
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            part = text(s.response_tokens[start:i])
            out.append(part if mask[start] else f"[[{part}]]")
            start = i
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
