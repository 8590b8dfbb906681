"""streamrl.core.algorithms against an independent plain-Python reference of the formulas.

The reference below (`ref_*`) uses only lists, `math` and loops over groups / sequences / tokens:
no torch vector ops and no calls into streamrl. It is written from the literature:

- GRPO (DeepSeekMath, Shao et al. 2024):  A_i = (r_i - mean_g) / (std_g + eps)
- Dr. GRPO (Liu et al. 2025):             A_i = r_i - mean_g
- RLOO (Ahmadian et al. 2024):            A_i = r_i - 1/(n-1) * sum_{j != i} r_j
- REINFORCE++ with a group baseline (Hu 2025): A_i = r_i - mean_g, then whitened over the batch
- PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO's clip-higher)
  and dual clip (Ye et al. 2020): for A < 0 the per-token loss is min(loss, -c * A)
- KL estimators k1 / k2 / k3 (Schulman, "Approximating KL divergence", 2020) with
  r = pi_ref / pi sampled from pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r
- TIS (slime / verl): loss * min(exp(old_logp - rollout_logp), C)
- decoupled PPO (AReaL): ratio against the proximal policy, loss * exp(prox_logp - behav_logp),
  untruncated (the other corrections, and caps, are tested in tests/test_offpolicy.py)

Inputs are float32 tensors. The reference reads the very same float32 values (rounded with
`struct`, see `f32`) in double precision, so the only difference left is float32 arithmetic:
values must agree within 1e-6 (absolute, or relative for magnitudes above 1).

Long file: an independent plain-Python reference of every formula sits next to the tests that compare against it.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from streamrl.core.algorithms import (
    aggregate,
    entropy_bonus,
    group_advantages,
    kl_penalty,
    offpolicy,
    policy_loss,
    tokens_from_samples,
)

TOL = 1e-6


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (what torch.tensor(..., float32) stores)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def f32_rows(rows: list[list[float]]) -> list[list[float]]:
    return [[f32(v) for v in row] for row in rows]


def t32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _flatten(x) -> list[float]:
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _flatten(item)]
    return [float(x)]


def _shape(x) -> tuple[int, ...]:
    if isinstance(x, (list, tuple)):
        return (len(x),) + (_shape(x[0]) if x else ())
    return ()


def assert_matches(actual: torch.Tensor, expected, tol: float = TOL) -> None:
    """float32 tensor vs reference value (float or nested lists): |a - e| <= tol * max(1, |e|)."""
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == torch.float32
    assert tuple(actual.shape) == _shape(expected)
    a, e = _flatten(actual.tolist()), _flatten(expected)
    bad = [(i, x, y) for i, (x, y) in enumerate(zip(a, e)) if not abs(x - y) <= tol * max(1.0, abs(y))]
    assert not bad, f"mismatch (index, actual, expected): {bad}"


# ====================================================================== reference implementation


def ref_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def ref_std_unbiased(xs: list[float]) -> float:
    # The module's docstring picks the unbiased (n - 1) std, as torch's default, slime and verl.
    m = ref_mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_advantages(rewards: list[list[float]], method: str, eps: float = 1e-6) -> list[list[float]]:
    if method == "reinforce_pp":
        # Group baseline, then whitening over the whole batch. The module's docstring picks
        # whitening per *sample* (verl whitens per token); we follow the docstring.
        centred = [[r - ref_mean(g) for r in g] for g in rewards]
        flat = [a for row in centred for a in row]
        mu = ref_mean(flat)
        sd = ref_std_unbiased(flat) if len(flat) > 1 else 0.0
        return [[(a - mu) / (sd + eps) for a in row] for row in centred]
    out = []
    for g in rewards:
        n, mu = len(g), ref_mean(g)
        if method == "grpo":
            sd = ref_std_unbiased(g) if n > 1 else 0.0
            out.append([(r - mu) / (sd + eps) for r in g])
        elif method == "dr_grpo":
            out.append([r - mu for r in g])
        elif method == "rloo":
            # leave-one-out baseline written out as the definition (not the n/(n-1) identity)
            out.append([r - sum(g[j] for j in range(n) if j != i) / (n - 1) for i, r in enumerate(g)])
        else:
            raise AssertionError(method)
    return out


def ref_aggregate(x: list[list[float]], mask: list[list[float]], how: str, group_ids=None) -> float:
    """token: mean over all unmasked tokens; seq: mean over sequences of each sequence's token
    mean; group: mean over groups of each group's token mean (tokens of the group pooled)."""
    B, T = len(x), len(x[0])
    if how == "token":
        toks = [x[b][t] for b in range(B) for t in range(T) if mask[b][t]]
        return sum(toks) / len(toks)
    if how == "seq":
        per_seq = []
        for b in range(B):
            toks = [x[b][t] for t in range(T) if mask[b][t]]
            assert toks, "reference: a sequence with no tokens has no token mean"
            per_seq.append(sum(toks) / len(toks))
        return ref_mean(per_seq)
    if how == "group":
        pooled: dict[int, list[float]] = {}
        for b in range(B):
            pooled.setdefault(group_ids[b], []).extend(x[b][t] for t in range(T) if mask[b][t])
        return ref_mean([sum(toks) / len(toks) for toks in pooled.values()])
    raise AssertionError(how)


