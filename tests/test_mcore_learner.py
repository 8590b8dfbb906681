"""The megatron learner on CPU: SFT lowers the loss fast; the first RL step on fresh
on-policy rollouts has importance ratio exactly 1 and KL to the reference exactly 0 under every
off-policy correction; a second mini-batch makes the PPO clip act, one mini-batch is a plain
step; micro-batching does not change a step; a non-finite step is skipped without a trace."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture

SFT = """
    import sys, time, random, json
    from streamrl.connectors.megatron.learner import MegatronLearner, init_single_process
    init_single_process()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    rng = random.Random(0)
    def row():
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return tok.encode(f"{a}+{b}="), tok.encode(str(a + b)) + [tok.eos_token_id]
    learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=32, warmup_steps=5)
    t0, losses = time.time(), []
    for _ in range(100):
        losses.append(learner.sft_step([row() for _ in range(64)])["loss"])
    print(json.dumps({"first": losses[0], "last": sum(losses[-5:]) / 5, "seconds": time.time() - t0,
                      "version": learner.version}))
"""


@pytest.mark.slow
def test_sft_lowers_the_loss(model_dir: Path) -> None:
    res = run_script(SFT, str(model_dir))
    assert res["version"] == 100
    assert res["last"] < 0.5 * res["first"], res


RL = """
    import sys, json, threading, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_single_process
    init_single_process()
    from streamrl.connectors.sglang.engine_core import EngineCore, GenRequest
    from streamrl.core.algorithms import group_advantages
    eng = EngineCore(sys.argv[1])
    threading.Thread(target=eng.run, daemon=True).start()
    done, ev = [], threading.Event()
    def cb(r):
        done.append(r)
        if len(done) == 8:
            ev.set()
    for g in range(2):
        for i in range(4):
            eng.submit(GenRequest(rid=f"{g}-{i}", input_ids=[5, 6, 7 + g], max_new_tokens=6 + i, ignore_eos=True,
                                  sampling_seed=10 * g + i, on_done=cb))
    assert ev.wait(120)
    eng.stop()
    done.sort(key=lambda r: r.rid)
    rewards = torch.tensor([[float(len(set(r.output_ids))) for r in done[g * 4:(g + 1) * 4]] for g in range(2)])
    adv = group_advantages(rewards, "grpo").flatten().tolist()
    samples = [Sample(prompt=r.input_ids, response=r.output_ids, advantage=a, rollout_logprobs=r.logprobs,
                      group=int(r.rid[0])) for r, a in zip(done, adv)]
    learner = MegatronLearner(sys.argv[1], lr=1e-2, micro_batch_size=4, with_reference=True)
    cfg = RLConfig(kl_coef=0.1, off_policy=sys.argv[2], entropy_coef=0.01)
    first = learner.rl_step(samples, cfg)
    second = learner.rl_step(samples, cfg)
    print(json.dumps({"first": first, "second": second, "version": learner.version}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("off_policy", ["none", "tis", "tis_seq", "mis", "decoupled", "icepop"])
def test_first_step_on_fresh_on_policy_data_has_ratio_one_and_zero_kl(model_dir: Path, off_policy: str) -> None:
    res = run_script(RL, str(model_dir), off_policy)
    first, second = res["first"], res["second"]
    assert first["ratio_mean"] == 1.0 and first["ratio_max"] == 1.0 and first["clip_frac"] == 0.0, first
    assert first["kl"] == 0.0, first
    assert first["grad_norm"] > 0 and res["version"] == 2
    # the step moved the policy: the same data is now off the reference
    assert second["kl"] > 0, second


BATCH = """
    import sys, json, random, hashlib, copy, torch
    from streamrl.connectors.megatron.learner import MegatronLearner, RLConfig, Sample, init_single_process
    init_single_process()
    def batch(seed=0, empty=None):
        rng = random.Random(seed)
        out = []
        for g in range(4):
            prompt = [rng.randrange(1, 200) for _ in range(3 + g)]
            for i in range(4):
                n = 4 + (i + g) % 3
                mask = [0] * n if (g, i) == empty else [1] * n
                out.append(Sample(prompt=prompt, response=[rng.randrange(1, 200) for _ in range(n)],
                                  advantage=(1.0 if i % 2 else -1.0) * (1 + g / 4), group=g, loss_mask=mask,
                                  rollout_logprobs=[-rng.uniform(3, 6) for _ in range(n)]))
        return out
    def digest(learner):
        h = hashlib.sha256()
        for k, v in sorted(learner.model.state_dict().items()):
            if isinstance(v, torch.Tensor):
                h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()
"""

MINI = BATCH + """
    out = {}
    for eps in (0.01, 0.2):
        learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=4)
        m = learner.rl_step(batch(), RLConfig(mini_batches=2, eps_clip_low=eps, eps_clip_high=eps, off_policy="tis"))
        out[str(eps)] = {"steps": m["optim_steps"], "optimizer_steps": m["optimizer_steps"],
                         "version": learner.version, "digest": digest(learner), "last_epoch": learner.opt.last_epoch}
    # one mini-batch, one epoch: one plain step, against the same step written out by hand
    learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=64)
    m = learner.rl_step(batch(), RLConfig())
    by_hand = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=64)
    from streamrl.connectors.megatron.batch import TokenBatch
    rows = batch()
    b = TokenBatch([(s.prompt, s.response) for s in rows]).to(by_hand.device)
    with torch.no_grad():
        prox = by_hand._forward(by_hand.model, b, 1.0)[0]
    logp = by_hand._forward(by_hand.model, b, 1.0)[0]
    adv = torch.tensor([s.advantage for s in rows], device=by_hand.device)[:, None] * b.resp_mask
    ratio = torch.exp(logp - prox)
    loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * b.resp_mask).sum() / b.resp_mask.sum()
    loss.backward()  # megatron's DDP hooks move each gradient into the parameter's main_grad
    grads = [p.main_grad for p in by_hand.params]
    norm = torch.norm(torch.stack([torch.norm(g) for g in grads]))  # float32 per tensor, as megatron's clip_grads
    coef = min(1.0, 1.0 / (float(norm) + 1e-6))  # clip to norm 1
    for p, g in zip(by_hand.params, grads):
        p.grad = g * coef
    torch.optim.AdamW(by_hand.params, lr=3e-3, weight_decay=0.0, eps=1e-8).step()
    diff = max(float((a - b).abs().max()) for a, b in zip(learner.params, by_hand.params))
    out["one"] = {"optimizer_steps": m["optimizer_steps"], "loss": m["loss"], "loss_by_hand": float(loss),
                  "grad_norm": m["grad_norm"], "grad_norm_by_hand": float(norm), "max_weight_diff": diff}
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_mini_batches_make_the_clip_act_and_one_is_a_plain_step(model_dir: Path) -> None:
    res = run_script(MINI, str(model_dir))
    tight, loose = res["0.01"], res["0.2"]
    for r in (tight, loose):
        assert r["optimizer_steps"] == 2 and r["version"] == 1 and r["last_epoch"] == 2, r
        assert r["steps"][0]["clip_frac"] == 0.0 and r["steps"][0]["ratio_max"] == 1.0  # ratio 1 on the first step
    # the second mini-batch is scored by the policy after the first step: its ratio departs from 1
    assert tight["steps"][1]["clip_frac"] > 0, tight
    assert tight["steps"][1]["clip_frac"] > loose["steps"][1]["clip_frac"], res
    assert tight["digest"] != loose["digest"]  # so eps_clip now changes the update
    one = res["one"]
    assert one["optimizer_steps"] == 1
    assert one["loss"] == pytest.approx(one["loss_by_hand"], rel=1e-6)
    assert one["grad_norm"] == pytest.approx(one["grad_norm_by_hand"], rel=1e-6)
    # megatron's clip takes the norm through float32 norms per tensor and a Python float, and the loss by hand
    # sums in another order: the update may differ in its last bit, i.e. 1 ulp of a weight (2.4e-7 below 2,
    # the norms' weights are 1); a wrong update moves them by ~lr (3e-3)
    assert one["max_weight_diff"] <= 2.4e-7, one


SPLIT = BATCH + """
    out = {}
    # micro-batches of 3 rows, of at most 20 padded tokens (1-2 rows of 7-12 tokens; whole groups
    # under group aggregation), vs the whole batch in one
    for agg in ("token", "seq", "group"):
        for mbs, budget in ((3, None), (64, 20), (64, None)):
            learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=mbs, max_tokens_per_micro_batch=budget)
            m = learner.rl_step(batch(empty=(1, 2)), RLConfig(loss_agg=agg, off_policy="tis"))
            out[f"{agg}-{mbs}-{budget}"] = {k: m[k] for k in ("loss", "grad_norm", "is_weight_mean")}
            out[f"{agg}-{mbs}-{budget}"]["micro_batches"] = len(learner._micro_batches(batch(), agg == "group"))
    for budget in (20, None):
        learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=64, max_tokens_per_micro_batch=budget)
        m = learner.sft_step([(s.prompt, s.response) for s in batch()])
        out[f"sft-{budget}"] = {k: m[k] for k in ("loss", "grad_norm")}
    print(json.dumps(out))
