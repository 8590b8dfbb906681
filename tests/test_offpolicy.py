"""Off-policy corrections (streamrl/core/algorithms/offpolicy.py) against hand-computed values, and
the per-micro-batch objective (objective.py): micro-batches weighted by their share of the
aggregation units sum to the full-batch loss and gradient, also with a sample whose loss mask is
all zero.

The batch: prox = 0, so the per-token weight exp(prox - behav) is exp(-behav); four rows of
three tokens, the masked positions of the behaviour log-probs hold NaN (nothing may leak):

    row 0   weights [3, 0.25, -]      mask [1, 1, 0]
    row 1   (no token in the loss)    mask [0, 0, 0]
    row 2   weights [1.5, 1.2, 0.8]   mask [1, 1, 1]
    row 3   weights [4, 2.5, -]       mask [1, 1, 0]   (a sequence over every cap)

Sequence weights: geometric mean row 0 sqrt(0.75) = 0.8660254, row 2 1.44^(1/3) = 1.1292432,
row 3 sqrt(10) = 3.1622777; product row 0 0.75, row 2 1.44, row 3 10.
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.core import corrections
from streamrl.core.algorithms import (
    LossInputs,
    RLConfig,
    aggregation_units,
    micro_batch_loss,
    offpolicy,
    policy_loss,
)

NAN = float("nan")
W = [[3.0, 0.25, NAN], [NAN, NAN, NAN], [1.5, 1.2, 0.8], [4.0, 2.5, NAN]]
MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
PROX = torch.zeros(4, 3)
BEHAV = torch.tensor([[NAN if math.isnan(w) else -math.log(w) for w in row] for row in W])
G, S10 = 0.8660254, 3.1622777  # sqrt(0.75), sqrt(10)
C3 = 1.44 ** (1 / 3)


def run(name: str, **kw):
    c = offpolicy.correct(name, PROX, BEHAV, MASK, **kw)
    return c, offpolicy.metrics(offpolicy.sums(PROX, BEHAV, MASK, c))


def close(t: torch.Tensor, expected) -> None:
    assert torch.allclose(t, torch.tensor(expected, dtype=t.dtype), atol=1e-6), (t.tolist(), expected)


def test_none_weights_nothing_and_reports_how_stale():
    c, m = run("none")
    assert c.weight is None and torch.equal(c.mask, MASK)
    # raw weights over the 7 loss tokens: (3 + .25 + 1.5 + 1.2 + .8 + 4 + 2.5) / 7 = 13.25 / 7
    assert m["is_ratio_mean"] == pytest.approx(13.25 / 7) and m["is_ratio_max"] == pytest.approx(4.0)
    assert m["is_weight_mean"] == 1.0 and m["is_capped_tokens"] == m["is_masked_tokens"] == 0.0
    # the mean |log ratio| over the same 7 tokens
    gap = sum(abs(math.log(r)) for r in (3, .25, 1.5, 1.2, .8, 4, 2.5)) / 7
    assert m["logprob_gap"] == pytest.approx(gap, rel=1e-5)


def test_tis_truncates_tokens_at_the_cap():
    c, m = run("tis", tis_cap=2.0)
    close(c.weight, [[2, 0.25, 0], [0, 0, 0], [1.5, 1.2, 0.8], [2, 2, 0]])
    assert torch.equal(c.mask, MASK)
    # capped: 3 of 7 tokens, in 2 of the 3 sequences with tokens; weight mean 9.75 / 7
    assert m["is_capped_tokens"] == pytest.approx(3 / 7) and m["is_capped_seqs"] == pytest.approx(2 / 3)
    assert m["is_weight_mean"] == pytest.approx(9.75 / 7) and m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_masked_tokens"] == 0.0


@pytest.mark.parametrize("how, w0, w2", [("geometric", G, C3), ("product", 0.75, 1.44)])
def test_tis_seq_gives_each_sequence_one_truncated_weight(how, w0, w2):
    c, m = run("tis_seq", tis_cap=2.0, seq_ratio=how)
    close(c.weight, [[w0, w0, 0], [0, 0, 0], [w2, w2, w2], [2, 2, 0]])  # row 3 (sqrt 10 or 10) over the cap
    assert m["is_capped_seqs"] == pytest.approx(1 / 3) and m["is_capped_tokens"] == pytest.approx(2 / 7)


def test_mis_token_takes_out_of_band_tokens_out_of_the_loss():
    c, m = run("mis", mis_level="token", mis_low=0.5, mis_high=2.0)
    close(c.mask, [[0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]])
    close(c.weight, [[0, 0, 0], [0, 0, 0], [1.5, 1.2, 0.8], [0, 0, 0]])  # kept tokens keep their weight
    assert m["is_masked_tokens"] == pytest.approx(4 / 7) and m["is_masked_seqs"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("how, w0, w2", [("geometric", G, C3), ("product", 0.75, 1.44)])
def test_mis_sequence_masks_whole_sequences(how, w0, w2):
    c, m = run("mis", mis_level="sequence", mis_low=0.5, mis_high=2.0, seq_ratio=how)
    close(c.mask, [[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]])  # row 3 (sqrt 10 or 10) outside [0.5, 2]
    close(c.weight, [[w0, w0, 0], [0, 0, 0], [w2, w2, w2], [0, 0, 0]])
    assert m["is_masked_seqs"] == pytest.approx(1 / 3) and m["is_masked_tokens"] == pytest.approx(2 / 7)


def test_decoupled_is_untruncated_and_zeroes_tokens_over_its_cap():
    c, m = run("decoupled")
    close(c.weight, [[3, 0.25, 0], [0, 0, 0], [1.5, 1.2, 0.8], [4, 2.5, 0]])
    assert m["is_weight_max"] == pytest.approx(4.0) and m["is_masked_tokens"] == 0.0
    c, m = run("decoupled", decoupled_cap=2.6)
    close(c.weight, [[0, 0.25, 0], [0, 0, 0], [1.5, 1.2, 0.8], [0, 2.5, 0]])  # 3 and 4 -> 0, not 2.6
    assert torch.equal(c.mask, MASK)  # they stay in the aggregation (AReaL's denominator)
    assert m["is_masked_tokens"] == pytest.approx(2 / 7) and m["is_capped_tokens"] == 0.0


def test_icepop_zeroes_tokens_outside_its_band():
    c, m = run("icepop", icepop_low=0.5, icepop_high=5.0)
    close(c.weight, [[3, 0, 0], [0, 0, 0], [1.5, 1.2, 0.8], [4, 2.5, 0]])  # only 0.25 is outside [0.5, 5]
    assert torch.equal(c.mask, MASK) and m["is_masked_tokens"] == pytest.approx(1 / 7)


def test_masking_leaves_the_mean_while_a_zero_weight_stays_in_its_denominator():
    """At ratio 1 with A = 1 the token-mean loss is -sum(w) / (tokens in the mask): MIS divides by
    the 3 tokens it keeps, decoupled with a cap by all 7."""
    adv = torch.ones(4, 3)
    mis, _ = run("mis", mis_level="token")
    loss, _ = policy_loss(PROX, PROX, adv, mis.mask, weight=mis.weight)
    assert loss.item() == pytest.approx(-(1.5 + 1.2 + 0.8) / 3)
    dec, _ = run("decoupled", decoupled_cap=2.6)
    loss, _ = policy_loss(PROX, PROX, adv, dec.mask, weight=dec.weight)
    assert loss.item() == pytest.approx(-(0.25 + 1.5 + 1.2 + 0.8 + 2.5) / 7)


def test_huge_log_ratios_give_finite_weights():
    behav = torch.tensor([[-500.0, 500.0]])
    for name in ("decoupled", "icepop", "mis", "tis_seq"):
        c = offpolicy.correct(name, torch.zeros(1, 2), behav, torch.ones(1, 2))
        assert torch.isfinite(c.weight).all(), name
    assert offpolicy.decoupled(torch.zeros(1, 2), behav, torch.ones(1, 2)).weight[0, 0] == pytest.approx(math.exp(20))


def test_a_missing_behaviour_or_unknown_option_is_an_error():
    with pytest.raises(ValueError, match="rollout"):
        offpolicy.correct("tis", PROX, None, MASK)
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        offpolicy.correct("ppo", PROX, BEHAV, MASK)
    with pytest.raises(ValueError, match="low < high"):
        offpolicy.correct("icepop", PROX, BEHAV, MASK, icepop_low=2.0, icepop_high=1.0)
    with pytest.raises(ValueError, match="level"):
        offpolicy.correct("mis", PROX, BEHAV, MASK, mis_level="group")
    assert offpolicy.correct("none", PROX, None, MASK).weight is None


def test_auto_resolves_by_the_staleness_bound_and_params_fill_defaults():
    assert corrections.resolve("auto", 4) == corrections.STALE_DEFAULT != "none"
    assert corrections.resolve("auto", 0) == "none" and corrections.resolve("icepop", 0) == "icepop"
    cfg = RLConfig(off_policy="mis", mis_high=3.0)
    assert cfg.correction == {"mis_level": "token", "mis_low": 0.5, "mis_high": 3.0, "seq_ratio": "geometric"}

    class Learner:  # a recipe's learner section with the correction's keys unset
        off_policy, tis_cap, loss_agg, mini_batches, epochs = "auto", None, "seq", 2, 3

    got = RLConfig.from_recipe(Learner, 0.7, max_staleness=1)
    assert (got.off_policy, got.tis_cap, got.loss_agg, got.mini_batches, got.epochs) == ("tis", 2.0, "seq", 2, 3)
    assert RLConfig.from_recipe(Learner, 0.7, max_staleness=0).off_policy == "none"


# ------------------------------------------------------------------ micro-batches = full batch

B, T = 6, 5
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[3] = 0  # a sample whose loss mask is all zero (a stale sample under `mask`, a tool turn...)
    prox = -torch.rand(B, T, generator=g) * 3
    behav = prox - torch.randn(B, T, generator=g) * 0.5
    logp = (prox + torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    ent = (torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    ref = prox + torch.randn(B, T, generator=g) * 0.2
    return mask, prox, behav, logp, ent, adv, ref


@pytest.mark.parametrize("off_policy", ["none", "tis", "mis"])
@pytest.mark.parametrize("agg", ["token", "seq", "group"])
def test_micro_batches_weighted_by_share_equal_the_full_batch(agg, off_policy):
    cfg = RLConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, eps_clip_low=0.1, dual_clip=3.0,
                   off_policy=off_policy, mis_level="sequence")
    mask, prox, behav, logp, ent, adv, ref = _batch()
    c = offpolicy.correct(cfg.off_policy, prox, behav, mask, **cfg.correction)

    def loss_of(rows: slice, share: float):
        x = LossInputs(mask=c.mask[rows], adv=adv[rows], prox=prox[rows], groups=GROUPS[rows], share=share,
                       weight=None if c.weight is None else c.weight[rows], ref=ref[rows])
        return micro_batch_loss(logp[rows], ent[rows], x, cfg)[0]

    full = loss_of(slice(0, B), 1.0)
    full.backward()
    full_grads = logp.grad.clone(), ent.grad.clone()
    logp.grad = ent.grad = None
    parts = [slice(0, 2), slice(2, 4), slice(4, 6)]  # whole groups; the middle one holds the empty sample
    units = [aggregation_units(c.mask[p], agg, GROUPS[p]) for p in parts]
    total = sum(units)
    summed = sum(loss_of(p, u / total) for p, u in zip(parts, units))
    summed.backward()
    assert summed.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(logp.grad, full_grads[0], atol=1e-7) and torch.allclose(ent.grad, full_grads[1], atol=1e-7)
    assert logp.grad[3].abs().sum() == 0  # the empty sample gets no gradient


def test_aggregation_units_count_only_what_is_in_the_loss():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    groups = torch.tensor([0, 0, 1, 2])
    assert aggregation_units(mask, "token") == 3.0
    assert aggregation_units(mask, "seq") == 2.0  # row 1 and row 3 have no token
    assert aggregation_units(mask, "group", groups) == 2.0  # group 2 has no token
    with pytest.raises(ValueError):
        aggregation_units(mask, "group")
