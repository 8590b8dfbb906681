"""`streamrl recipe from-slime`: launch scripts shaped like slime's (bash arrays of flags passed
to train.py, variables with defaults, comments, a sourced model file) become recipes that pass
`streamrl check`, with every flag either mapped or listed with the reason it was not. The
scripts here are written for the test in slime's layout; slime's own scripts are not committed."""

from __future__ import annotations

from pathlib import Path

import yaml

from streamrl.recipe import load_recipe
from streamrl.tools.cli import main
from streamrl.tools.from_slime import convert, flags, shell_words

MATH_SCRIPT = r'''#!/bin/bash
set -ex
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/some-model.sh"
DATA="${DATA:-/data/math/train.jsonl}"

CKPT_ARGS=(
   --hf-checkpoint /models/Qwen-Small
   #--hf-checkpoint /models/Qwen-Small-FP8
   --ref-load /models/Qwen-Small_torch_dist
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data $DATA
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 300
   --rollout-batch-size 16
   --n-samples-per-prompt 8
   --rollout-max-response-len 4096
   --rollout-temperature 0.8
   --global-batch-size 64
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --recompute-granularity full
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --eps-clip 0.2
   --eps-clip-high 0.28
)

ray job submit --address="http://127.0.0.1:8265" \
   -- python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 4 \
   --colocate \
   ${MODEL_ARGS[@]} \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${PERF_ARGS[@]} \
   "${GRPO_ARGS[@]}" \
   --rollout-num-gpus-per-engine 2 \
   --sglang-mem-fraction-static 0.7 \
   --lr 1e-6
'''

AGENT_SCRIPT = r'''
ROLLOUT_ARGS=(--prompt-data /data/qa.parquet --input-key prompt --label-key reward_model
   --num-rollout 10 --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 512)
CUSTOM_ARGS=(
   --custom-generate-function-path my_agent.generate
   --custom-rm-path my_agent.reward_func
   --reward-key em
   --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
)
python3 train_async.py --hf-checkpoint /models/m ${ROLLOUT_ARGS[@]} ${CUSTOM_ARGS[@]} --use-tis --tis-clip 2.0
'''

AGENT_MODULE = '''
async def generate(args, sample, sampling_params):
    return sample


async def reward_func(args, sample, **kwargs):
    return {"em": 1.0}
'''


def test_shell_words_expands_arrays_variables_and_drops_comments():
    words, entry = shell_words(MATH_SCRIPT)
    assert entry == "train.py"
    assert "--hf-checkpoint" in words and words[words.index("--hf-checkpoint") + 1] == "/models/Qwen-Small"
    assert words.count("--hf-checkpoint") == 1  # the commented-out one is gone
    assert words[words.index("--prompt-data") + 1] == "/data/math/train.jsonl"  # ${DATA:-default}
    assert flags(["x", "--a", "1", "2", "--b", "--c=3"]) == [("--a", ["1", "2"]), ("--b", []), ("--c", ["3"])]


def test_math_script_maps_and_lists_what_it_cannot(tmp_path: Path, capsys):
    script = tmp_path / "run-math.sh"
    script.write_text(MATH_SCRIPT)
    out = tmp_path / "math.yaml"
    assert main(["recipe", "from-slime", str(script), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "--colocate: StreamRL does not colocate" in err and "--sequence-parallel:" in err, err
    assert "(source" in err and "--ref-load" in err
    r = load_recipe(out)
    assert (r.model.path, r.data.path, r.data.prompt_key) == ("/models/Qwen-Small", "/data/math/train.jsonl", "prompt")
    assert (r.run.mode, r.run.steps, r.run.checkpoint_every) == ("lockstep", 300, 20)
    assert (r.rollout.groups_per_step, r.rollout.n_samples, r.rollout.max_new_tokens) == (16, 8, 4096)
    assert r.rollout.temperature == 0.8 and r.reward.fn == "streamrl.plugins.rewards:math_boxed"
    assert r.learner.mini_batches == 2  # 16 x 8 samples in global batches of 64
    assert (r.learner.num_gpus, r.learner.parallel.tp, r.learner.parallel.dp) == (4, 2, "auto")
    assert (r.learner.kl_estimator, r.learner.eps_clip_high, r.learner.lr) == ("k3", 0.28, 1e-6)
    assert r.learner.max_tokens_per_micro_batch == 9216
    assert (r.engines.backend, r.engines.num, r.engines.tp) == ("sglang", 2, 2)
    assert r.engines.extra_args == ["--mem-fraction-static", "0.7"]
    text = out.read_text()
    assert "# not mapped" in text and "#   --balance-data:" in text
    assert main(["check", str(out)]) == 0
    assert main(["recipe", "from-slime", str(script), "-o", str(out)]) == 2  # never overwrites


def test_agent_script_keeps_slime_functions_and_checks(tmp_path: Path, monkeypatch):
    (tmp_path / "my_agent.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    c = convert(AGENT_SCRIPT)
    assert c.recipe["run"]["mode"] == "one_step_off"
    assert c.recipe["env"] == {"fn": "my_agent:generate", "style": "slime"}
    assert c.recipe["reward"] == {"fn": "my_agent:reward_func", "style": "slime", "args": {"reward_key": "em"}}
    assert c.recipe["filters"] == [{"fn": "streamrl.plugins.filters:nonzero_std"}]
    assert c.recipe["learner"]["off_policy"] == "tis" and c.recipe["learner"]["tis_cap"] == 2.0
    assert not c.unmapped, c.unmapped
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(c.recipe))
    r = load_recipe(path)
    assert r.env.style == "slime" and r.reward.args == {"reward_key": "em"}


def test_not_a_slime_script_exits_2(tmp_path: Path, capsys):
    p = tmp_path / "x.sh"
    p.write_text("echo hello\n")
    assert main(["recipe", "from-slime", str(p)]) == 2
    assert "no slime flags found" in capsys.readouterr().err


def test_values_it_cannot_expand_are_listed_not_guessed(tmp_path: Path):
    c = convert('NUM=8\nROLLOUT=$((NUM - 2))\npython3 train.py --hf-checkpoint $HF --num-rollout $NUM '
                '--rollout-num-gpus "${ROLLOUT}" --prompt-data /d.jsonl\n')
    assert c.recipe["run"]["steps"] == 8 and c.recipe["model"]["path"] == "MODEL_PATH"
    why = dict(c.unmapped)
    assert "could not expand" in why["--hf-checkpoint $HF"], why
    assert "could not expand" in why["--rollout-num-gpus ${ROLLOUT}"], why
    assert "set model.path" in why["(model.path)"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(c.recipe))
    load_recipe(path)


def test_fully_async_rollout_streams_and_credentials_stay_out():
    c = convert("python3 train_async.py --hf-checkpoint /m --prompt-data /d.jsonl --wandb-key abc123 "
                "--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async\n")
    assert c.recipe["run"]["mode"] == "stream"
    assert "abc123" not in yaml.safe_dump(c.recipe) and "WANDB_API_KEY" in dict(c.unmapped)["--wandb-key abc123"]
