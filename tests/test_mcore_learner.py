"""The megatron learner on CPU: SFT lowers the loss fast; the first RL step on fresh
on-policy rollouts has importance ratio exactly 1 and KL to the reference exactly 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from learnerkit import model_dir, run_script  # noqa: F401 - model_dir is a fixture

SFT = """
    import sys, time, random, json
    from streamrl.connectors.mcore_learner import MegatronLearner, init_single_process
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
    from streamrl.connectors.mcore_learner import MegatronLearner, RLConfig, Sample, init_single_process
    init_single_process()
    from streamrl.connectors.engine_core import EngineCore, GenRequest
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
@pytest.mark.parametrize("off_policy", ["none", "tis", "decoupled"])
def test_first_step_on_fresh_on_policy_data_has_ratio_one_and_zero_kl(model_dir: Path, off_policy: str) -> None:
    res = run_script(RL, str(model_dir), off_policy)
    first, second = res["first"], res["second"]
    assert first["ratio_mean"] == 1.0 and first["ratio_max"] == 1.0 and first["clip_frac"] == 0.0, first
    assert first["kl"] == 0.0, first
    assert first["grad_norm"] > 0 and res["version"] == 2
    # the step moved the policy: the same data is now off the reference
    assert second["kl"] > 0, second
