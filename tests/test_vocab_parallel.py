"""The learner's log-probs and entropy with the output layer applied in chunks on each rank's vocabulary shard
(connectors/megatron/vocab_parallel.py) against the plain computation on whole logits (batch.logprobs_and_entropy
on hidden @ W.T: log_softmax with autograd, the oracle): values and gradients (of the hidden states and of the
output weight) within 1e-5 in fp32, for every loss the core builds, at tp = 1 and tp = 2 (two gloo processes,
each holding half of the vocabulary); hand-worked values; nothing [tokens, vocab] kept for backward."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrl.connectors.megatron.batch import logprobs_and_entropy
from streamrl.connectors.megatron.vocab_parallel import chosen_logprobs
from streamrl.core.algorithms.objective import RLConfig
from streamrl.core.algorithms.offpolicy import CORRECTIONS
from streamrl.core.algorithms.step import loss_inputs, micro_batch_loss

B, T, H, V = 4, 9, 16, 64
TOL = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 1e-5, relative to the largest value where that exceeds 1 (fp32 sums of a few hundred terms)."""
    return got.shape == want.shape and float((got - want).abs().max()) <= TOL * max(1.0, float(want.abs().max()))


def _case(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, ids


def oracle(hidden, weight, ids, temperature=1.0, with_entropy=True):
    return logprobs_and_entropy(hidden @ weight.t(), ids, temperature, with_entropy)


def chunked(rows=None, group=None):
    return lambda hidden, weight, ids, temperature=1.0, with_entropy=True: chosen_logprobs(
        hidden, weight, ids, temperature, with_entropy, group, rows)


def _inputs(cfg: RLConfig, hidden, weight, ids, seed: int = 1):
    """A micro-batch's loss inputs as the learner builds them: prompts of 2-4 tokens, some tokens out of
    the loss, proximal, rollout and reference log-probs near the model's (ratios off 1, some clipped),
    two groups of two."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.zeros(B, T - 1)
    for i, p in enumerate([2, 3, 2, 4]):
        resp[i, p - 1:] = 1
    loss_mask = (torch.rand(B, T - 1, generator=g) > 0.15).float()
    prox = oracle(hidden, weight, ids, cfg.temperature, False)[0] + 0.2 * torch.randn(B, T - 1, generator=g)
    behav = prox + 0.3 * torch.randn(B, T - 1, generator=g)
    ref = prox + 0.2 * torch.randn(B, T - 1, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    x, _ = loss_inputs(cfg, prox, resp, loss_mask, behav, adv, torch.tensor([0, 0, 1, 1]), ref)
    x.share = 0.5
    return x


def _loss_and_grads(fn, hidden, weight, ids, cfg: RLConfig, x):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp, ent = fn(h, w, ids, cfg.temperature, True)
    loss, parts = micro_batch_loss(logp, ent, x, cfg)
    loss.backward()
    return loss.detach(), h.grad, w.grad, parts


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("rows", [1, 5, None])
def test_values_and_gradients_equal_the_whole_logits_softmax(temperature, rows):
    hidden, weight, ids = _case()
    g = torch.Generator().manual_seed(7)
    w_logp, w_ent = torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)
    got, want = [], []
    for fn, out in ((chunked(rows), got), (oracle, want)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = fn(h, w, ids, temperature)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        out += [logp.detach(), ent.detach(), h.grad, w.grad]
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight"), got, want):
        assert close(a, b), (name, float((a - b).abs().max()), float(b.abs().max()))


def test_log_probs_alone_frozen_weight_and_bf16():
    """Without entropy, none is returned; a frozen output weight (LoRA) gets no gradient; bf16 hidden states
    and weight give the oracle's numbers on the same bf16 logits, and bf16 gradients."""
    hidden, weight, ids = _case(3, torch.bfloat16)
    logp, ent = chosen_logprobs(hidden, weight, ids, 1.0, with_entropy=False)
    want, _ = logprobs_and_entropy(hidden @ weight.t(), ids, 1.0, False)
    assert ent is None and (logp - want).abs().max() < TOL
    h = hidden.clone().requires_grad_()
    chosen_logprobs(h, weight, ids, 1.0, with_entropy=True)[0].sum().backward()  # entropy computed, not used
    ref = hidden.clone().requires_grad_()
    oracle(ref, weight, ids, 1.0, False)[0].sum().backward()
    assert h.grad.dtype == torch.bfloat16 and weight.grad is None
    assert (h.grad.float() - ref.grad.float()).abs().max() < 2e-2  # bf16 rounding of the same numbers


def test_nothing_vocabulary_sized_is_kept_for_backward():
    """What autograd keeps between forward and backward: the hidden states, the weight and per-token numbers;
    the oracle keeps the logits' fp32 log-softmax and its exp ([B, T-1, V] each) besides."""
    hidden, weight, ids = _case(4)

    def kept(fn) -> list[int]:
        saved: list[torch.Tensor] = []
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            logp, ent = fn(h, w, ids, 1.0, True)
            (logp.sum() + ent.sum()).backward()
        seen = {t.untyped_storage().data_ptr(): t for t in saved}  # views of one storage count once
        return sorted(t.numel() for t in seen.values() if t.numel() >= B * (T - 1) * V)

    assert kept(chunked()) == []
    assert kept(oracle) == [B * (T - 1) * V] * 2


LOSSES = [
    RLConfig(loss_agg=agg, kl_coef=kl, kl_estimator=est, entropy_coef=ent, off_policy=corr, dual_clip=dual,
             temperature=temp)
    for (agg, (kl, est), ent, corr, dual, temp) in [
        *((agg, (0.0, "k3"), 0.0, "none", None, 1.0) for agg in ("token", "seq", "group")),
        *(("token", (0.1, est), 0.0, "none", None, 1.0) for est in ("k1", "k2", "k3")),
        ("seq", (0.0, "k3"), 0.01, "none", None, 0.7),
        ("group", (0.05, "k2"), 0.02, "tis", 3.0, 1.0),
        *(("token", (0.0, "k3"), 0.0, c, None, 1.0) for c in sorted(CORRECTIONS) if c != "none"),
    ]]


def _name(c: RLConfig) -> str:
    return f"{c.loss_agg}-kl{c.kl_coef}{c.kl_estimator}-ent{c.entropy_coef}-{c.off_policy}-dual{c.dual_clip}-T{c.temperature}"


@pytest.mark.parametrize("cfg", LOSSES, ids=_name)
def test_every_loss_in_the_core_has_the_same_value_and_gradients(cfg):
    hidden, weight, ids = _case(5)
    x = _inputs(cfg, hidden, weight, ids)
    loss, dh, dw, parts = _loss_and_grads(chunked(7), hidden, weight, ids, cfg, x)
    want, want_dh, want_dw, want_parts = _loss_and_grads(oracle, hidden, weight, ids, cfg, x)
    assert close(loss, want) and close(dh, want_dh) and close(dw, want_dw)
    assert all(close(parts[k], want_parts[k]) for k in want_parts)
    assert dh.abs().sum() > 0 and dw.abs().sum() > 0  # the case trains something


def test_some_loss_clips():
    """The cases above exercise PPO's clip, not only the unclipped ratio."""
    hidden, weight, ids = _case(5)
    assert max(float(_loss_and_grads(chunked(), hidden, weight, ids, c, _inputs(c, hidden, weight, ids))[3]["clip_frac"])
               for c in LOSSES) > 0


TP_CASES = (0, 7, 8)  # token aggregation; group + KL + entropy + TIS + dual clip at T 0.7 / 1.0


def _tp2_rank(rank: int, store_path: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        hidden, weight, ids = _case(6)
        shard = weight.chunk(2, dim=0)[rank]  # megatron's vocab-parallel output layer: rows V/2 * rank onwards
        rows = []
        for cfg in (LOSSES[i] for i in TP_CASES):
            x = _inputs(cfg, hidden, weight, ids)
            loss, dh, dw, _ = _loss_and_grads(chunked(5, dist.group.WORLD), hidden, shard, ids, cfg, x)
            want, want_dh, want_dw, _ = _loss_and_grads(oracle, hidden, weight, ids, cfg, x)
            logp, ent = chosen_logprobs(hidden, shard, ids, cfg.temperature, True, dist.group.WORLD)
            wlogp, went = oracle(hidden, weight, ids, cfg.temperature)
            pairs = ((loss, want), (dh, want_dh), (dw, want_dw.chunk(2, dim=0)[rank]), (logp, wlogp), (ent, went))
            rows.append([float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs]
                        + [float(dw.abs().sum())])
        torch.save(torch.tensor(rows), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_each_holding_half_the_vocabulary(tmp_path):
    """Each rank's loss and hidden-state gradient equal the one-process ones, and its weight gradient is its
    half of the one-process gradient."""
    out = str(tmp_path / "gaps")
    mp.start_processes(_tp2_rank, args=(str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    for rank in range(2):
        gaps = torch.load(f"{out}.{rank}")
        assert gaps.shape == (len(TP_CASES), 6)
        assert (gaps[:, :5].abs() < TOL).all(), gaps
        assert (gaps[:, 5] > 0).all()  # each half gets a gradient


def test_hand_worked_log_probs_and_entropy():
    """Logits 0, ln 2, 0, ln 3 (hidden states through an identity output layer): softmax 1/7, 2/7, 1/7, 3/7;
    targets 1 and 3: log-probs log 2/7 and log 3/7, entropy -sum p log p = 1.277034 nats."""
    logits = torch.log(torch.tensor([1.0, 2.0, 1.0, 3.0])).expand(1, 3, 4).contiguous()
    logp, ent = chosen_logprobs(logits, torch.eye(4), torch.tensor([[0, 1, 3]]), 1.0, True)
    assert torch.allclose(logp, torch.tensor([[-1.252763, -0.847298]]), atol=1e-6)
    assert torch.allclose(ent, torch.tensor([[1.277034, 1.277034]]), atol=1e-6)