def ref_agg_coefficients(mask, how: str, group_ids=None) -> list[list[float]]:
    """d aggregate / d x[b][t]: what a token's loss is scaled by in the aggregate."""
    B, T = len(mask), len(mask[0])
    lens = [sum(1 for t in range(T) if mask[b][t]) for b in range(B)]
    if how == "token":
        n = sum(lens)
        return [[(1.0 / n if mask[b][t] else 0.0) for t in range(T)] for b in range(B)]
    if how == "seq":
        return [[(1.0 / (B * lens[b]) if mask[b][t] else 0.0) for t in range(T)] for b in range(B)]
    counts: dict[int, int] = {}
    for b in range(B):
        counts[group_ids[b]] = counts.get(group_ids[b], 0) + lens[b]
    G = len(counts)
    return [[(1.0 / (G * counts[group_ids[b]]) if mask[b][t] else 0.0) for t in range(T)] for b in range(B)]


def ref_tis_weight(old_logp, rollout_logp, cap):
    return [[min(math.exp(o - r), cap) for o, r in zip(ro, rr)] for ro, rr in zip(old_logp, rollout_logp)]


def ref_behaviour_weight(prox_logp, behav_logp):
    return [[math.exp(p - b) for p, b in zip(rp, rb)] for rp, rb in zip(prox_logp, behav_logp)]


def ref_ppo_token(logp: float, prox: float, adv: float, eps_low: float, eps_high: float,
                  dual_clip: float | None, w: float) -> tuple[float, float, bool, float]:
    """One token: (loss, ratio, clip-active, d loss / d logp)."""
    r = math.exp(logp - prox)
    r_clip = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
    unclipped_loss, clipped_loss = -r * adv, -r_clip * adv
    # PPO: pessimistic bound, loss = max(-rA, -clip(r)A); "clipped" when the clipped term is it
    clip_active = clipped_loss > unclipped_loss
    loss = clipped_loss if clip_active else unclipped_loss
    grad = 0.0 if clip_active else -r * adv          # d(-rA)/dlogp = -rA; clipped term is flat
    if dual_clip is not None and adv < 0 and -dual_clip * adv < loss:
        loss, grad = -dual_clip * adv, 0.0          # dual clip (Ye et al. 2020): a constant cap
    return loss * w, r, clip_active, grad * w


