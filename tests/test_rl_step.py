"""The RL step in one place (streamrl/core/algorithms/step.py): the built-ins give exactly the
numbers the code before the move gave (its formulas are copied below as `old_*`), user functions
named in a recipe by `pkg.mod:fn` go through the same door and change the result as their
contract says, and a bad name or path stops the recipe at load naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlstep_plugins as plug
from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture
from streamrl.connectors.megatron.learner import Sample as Row
from streamrl.core import corrections
from streamrl.core.algorithms import (
    LossInputs,
    RLConfig,
    aggregate,
    entropy_bonus,
    group_advantages,
    kl_penalty,
    loss_inputs,
    micro_batch_loss,
    offpolicy,
    policy_loss,
    sample_advantages,
    tokens_from_samples,
)
from streamrl.core.algorithms.step import BUILTINS
from streamrl.core.types import Sample, SampleGroup, VersionSpan
from streamrl.recipe import RecipeError, fn_paths, load_recipe, resolve_fn
from streamrl.runtime.learner import learner_rows

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
ADVANTAGES = corrections.CHOICES["advantage"]
OFF_POLICIES = corrections.CHOICES["off_policy"][1:]  # without auto


# ---------------------------------------------------------------- the code before the move


def old_learner_rows(groups, method):
    """runtime/learner.py:learner_rows before the RL step moved into core/algorithms."""
    rows, rewards, scored_groups = [], [], []
    for g in groups:
        scored = [s for s in g.samples if not s.failed and s.reward is not None and s.num_tokens > 0]
        scored_groups.append(scored)
        rewards += [float(s.reward) for s in scored]
    sizes = {len(s) for s in scored_groups if s}
    if len(sizes) == 1:
        full = [s for s in scored_groups if s]
        adv = group_advantages(torch.tensor([[s.reward for s in grp] for grp in full], dtype=torch.float32),
                               method).tolist() if full else []
        adv_iter = iter(adv)
        advs = [next(adv_iter) if grp else [] for grp in scored_groups]
    else:
        advs = [group_advantages(torch.tensor([[s.reward for s in grp]], dtype=torch.float32),
                                 method if len(grp) > 1 or method == "dr_grpo" else "dr_grpo")[0].tolist()
                if grp else [] for grp in scored_groups]
    for gi, (g, grp, a) in enumerate(zip(groups, scored_groups, advs)):
        prompt = g.prompt_tokens.tolist()
        for s, adv in zip(grp, a):
            rows.append(Row(prompt=prompt, response=s.response_tokens.tolist(), advantage=float(adv),
                            rollout_logprobs=s.rollout_logprobs.tolist(), group=gi, loss_mask=s.loss_mask.tolist()))
    return rows, rewards


def old_prepare(cfg, prox, resp_mask, loss_mask, behav, advantages, groups, ref):
    """The tensor part of connectors/megatron/learner.py:_prepare before the move."""
    prox = prox * resp_mask
    ref = ref * resp_mask if ref is not None else None
    mask = resp_mask * loss_mask
    c = offpolicy.correct(cfg.off_policy, prox, behav, mask, **cfg.correction)
    adv = tokens_from_samples(advantages, resp_mask)
    x = LossInputs(mask=c.mask, adv=adv, prox=prox, groups=groups, share=0.0, weight=c.weight, ref=ref)
    return x, offpolicy.sums(prox, behav, mask, c)


def old_micro_batch_loss(logp, entropy, x, cfg):
    """objective.micro_batch_loss before the move."""
    agg = cfg.loss_agg
    pg, stats = policy_loss(logp, x.prox, x.adv, x.mask, cfg.eps_clip_low, cfg.eps_clip_high, cfg.dual_clip,
                            x.weight, agg, x.groups)
    loss, kl = pg, torch.zeros(())
    if x.ref is not None:
        kl = aggregate(kl_penalty(logp, x.ref, cfg.kl_estimator), x.mask, agg, x.groups)
        loss = loss + cfg.kl_coef * kl
    if cfg.entropy_coef:
        loss = loss + entropy_bonus(entropy, x.mask, cfg.entropy_coef, agg, x.groups)
    parts = {"loss": loss.detach(), "pg_loss": pg.detach(), "kl": kl.detach(),
             "entropy": aggregate(entropy.detach(), x.mask, agg, x.groups), **stats}
    return loss * x.share, parts


# ---------------------------------------------------------------- fixed inputs


def group(gid: int, rewards, failed=(), empty=()) -> SampleGroup:
    samples = []
    for i, r in enumerate(rewards):
        n = 0 if i in empty else 2 + (i + gid) % 3
        samples.append(Sample(index=i, response_tokens=list(range(10 + i, 10 + i + n)),
                              rollout_logprobs=[-0.25 * (k + 1) for k in range(n)], loss_mask=[1] * n, reward=r,
                              failed=i in failed, spans=[VersionSpan(version=0, start=0, end=n)] if n else []))
    return SampleGroup(group_id=f"g{gid}", prompt_id="p", prompt_tokens=[1, 2, gid], samples=samples)


def complete_batch():
    return [group(0, [1.0, 0.0, 0.5, 1.0]), group(1, [0.0, 0.0, 1.0, 0.25]), group(2, [0.3, 0.3, 0.3, 0.3])]


def ragged_batch():
    """Failed, unrewarded and empty samples: groups keep 3, 1 and 0 scored samples (and one keeps 4)."""
    return [group(0, [1.0, 0.0, 0.5, 1.0], failed=(3,)), group(1, [0.0, None, 1.0, 0.25], failed=(0,), empty=(3,)),
            group(2, [0.3, 0.7], failed=(0, 1)), group(3, [1.0, 0.0, 0.0, 0.5])]


def tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 5
    resp = torch.ones(B, T)
    resp[1, 3:] = 0
    resp[3, 2:] = 0
    loss_mask = torch.ones(B, T)
    loss_mask[2, 0] = 0
    prox = -torch.rand(B, T, generator=g) * 3
    behav = prox + (torch.rand(B, T, generator=g) - 0.5) * 2
    ref = prox + (torch.rand(B, T, generator=g) - 0.5) * 0.2
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5])
    groups = torch.tensor([0, 0, 1, 1])
    return prox, resp, loss_mask, behav, adv, groups, ref


# ---------------------------------------------------------------- built-ins: the same numbers as before


@pytest.mark.parametrize("method", ADVANTAGES)
@pytest.mark.parametrize("batch", [complete_batch, ragged_batch])
def test_builtin_advantages_give_the_rows_the_old_code_gave(method, batch):
    rows, rewards = learner_rows(batch(), method)
    old_rows, old_rewards = old_learner_rows(batch(), method)
    assert rows == old_rows and rewards == old_rewards  # exact, not approximately
    assert len(rows) == (12 if batch is complete_batch else 3 + 1 + 4)
    assert len({r.advantage for r in rows}) > 2  # advantages that could differ


@pytest.mark.parametrize("off_policy", OFF_POLICIES)
@pytest.mark.parametrize("with_ref", [False, True])
def test_builtin_corrections_and_loss_give_the_old_tensors(off_policy, with_ref):
    cfg = RLConfig(off_policy=off_policy, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, loss_agg="seq")
    prox, resp, loss_mask, behav, adv, groups, ref = tensors()
    ref = ref if with_ref else None
    x, counts = loss_inputs(cfg, prox, resp, loss_mask, behav, adv, groups, ref)
    ox, old_counts = old_prepare(cfg, prox, resp, loss_mask, behav, adv, groups, ref)
    assert counts == old_counts
    for f in ("mask", "adv", "prox", "groups", "weight", "ref"):
        a, b = getattr(x, f), getattr(ox, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    x.share = ox.share = 0.375
    logp = (prox + 0.6 * torch.arange(prox.numel()).reshape(prox.shape) / prox.numel()).requires_grad_()
    entropy = torch.rand(prox.shape, generator=torch.Generator().manual_seed(1))
    loss, parts = micro_batch_loss(logp, entropy, x, cfg)
    old_loss, old_parts = old_micro_batch_loss(logp, entropy, ox, cfg)
    assert torch.equal(loss, old_loss) and parts.keys() == old_parts.keys()
    assert all(torch.equal(parts[k], old_parts[k]) for k in parts), (parts, old_parts)
    assert float(parts["clip_frac"]) > 0 or off_policy != "none"  # the inputs reach the clip


def test_every_builtin_name_the_recipe_accepts_is_an_entry_of_the_door():
    assert {k: tuple(v) for k, v in BUILTINS.items()} == {
        "advantage": ADVANTAGES, "loss": corrections.CHOICES["loss"], "off_policy": OFF_POLICIES}
    assert tuple(corrections.USES) == OFF_POLICIES


# ---------------------------------------------------------------- user functions through the same door


def test_a_user_advantage_sets_each_samples_advantage():
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.25, 1.0]]
    assert sample_advantages(rewards, plug.no_baseline) == rewards
    # with failed samples each group goes alone; one scored sample left has no baseline: 0
    assert sample_advantages([[1.0, 0.5], [0.75], []], plug.no_baseline) == [[1.0, 0.5], [0.0], []]
    rows, _ = learner_rows(ragged_batch(), plug.no_baseline)
    assert [r.advantage for r in rows] == [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.5]


def test_a_user_advantage_of_the_wrong_shape_is_refused_by_name():
    with pytest.raises(ValueError, match=r"per_group_sum returned \(2,\) for rewards of shape \(2, 2\)"):
        sample_advantages([[1.0, 0.0], [0.0, 1.0]], plug.per_group_sum)


def test_a_user_correction_weights_the_policy_loss():
    prox, resp, loss_mask, behav, adv, groups, _ = tensors()
    logp = prox + 0.01
    ent = torch.zeros_like(prox)
    base, _ = loss_inputs(RLConfig(off_policy="none"), prox, resp, loss_mask, behav, adv, groups)
    half, counts = loss_inputs(RLConfig(off_policy=plug.half_weight), prox, resp, loss_mask, behav, adv, groups)
    assert torch.equal(half.weight, 0.5 * resp * loss_mask) and torch.equal(half.mask, base.mask)
    assert offpolicy.metrics(counts)["is_weight_mean"] == 0.5
    base.share = half.share = 1.0
    full_pg = micro_batch_loss(logp, ent, base, RLConfig())[1]["pg_loss"]
    half_pg = micro_batch_loss(logp, ent, half, RLConfig())[1]["pg_loss"]
    assert float(full_pg) != 0 and torch.allclose(half_pg, 0.5 * full_pg, rtol=1e-6)


def test_a_user_correction_must_return_four_tensors_and_needs_the_rollout_logprobs():
    prox, resp, loss_mask, behav, adv, groups, _ = tensors()
    with pytest.raises(ValueError, match="weight_only returned Tensor, not"):
        loss_inputs(RLConfig(off_policy=plug.weight_only), prox, resp, loss_mask, behav, adv, groups)
    with pytest.raises(ValueError, match="needs the rollout"):
        loss_inputs(RLConfig(off_policy=plug.half_weight), prox, resp, loss_mask, None, adv, groups)


def test_a_user_loss_replaces_the_policy_term_and_the_step_fills_its_stats():
    prox, resp, loss_mask, behav, adv, groups, ref = tensors()
    x, _ = loss_inputs(RLConfig(), prox, resp, loss_mask, behav, adv, groups, ref)
    x.share = 0.5
    logp, ent = prox.clone().requires_grad_(), torch.ones_like(prox)
    ppo_loss, ppo_parts = micro_batch_loss(logp, ent, x, RLConfig(kl_coef=0.1))
    half_loss, half_parts = micro_batch_loss(logp, ent, x, RLConfig(kl_coef=0.1, loss=plug.half_ppo))
    assert torch.allclose(half_parts["pg_loss"], 0.5 * ppo_parts["pg_loss"]) and half_parts["kl"] == ppo_parts["kl"]
    assert torch.allclose(half_loss, 0.5 * (0.5 * ppo_parts["pg_loss"] + 0.1 * ppo_parts["kl"]))
    _, parts = micro_batch_loss(logp, ent, x, RLConfig(loss=plug.reinforce))
    m = x.mask
    assert torch.allclose(parts["pg_loss"], -(prox * x.adv * m).sum() / m.sum())  # its own formula
    assert (float(parts["ratio_mean"]), float(parts["ratio_max"]), float(parts["clip_frac"])) == (1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="vector_loss must return a scalar"):
        micro_batch_loss(logp, ent, x, RLConfig(loss=plug.vector_loss))


# ---------------------------------------------------------------- recipes name them by path

PATHS = ["learner.advantage=rlstep_plugins:no_baseline", "learner.loss=rlstep_plugins:half_ppo",
         "learner.off_policy=rlstep_plugins:half_weight"]


def test_function_paths_in_a_recipe_reach_the_rl_config():
    r = load_recipe(QUICKSTART, PATHS)
    assert (r.learner.advantage, r.learner.loss) == ("rlstep_plugins:no_baseline", "rlstep_plugins:half_ppo")
    cfg = RLConfig.from_recipe(r.learner, 1.0, 1, resolve_fn)
    assert (cfg.advantage, cfg.loss, cfg.off_policy) == (plug.no_baseline, plug.half_ppo, plug.half_weight)
    assert cfg.correction == {}
    # shipped to Ray nodes like every other user function (runtime/user_code.py)
    assert {("learner.advantage", "rlstep_plugins:no_baseline"), ("learner.loss", "rlstep_plugins:half_ppo"),
            ("learner.off_policy", "rlstep_plugins:half_weight")} <= set(fn_paths(r))
    with pytest.raises(ValueError, match="pass resolve_fn"):
        RLConfig.from_recipe(r.learner, 1.0, 1)
    builtin = RLConfig.from_recipe(load_recipe(QUICKSTART).learner, 1.0, 1, resolve_fn)
    assert (builtin.advantage, builtin.loss, builtin.off_policy) == ("grpo", "ppo", "tis")


@pytest.mark.parametrize("override, key, fragment", [
    ("learner.advantage=no_such_module_rlstep:fn", "learner.advantage", "cannot import module 'no_such_module_rlstep'"),
    ("learner.loss=rlstep_plugins:nope", "learner.loss", "module 'rlstep_plugins' has no attribute 'nope'"),
    ("learner.off_policy=rlstep_plugins:no_baseline", "learner.off_policy",
     "rlstep_plugins:no_baseline cannot be called as fn(prox, behav, mask)"),
    ("learner.advantage=rlstep_plugins:half_weight", "learner.advantage", "cannot be called as fn(rewards)"),
    ("learner.advantage=ppo", "learner.advantage", "unknown value 'ppo'; choose one of 'grpo', 'dr_grpo', 'rloo'"),
    ("learner.loss=clipped", "learner.loss", "choose one of 'ppo', or name a function `pkg.mod:fn`"),
    ("learner.loss=my loss:fn", "learner.loss", "must be a built-in name or a dotted function path"),
])
def test_a_bad_name_or_path_stops_the_recipe_naming_the_key(override, key, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(QUICKSTART, [override])
    assert str(e.value).startswith(f"override {override!r}: {key}: ") and fragment in str(e.value), str(e.value)


def test_settings_of_a_builtin_correction_are_refused_with_a_user_one():
    with pytest.raises(RecipeError, match="learner.tis_cap: is read only by learner.off_policy tis or tis_seq, "
                                          "but off_policy is 'rlstep_plugins:half_weight'"):
        load_recipe(QUICKSTART, ["learner.off_policy=rlstep_plugins:half_weight", "learner.tis_cap=3"])


def test_cli_check_exits_2_on_a_bad_learner_path():
    p = subprocess.run([sys.executable, "-m", "streamrl", "check", str(QUICKSTART),
                        "learner.loss=streamrl.core.algorithms.step:no_such_loss"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "learner.loss: module 'streamrl.core.algorithms.step' has no attribute 'no_such_loss'" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


# ---------------------------------------------------------------- ... and the learner trains with them

LEARNER = """
    import sys, json, torch
    sys.path.insert(0, "tests")
    from rlstep_plugins import no_baseline
    from streamrl.connectors.megatron.learner import MegatronLearner
    from streamrl.core.algorithms import RLConfig, group_advantages
    from streamrl.core.types import Sample, SampleGroup, VersionSpan
    from streamrl.recipe import load_recipe, resolve_fn
    from streamrl.runtime.learner import LearnerDriver, learner_rows
    base = [f"model.path={sys.argv[1]}", "learner.micro_batch_size=64", "learner.off_policy=none"]
    def recipe(*more):
        return load_recipe("recipes/quickstart.yaml", base + list(more))
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.25, 1.0, 1.0, 0.0]]
    def sample(g, i, r):
        n = 3 + i
        return Sample(index=i, response_tokens=[20 + 3 * i + g + k for k in range(n)], rollout_logprobs=[-2.0] * n,
                      reward=r, spans=[VersionSpan(version=0, start=0, end=n)])
    groups = [SampleGroup(group_id=f"g{g}", prompt_id="p", prompt_tokens=[5, 6, 7 + g],
                          samples=[sample(g, i, r) for i, r in enumerate(rs)]) for g, rs in enumerate(rewards)]
    lengths = [3 + i for rs in rewards for i in range(len(rs))]
    out = {"lengths": lengths, "grpo": group_advantages(torch.tensor(rewards), "grpo").flatten().tolist()}
    # the driver reads the recipe: the user's advantage function makes the rows
    driver = LearnerDriver(recipe("learner.advantage=rlstep_plugins:no_baseline"), sys.argv[1], pool=False)
    assert driver.cfg.advantage is no_baseline
    rows, _ = learner_rows(groups, driver.cfg.advantage)
    out["user_advantage"] = driver._train(0, rows)
    for name, more in (("builtin", ()), ("half_ppo", ("learner.loss=rlstep_plugins:half_ppo",)),
                       ("half_weight", ("learner.off_policy=rlstep_plugins:half_weight",))):
        r = recipe(*more)
        cfg = RLConfig.from_recipe(r.learner, 1.0, 1, resolve_fn)
        learner = MegatronLearner(sys.argv[1], lr=r.learner.lr, micro_batch_size=64)
        out[name] = learner.rl_step(learner_rows(groups, cfg.advantage)[0], cfg)
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_user_functions_named_in_a_recipe_change_the_learner_step_as_they_say(model_dir):
    res = run_script(LEARNER, str(model_dir))
    n, ntok = res["lengths"], sum(res["lengths"])
    flat = [1.0, 0.0, 0.5, 0.0, 0.25, 1.0, 1.0, 0.0]
    b = res["builtin"]
    assert b["ratio_mean"] == 1.0 and b["clip_frac"] == 0.0  # the first step: the PPO loss is -mean(A) exactly
    assert b["pg_loss"] == pytest.approx(-sum(a * k for a, k in zip(res["grpo"], n)) / ntok, rel=1e-5, abs=1e-7)
    # advantage = reward (no baseline), through the driver
    assert res["user_advantage"]["pg_loss"] == pytest.approx(-sum(a * k for a, k in zip(flat, n)) / ntok, rel=1e-5)
    # half the loss, or half the weight: half the policy term and half the gradient
    for name in ("half_ppo", "half_weight"):
        assert res[name]["pg_loss"] == pytest.approx(0.5 * b["pg_loss"], rel=1e-5), name
        assert res[name]["grad_norm"] == pytest.approx(0.5 * b["grad_norm"], rel=1e-4), name
    assert res["half_weight"]["is_weight_mean"] == 0.5 and b["is_weight_mean"] == 1.0