"""


@pytest.mark.slow
def test_micro_batched_step_equals_the_whole_batch_with_an_empty_sample(model_dir: Path) -> None:
    """However the batch is cut (rows per micro-batch, a padded-token budget), one step is the
    gradient of the whole batch's aggregate, for SFT too."""
    res = run_script(SPLIT, str(model_dir))
    for agg in ("token", "seq", "group"):
        whole = res[f"{agg}-64-None"]
        assert whole["micro_batches"] == 1
        for cut in (f"{agg}-3-None", f"{agg}-64-20"):
            small = res[cut]
            assert small["micro_batches"] > 1, (cut, res)
            assert small["loss"] == pytest.approx(whole["loss"], rel=1e-5), (cut, res)
            assert small["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5), (cut, res)
            assert small["is_weight_mean"] == pytest.approx(whole["is_weight_mean"], rel=1e-6)
    assert res["token-64-20"]["micro_batches"] > res["group-64-20"]["micro_batches"] == 4  # groups stay whole
    assert len({round(res[f"{agg}-64-None"]["loss"], 6) for agg in ("token", "seq", "group")}) == 3, res  # they differ
    assert res["sft-20"]["loss"] == pytest.approx(res["sft-None"]["loss"], rel=1e-5), res
    assert res["sft-20"]["grad_norm"] == pytest.approx(res["sft-None"]["grad_norm"], rel=1e-5), res


NONFINITE = BATCH + """
    learner = MegatronLearner(sys.argv[1], lr=3e-3, micro_batch_size=8)
    cfg = RLConfig(off_policy="tis")
    first = learner.rl_step(batch(0), cfg)  # Adam has moments from here on
    weights = {k: v.clone() for k, v in learner.model.state_dict().items() if isinstance(v, torch.Tensor)}
    moments = {id(p): s for p, s in learner.opt.param_states().items()}
    epochs = [learner.opt.last_epoch]
    bad = batch(1)
    if sys.argv[2] == "inf_advantage":
        bad[5].advantage = float("inf")
    else:
        bad[5].rollout_logprobs = [float("nan")] * len(bad[5].response)
    skipped = learner.rl_step(bad, cfg)
    same_weights = all(torch.equal(v, learner.model.state_dict()[k]) for k, v in weights.items())
    after = {id(p): s for p, s in learner.opt.param_states().items()}
    same_moments = after.keys() == moments.keys() and all(
        torch.equal(a, after[i][k]) for i, s in moments.items() for k, a in s.items())
    version_after_skip = learner.version
    epochs.append(learner.opt.last_epoch)
    good = learner.rl_step(batch(2), cfg)
    epochs.append(learner.opt.last_epoch)
    moved = not all(torch.equal(v, learner.model.state_dict()[k]) for k, v in weights.items())
    print(json.dumps({"skipped": {k: skipped[k] for k in ("nonfinite_skipped", "nonfinite_skipped_total",
                                                          "optimizer_steps", "loss")},
                      "good": {k: good[k] for k in ("nonfinite_skipped", "nonfinite_skipped_total", "optimizer_steps",
                                                    "loss", "grad_norm")},
                      "same_weights": same_weights, "same_moments": same_moments, "sched_epochs": epochs,
                      "versions": [version_after_skip, learner.version], "moved": moved}, default=str))
"""


@pytest.mark.slow
@pytest.mark.parametrize("poison", ["inf_advantage", "nan_logprobs"])
def test_a_non_finite_step_is_skipped_and_leaves_everything_as_it_was(model_dir: Path, poison: str) -> None:
    res = run_script(NONFINITE, str(model_dir), poison)
    s, g = res["skipped"], res["good"]
    assert s["nonfinite_skipped"] == 1 and s["nonfinite_skipped_total"] == 1 and s["optimizer_steps"] == 0, res
    assert not math.isfinite(s["loss"]), res
    assert res["same_weights"] and res["same_moments"], res  # bit-identical weights and Adam moments
    assert res["sched_epochs"] == [1, 1, 2], res  # the skip did not advance the LR schedule
    assert res["versions"] == [2, 3]  # still one version per claimed batch
    assert g["nonfinite_skipped"] == 0 and g["nonfinite_skipped_total"] == 1 and g["optimizer_steps"] == 1, res
    assert math.isfinite(g["loss"]) and g["grad_norm"] > 0 and res["moved"], res