def ref_policy_loss(logp, prox, adv, mask, eps_low, eps_high, dual_clip=None, weight=None,
                    agg="token", group_ids=None) -> dict:
    B, T = len(logp), len(logp[0])
    losses, ratios, clipped, grads = [], [], [], []
    for b in range(B):
        rows = [ref_ppo_token(logp[b][t], prox[b][t], adv[b][t], eps_low, eps_high, dual_clip,
                              1.0 if weight is None else weight[b][t]) for t in range(T)]
        losses.append([row[0] for row in rows])
        ratios.append([row[1] for row in rows])
        clipped.append([1.0 if row[2] else 0.0 for row in rows])
        grads.append([row[3] for row in rows])
    unmasked = [ratios[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    coef = ref_agg_coefficients(mask, agg, group_ids)
    return {
        "loss": ref_aggregate(losses, mask, agg, group_ids),
        "ratio_mean": ref_aggregate(ratios, mask, "token"),
        "ratio_max": max(unmasked),
        "clip_frac": ref_aggregate(clipped, mask, "token"),
        "grad": [[grads[b][t] * coef[b][t] for t in range(T)] for b in range(B)],
    }


def ref_kl(logp: float, ref_logp: float, estimator: str) -> float:
    log_r = ref_logp - logp              # r = pi_ref(x) / pi(x), x sampled from pi
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return (math.exp(log_r) - 1.0) - log_r
    raise AssertionError(estimator)


# ====================================================================== the fixed small batch

# 3 groups x 4 samples: ties in group 0 and 2, group 1 has zero variance.
REWARDS = f32_rows([[1.0, 0.0, 0.0, 1.0],
                    [0.5, 0.5, 0.5, 0.5],
                    [0.9, 0.2, 0.2, 0.6]])

# Token batch: 6 sequences of lengths 5, 3, 4, 1, 5, 2 (T = 5). Masked positions hold wild
# values so that any leak through the mask shows.
MASK = [[1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0]]
PROX = f32_rows([[-0.9, -1.3, -0.2, -2.1, -0.7],
                 [-1.1, -0.4, -1.7, -0.5, -0.6],
                 [-0.3, -2.4, -1.0, -0.8, -1.9],
                 [-1.5, -0.2, -0.9, -1.2, -0.3],
                 [-0.6, -1.4, -0.25, -2.6, -1.05],
                 [-0.45, -1.8, -0.7, -0.35, -1.6]])
# log-ratio logp - prox per token: below 1 - eps_low, inside, above 1 + eps_high, and large
# enough for the dual clip, for both signs of the advantage
LOG_RATIO = [[-0.6, -0.15, 0.1, 0.4, 1.2],
             [-0.6, 0.4, 1.5, 3.0, -3.0],
             [0.0, 0.22, 0.3, -0.3, 4.0],
             [1.2, -5.0, 5.0, 0.5, 0.5],
             [-0.05, 0.5, -0.5, 2.0, 0.05],
             [2.0, -2.0, 9.0, 0.0, 0.0]]
LOGP = f32_rows([[p + d for p, d in zip(rp, rd)] for rp, rd in zip(PROX, LOG_RATIO)])
ADV = f32_rows([[1.0, 1.0, 1.0, 1.0, 1.0],
                [-1.0, -1.0, -1.0, 50.0, -50.0],
                [0.5, 0.5, 0.5, 0.5, 80.0],
                [-2.0, 9.0, -9.0, 9.0, -9.0],
                [-0.7, 0.0, 0.7, -0.7, 0.3],
                [1.5, 1.5, -40.0, 7.0, 7.0]])
# behaviour (rollout) log-probs: exp(prox - behav) = exp(OFF); OFF straddles log 2 = 0.6931
OFF = [[0.0, 0.3, -0.2, 0.9, 1.1],
       [-0.5, 0.05, 2.0, 3.0, 0.0],
       [0.69, 0.71, -1.0, 0.2, 0.0],
       [1.5, 0.0, 0.0, 0.0, 0.0],
       [0.1, -0.1, 0.4, -0.4, 0.8],
       [-2.0, 0.6, 5.0, 0.0, 0.0]]
BEHAV = f32_rows([[p - o for p, o in zip(rp, ro)] for rp, ro in zip(PROX, OFF)])
# reference-model log-probs for the KL: ref - logp is 0, small and large, both signs
KL_DELTA = [[0.0, 0.001, -0.002, 0.5, -0.5],
            [1.3, -1.3, 0.05, 7.0, -7.0],
            [-0.25, 0.25, 2.0, -2.0, 0.0],
            [0.7, 9.0, 9.0, 9.0, 9.0],
            [-3.0, 0.1, -0.1, 0.02, 1.0],
            [0.3, -0.8, 9.0, 0.0, 0.0]]
REF_LOGP = f32_rows([[p + d for p, d in zip(rp, rd)] for rp, rd in zip(LOGP, KL_DELTA)])
ENTROPY = f32_rows([[0.5, 1.25, 2.0, 0.1, 0.0],
                    [3.0, 0.7, 1.1, 99.0, 99.0],
                    [0.05, 0.9, 1.6, 2.2, 99.0],
                    [1.7, 99.0, 99.0, 99.0, 99.0],
                    [0.3, 0.3, 0.8, 1.4, 2.5],
                    [0.6, 1.9, 99.0, 99.0, 99.0]])
GROUP_IDS = {"contiguous": [0, 0, 1, 1, 2, 2], "scattered": [7, 3, 7, 3, 3, 11]}

TIS_CAP = 2.0
AGGS = [("token", None), ("seq", None), ("group", "contiguous"), ("group", "scattered")]
AGG_IDS = [f"{a}-{g}" if g else a for a, g in AGGS]


def _gids(name):
    return None if name is None else torch.tensor(GROUP_IDS[name])


def _masked(rows):
    return [[v * MASK[b][t] for t, v in enumerate(row)] for b, row in enumerate(rows)]


def _weights(kind):
    """(module weight tensor, reference weight lists) for no weight, TIS and decoupled PPO;
    the module's weights are 0 on tokens outside the loss mask."""
    if kind is None:
        return None, None
    if kind == "tis":  # numer: learner log-probs before the step (= prox), denom: rollout
        return (offpolicy.tis(t32(PROX), t32(BEHAV), t32(MASK), tis_cap=TIS_CAP).weight,
                _masked(ref_tis_weight(PROX, BEHAV, TIS_CAP)))
    if kind == "decoupled":  # numer: proximal, denom: behaviour; untruncated
        return offpolicy.decoupled(t32(PROX), t32(BEHAV), t32(MASK)).weight, _masked(ref_behaviour_weight(PROX, BEHAV))
    raise AssertionError(kind)


# ====================================================================== advantages


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
@pytest.mark.parametrize("eps", [None, 1e-3], ids=["eps-default", "eps-1e-3"])
def test_advantages_match_reference(method, eps):
    out = group_advantages(t32(REWARDS), method) if eps is None else group_advantages(t32(REWARDS), method, eps=eps)
    assert_matches(out, ref_advantages(REWARDS, method, 1e-6 if eps is None else eps))


def test_advantages_other_group_shapes():
    rewards = f32_rows([[0.3, 1.0, 0.0, 0.7, 0.7, 0.1], [2.0, -1.0, 0.5, 0.5, 0.25, 3.0]])
    for method in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert_matches(group_advantages(t32(rewards), method), ref_advantages(rewards, method))
    pair = f32_rows([[1.0, 0.0], [0.2, 0.9], [0.4, 0.4]])
    for method in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert_matches(group_advantages(t32(pair), method), ref_advantages(pair, method))


def test_advantages_single_sample_groups():
    # n = 1: no baseline information: GRPO and Dr. GRPO give 0 (std of one value is taken as 0)
    single = t32([[0.3], [1.0]])
    assert group_advantages(single, "grpo").tolist() == [[0.0], [0.0]]
    assert group_advantages(single, "dr_grpo").tolist() == [[0.0], [0.0]]


def test_tokens_from_samples_matches_reference():
    per_sample = [f32(v) for v in [0.5, -1.0, 2.0, -0.25, 0.0, 3.0]]
    expected = [[per_sample[b] * MASK[b][t] for t in range(5)] for b in range(6)]
    assert_matches(tokens_from_samples(t32(per_sample), t32(MASK)), expected)
    assert_matches(tokens_from_samples(t32(per_sample), torch.tensor(MASK, dtype=torch.bool)), expected)


# hand-computed values --------------------------------------------------------------------------


def test_hand_grpo():
    # r = [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    # A = +-0.5 / 0.5773503 = +-0.8660254 (= sqrt(3)/2) with eps = 0;
    # with the default eps: 0.5 / (0.5773503 + 1e-6) = 0.8660239
    # (eps = 0 is only safe without zero-variance groups: there it gives 0 / 0 = nan)
    a = 0.8660254
    assert_matches(group_advantages(t32([[1.0, 0.0, 0.0, 1.0]]), "grpo", eps=0.0), [[a, -a, -a, a]])
    b = 0.8660239
    assert_matches(group_advantages(t32([[1.0, 0.0, 0.0, 1.0]]), "grpo"), [[b, -b, -b, b]])
    # zero-variance group: r - mean = 0 everywhere, 0 / (0 + eps) = 0
    assert group_advantages(t32([[0.5, 0.5, 0.5, 0.5]]), "grpo").tolist() == [[0.0] * 4]


def test_hand_rloo_and_dr_grpo():
    # RLOO r = [1, 1, 1, 0]: a 1 sees the others' mean (1 + 1 + 0) / 3 = 2/3 -> 1 - 2/3 = 1/3;
    # the 0 sees (1 + 1 + 1) / 3 = 1 -> 0 - 1 = -1
    assert_matches(group_advantages(t32([[1.0, 1.0, 1.0, 0.0]]), "rloo"),
                   [[0.3333333, 0.3333333, 0.3333333, -1.0]])
    # Dr. GRPO: mean 0.75 -> [0.25, 0.25, 0.25, -0.75]
    assert_matches(group_advantages(t32([[1.0, 1.0, 1.0, 0.0]]), "dr_grpo"), [[0.25, 0.25, 0.25, -0.75]])


def test_hand_reinforce_pp():
    # [[1, 0], [0, 0]] -> group-centred [[0.5, -0.5], [0, 0]]; batch mean 0;
    # unbiased batch std = sqrt((0.25 + 0.25 + 0 + 0) / 3) = sqrt(1/6) = 0.4082483
    # -> 0.5 / 0.4082483 = 1.2247449 (eps = 0)
    assert_matches(group_advantages(t32([[1.0, 0.0], [0.0, 0.0]]), "reinforce_pp", eps=0.0),
                   [[1.2247449, -1.2247449], [0.0, 0.0]])


def _one_token(log_ratio: float, adv: float, **kw):
    return policy_loss(t32([[log_ratio]]), t32([[0.0]]), t32([[adv]]), t32([[1.0]]), **kw)


def test_hand_ppo_single_token():
    # ratio e = 2.7182818, A = -1, eps 0.2: surr = -e, clipped surr = 1.2 * -1 = -1.2;
    # loss = -min(-e, -1.2) = e = 2.7182818, not counted as clipped (the clipped term is larger)
    loss, stats = _one_token(1.0, -1.0)
    assert_matches(loss, 2.7182818)
    assert_matches(stats["ratio_mean"], 2.7182818)
    assert stats["clip_frac"].item() == 0.0
    # dual clip c = 3: min(e, -3 * -1 = 3) = e = 2.7182818 (under the cap)
    assert_matches(_one_token(1.0, -1.0, dual_clip=3.0)[0], 2.7182818)
    # dual clip c = 2: min(e, 2) = 2.0 (capped)
    assert_matches(_one_token(1.0, -1.0, dual_clip=2.0)[0], 2.0)
    # ratio e, A = +1: -min(e, 1.2) = -1.2, clipped
    loss, stats = _one_token(1.0, 1.0)
    assert_matches(loss, -1.2)
    assert stats["clip_frac"].item() == 1.0
    # asymmetric clip eps_low 0.2 / eps_high 0.28, ratio 2, A = +1: -min(2, 1.28) = -1.28
    assert_matches(_one_token(math.log(2.0), 1.0, eps_low=0.2, eps_high=0.28)[0], -1.28)
    # ratio 0.5, A = -1: -min(-0.5, -0.8) = 0.8, clipped at 1 - eps_low
    loss, stats = _one_token(math.log(0.5), -1.0, eps_low=0.2, eps_high=0.28)
    assert_matches(loss, 0.8)
    assert stats["clip_frac"].item() == 1.0
    # ratio 1/e = 0.3678794, A = +1: -min(0.3678794, 0.8) = -0.3678794 (pessimistic, unclipped)
    loss, stats = _one_token(-1.0, 1.0)
    assert_matches(loss, -0.3678794)
    assert stats["clip_frac"].item() == 0.0


def test_hand_kl():
    # logp = 0, ref = ln 2: log r = 0.6931472, r = 2
    # k1 = -ln 2 = -0.6931472; k2 = 0.6931472^2 / 2 = 0.2402265; k3 = (2 - 1) - ln 2 = 0.3068528
    logp, ref = t32([[0.0]]), t32([[math.log(2.0)]])
    assert_matches(kl_penalty(logp, ref, "k1"), [[-0.6931472]])
    assert_matches(kl_penalty(logp, ref, "k2"), [[0.2402265]])
    assert_matches(kl_penalty(logp, ref, "k3"), [[0.3068528]])


def test_hand_aggregate_and_entropy():
    x, m = t32([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]), t32([[1, 1, 1], [1, 0, 0]])
    assert_matches(aggregate(x, m, "token"), 2.5)                       # (1+2+3+4) / 4
    assert_matches(aggregate(x, m, "seq"), 3.0)                         # (6/3 + 4/1) / 2
    assert_matches(aggregate(x, m, "group", torch.tensor([0, 0])), 2.5)  # one group = token mean
    assert_matches(aggregate(x, m, "group", torch.tensor([5, 1])), 3.0)  # one per group = seq mean
    # entropy bonus: -coef * H; H token mean = (1 + 3 + 2) / 3 = 2 -> -0.01 * 2 = -0.02
    h, hm = t32([[1.0, 3.0], [2.0, 50.0]]), t32([[1, 1], [1, 0]])
    assert_matches(entropy_bonus(h, hm, 0.01), -0.02)


def test_hand_importance_weight():
    one = t32([[1.0]])
    # decoupled (untruncated): exp(0 - (-1)) = e = 2.7182818; TIS truncates it at 2 -> 2.0
    assert_matches(offpolicy.decoupled(t32([[0.0]]), t32([[-1.0]]), one).weight, [[2.7182818]])
    assert_matches(offpolicy.tis(t32([[0.0]]), t32([[-1.0]]), one, tis_cap=2.0).weight, [[2.0]])
    # exp(-1 - 0) = 1/e = 0.3678794 (under any cap >= 1)
    assert_matches(offpolicy.tis(t32([[-1.0]]), t32([[0.0]]), one, tis_cap=2.0).weight, [[0.3678794]])


# ====================================================================== policy loss vs reference


CLIPS = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]


def test_fixed_batch_covers_every_clip_case():
    """The batch exercises, for both signs of A, ratios below / inside / above the clip range,
    active clipping, and the dual clip (with c = 3 and c = 1.5)."""
    for eps_low, eps_high in CLIPS:
        seen = set()
        for b in range(6):
            for t in range(5):
                if not MASK[b][t] or ADV[b][t] == 0:
                    continue
                r = math.exp(LOGP[b][t] - PROX[b][t])
                where = "below" if r < 1 - eps_low else "above" if r > 1 + eps_high else "inside"
                sign = "+" if ADV[b][t] > 0 else "-"
                seen.add((sign, where))
                for c in (3.0, 1.5):
                    if ADV[b][t] < 0 and r * -ADV[b][t] > -c * ADV[b][t]:
                        seen.add(("dual", c))
        expected = {(s, w) for s in "+-" for w in ("below", "inside", "above")} | {("dual", 3.0), ("dual", 1.5)}
        assert seen == expected, (eps_low, eps_high, expected - seen)
    # TIS weights both below and above the cap
    w = ref_tis_weight(PROX, BEHAV, TIS_CAP)
    assert any(w[b][t] == TIS_CAP for b in range(6) for t in range(5) if MASK[b][t])
    assert any(1 < w[b][t] < TIS_CAP for b in range(6) for t in range(5) if MASK[b][t])


@pytest.mark.parametrize("weight_kind", [None, "tis", "decoupled"])
@pytest.mark.parametrize("agg,gids", AGGS, ids=AGG_IDS)
@pytest.mark.parametrize("dual_clip", [None, 3.0, 1.5])
@pytest.mark.parametrize("eps_low,eps_high", CLIPS)
def test_policy_loss_matches_reference(eps_low, eps_high, dual_clip, agg, gids, weight_kind):
    weight, ref_weight = _weights(weight_kind)
    logp = t32(LOGP).requires_grad_(True)
    loss, stats = policy_loss(logp, t32(PROX), t32(ADV), t32(MASK), eps_low=eps_low, eps_high=eps_high,
                              dual_clip=dual_clip, weight=weight, agg=agg, group_ids=_gids(gids))
    ref = ref_policy_loss(LOGP, PROX, ADV, MASK, eps_low, eps_high, dual_clip, ref_weight, agg,
                          GROUP_IDS[gids] if gids else None)
    assert loss.dim() == 0
    assert_matches(loss, ref["loss"])
    assert_matches(stats["ratio_mean"], ref["ratio_mean"])
    assert_matches(stats["ratio_max"], ref["ratio_max"])
    assert_matches(stats["clip_frac"], ref["clip_frac"])
    # gradient w.r.t. logp: d(-rA)/dlogp = -rA where the unclipped term is active, 0 where the
    # clipped term or the dual-clip cap is, times the weight and the aggregation coefficient
    loss.backward()
    assert_matches(logp.grad, ref["grad"])


def test_policy_loss_accepts_bool_mask():
    a, _ = policy_loss(t32(LOGP), t32(PROX), t32(ADV), t32(MASK), dual_clip=3.0)
    b, _ = policy_loss(t32(LOGP), t32(PROX), t32(ADV), torch.tensor(MASK, dtype=torch.bool), dual_clip=3.0)
    assert a.item() == b.item()


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_pipeline_rewards_to_loss_matches_reference(method):
    """Rewards [3 groups x 2] -> advantages -> broadcast onto tokens -> loss (group aggregation)."""
    rewards = f32_rows([[1.0, 0.0], [0.5, 0.5], [0.9, 0.2]])
    adv_tokens = tokens_from_samples(group_advantages(t32(rewards), method).flatten(), t32(MASK))
    loss, stats = policy_loss(t32(LOGP), t32(PROX), adv_tokens, t32(MASK), eps_low=0.2, eps_high=0.28,
                              dual_clip=3.0, agg="group", group_ids=torch.tensor([0, 0, 1, 1, 2, 2]))
    per_sample = [a for row in ref_advantages(rewards, method) for a in row]
    ref_adv = [[per_sample[b] * MASK[b][t] for t in range(5)] for b in range(6)]
    ref = ref_policy_loss(LOGP, PROX, ref_adv, MASK, 0.2, 0.28, 3.0, None, "group", [0, 0, 1, 1, 2, 2])
    assert_matches(loss, ref["loss"])
    if method != "reinforce_pp":
        # reinforce_pp: the batch mean of group-centred values is 0 exactly, but about -1e-8 in
        # float32, so the zero-variance group gets advantages of ~+2.6e-8 instead of 0. Those
        # are within tolerance, but their sign decides whether clipping is "active" on their
        # out-of-range tokens, so clip_frac is not comparable there.
        assert_matches(stats["clip_frac"], ref["clip_frac"])


# ====================================================================== KL, entropy, weights


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_token_matches_reference(estimator):
    expected = [[ref_kl(LOGP[b][t], REF_LOGP[b][t], estimator) for t in range(5)] for b in range(6)]
    assert_matches(kl_penalty(t32(LOGP), t32(REF_LOGP), estimator), expected)


@pytest.mark.parametrize("agg,gids", AGGS, ids=AGG_IDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_aggregated_matches_reference(estimator, agg, gids):
    per_token = [[ref_kl(LOGP[b][t], REF_LOGP[b][t], estimator) for t in range(5)] for b in range(6)]
    out = aggregate(kl_penalty(t32(LOGP), t32(REF_LOGP), estimator), t32(MASK), agg, _gids(gids))
    assert_matches(out, ref_aggregate(per_token, MASK, agg, GROUP_IDS[gids] if gids else None))


def test_kl_default_estimator_is_k3():
    assert torch.equal(kl_penalty(t32(LOGP), t32(REF_LOGP)), kl_penalty(t32(LOGP), t32(REF_LOGP), "k3"))


@pytest.mark.parametrize("agg,gids", AGGS, ids=AGG_IDS)
@pytest.mark.parametrize("coef", [0.01, 0.0, -0.5])
def test_entropy_bonus_matches_reference(coef, agg, gids):
    out = entropy_bonus(t32(ENTROPY), t32(MASK), coef, agg, _gids(gids))
    assert_matches(out, -coef * ref_aggregate(ENTROPY, MASK, agg, GROUP_IDS[gids] if gids else None))


@pytest.mark.parametrize("agg,gids", AGGS, ids=AGG_IDS)
def test_aggregate_matches_reference(agg, gids):
    assert_matches(aggregate(t32(ADV), t32(MASK), agg, _gids(gids)),
                   ref_aggregate(ADV, MASK, agg, GROUP_IDS[gids] if gids else None))


def test_importance_weights_match_reference():
    assert_matches(offpolicy.tis(t32(PROX), t32(BEHAV), t32(MASK), tis_cap=TIS_CAP).weight,
                   _masked(ref_tis_weight(PROX, BEHAV, TIS_CAP)))
    assert_matches(offpolicy.decoupled(t32(PROX), t32(BEHAV), t32(MASK)).weight, _masked(ref_behaviour_weight(PROX, BEHAV)))


# ====================================================================== properties


@pytest.mark.parametrize("agg,gids", AGGS, ids=AGG_IDS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_on_policy_ratio_is_exactly_one(dual_clip, agg, gids):
    logp = t32(LOGP)
    loss, stats = policy_loss(logp, logp.clone(), t32(ADV), t32(MASK), eps_low=0.2, eps_high=0.28,
                              dual_clip=dual_clip, agg=agg, group_ids=_gids(gids))
    assert stats["ratio_mean"].item() == 1.0
    assert stats["ratio_max"].item() == 1.0
    assert stats["clip_frac"].item() == 0.0
    # ratio 1 is inside the clip range and under the dual cap (c > 1): loss = -A aggregated
    neg_adv = [[-a for a in row] for row in ADV]
    assert_matches(loss, ref_aggregate(neg_adv, MASK, agg, GROUP_IDS[gids] if gids else None))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_against_identical_reference_is_exactly_zero(estimator):
    logp = t32(LOGP)
    kl = kl_penalty(logp, logp.clone(), estimator)
    assert torch.equal(kl, torch.zeros_like(kl))
    assert aggregate(kl, t32(MASK)).item() == 0.0


def test_kl_k2_k3_non_negative():
    for estimator in ("k2", "k3"):
        assert (kl_penalty(t32(LOGP), t32(REF_LOGP), estimator) >= 0).all()


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_gradient_at_ratio_one(agg):
    """On-policy, d loss / d logp = -A / num_tokens per unmasked token for token aggregation
    (-A / (B * len_b) for seq), 0 on masked tokens; no gradient flows into prox_logp."""
    logp = t32(LOGP).requires_grad_(True)
    prox = t32(LOGP).requires_grad_(True)
    loss, _ = policy_loss(logp, prox, t32(ADV), t32(MASK), dual_clip=3.0, agg=agg)
    loss.backward()
    n = sum(map(sum, MASK))
    lens = [sum(row) for row in MASK]
    if agg == "token":
        expected = [[-ADV[b][t] / n * MASK[b][t] for t in range(5)] for b in range(6)]
    else:
        expected = [[-ADV[b][t] / (6 * lens[b]) * MASK[b][t] for t in range(5)] for b in range(6)]
    assert_matches(logp.grad, expected)
    assert prox.grad is None


def test_importance_weight_has_no_gradient():
    numer = t32(PROX).requires_grad_(True)
    denom = t32(BEHAV).requires_grad_(True)
    for name in ("tis", "tis_seq", "mis", "decoupled", "icepop"):
        w = offpolicy.correct(name, numer, denom, t32(MASK)).weight
        assert not w.requires_grad and w.grad_fn is None, name


def test_weight_from_logp_is_a_constant_in_the_gradient():
    """A TIS weight built from the learner's own log-probs scales the gradient but is not
    differentiated through (importance_weight detaches)."""
    logp = t32(LOGP).requires_grad_(True)
    w = offpolicy.tis(logp, t32(BEHAV), t32(MASK), tis_cap=TIS_CAP).weight
    loss, _ = policy_loss(logp, t32(PROX), t32(ADV), t32(MASK), dual_clip=3.0, weight=w)
    loss.backward()
    ref = ref_policy_loss(LOGP, PROX, ADV, MASK, 0.2, 0.2, 3.0, ref_tis_weight(LOGP, BEHAV, TIS_CAP))
    assert_matches(loss, ref["loss"])
    assert_matches(logp.grad, ref["grad"])


def test_group_aggregation_limits_and_label_invariance():
    x, m = t32(ADV), t32(MASK)
    assert_matches(aggregate(x, m, "group", torch.zeros(6, dtype=torch.long)), aggregate(x, m, "token").item())
    assert_matches(aggregate(x, m, "group", torch.arange(6)), aggregate(x, m, "seq").item())
    relabelled = torch.tensor([100, 100, -4, -4, 55, 55])
    assert_matches(aggregate(x, m, "group", relabelled),
                   aggregate(x, m, "group", torch.tensor(GROUP_IDS["contiguous"])).item())


# ====================================================================== invalid arguments


def test_invalid_arguments_raise_value_error():
    lp, m = t32(LOGP), t32(MASK)
    with pytest.raises(ValueError):
        group_advantages(t32(REWARDS), "ppo")
    with pytest.raises(ValueError):
        kl_penalty(lp, t32(REF_LOGP), "k4")
    with pytest.raises(ValueError):
        aggregate(lp, m, "batch")
    with pytest.raises(ValueError):
        policy_loss(lp, t32(PROX), t32(ADV), m, agg="sample")
    with pytest.raises(ValueError):
        entropy_bonus(t32(ENTROPY), m, 0.01, agg="sample")
    for c in (1.0, 0.5, 0.0, -2.0):
        with pytest.raises(ValueError):
            policy_loss(lp, t32(PROX), t32(ADV), m, dual_clip=c)
    with pytest.raises(ValueError):
        group_advantages(t32([[1.0], [0.0]]), "rloo")
    with pytest.raises(ValueError):
        aggregate(lp, m, "group")
    with pytest.raises(ValueError):
        policy_loss(lp, t32(PROX), t32(ADV), m, agg="group")
    with pytest.raises(ValueError):
        entropy_bonus(t32(ENTROPY), m, 0.01, agg="group")
    for bad in (t32([1.0, 0.0, 1.0]), t32([[[1.0, 0.0]]]), torch.tensor(1.0)):
        for method in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            with pytest.raises(ValueError):
                group_advantages(bad, method)


# ====================================================================== devices and edge cases


def test_fully_masked_sequences_and_groups_are_left_out_of_the_mean():
    x = torch.tensor([[1.0, 2.0], [5.0, 5.0], [7.0, 9.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    assert aggregate(x, m, "seq").item() == pytest.approx((1.5 + 7.0) / 2)  # row 2 has no tokens
    assert aggregate(x, m, "group", torch.tensor([0, 1, 2])).item() == pytest.approx((1.5 + 7.0) / 2)
    assert aggregate(x, m, "group", torch.tensor([0, 1, 1])).item() == pytest.approx((1.5 + 7.0) / 2)
    assert aggregate(x, torch.zeros_like(m), "seq").item() == 0.0


def test_integer_rewards_are_accepted():
    out = group_advantages(torch.tensor([[1, 0, 0, 1]]), "dr_grpo")
    assert out.dtype == torch.float32 and out.tolist() == [[0.5, -0.5, -0.5, 0.5]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_group_aggregation_on_cuda():
    x, m = t32(ADV).cuda(), t32(MASK).cuda()
    out = aggregate(x, m, "group", torch.tensor(GROUP_IDS["scattered"]).cuda())
    assert_matches(out.cpu(), ref_aggregate(ADV, MASK, "group", GROUP_IDS["scattered"]))
