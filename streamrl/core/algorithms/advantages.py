"""Group-relative advantages from scalar rewards, one value per sample.

`rewards` is [groups, n] (a GRPO group per row). Formulas:
- grpo:         (r - mean_g) / (std_g + eps), std unbiased (torch default, as slime and verl)
- dr_grpo:      r - mean_g (Dr. GRPO drops the std normalisation)
- rloo:         r_i - mean_{j != i} r_j  =  n / (n - 1) * (r_i - mean_g)
- reinforce_pp: A = r - mean_g, then whitened over the whole batch: (A - mean(A)) / (std(A) + eps)
                (REINFORCE++ with a group baseline; whitened per sample, where verl whitens per token)
"""

from __future__ import annotations

import torch

from streamrl.core.corrections import Advantage as AdvantageMethod  # the names, where the recipe reads them


def group_advantages(rewards: torch.Tensor, method: AdvantageMethod = "grpo", eps: float = 1e-6) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    n = rewards.shape[1]
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if method == "grpo":
        std = rewards.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(rewards[:, :1])
        return centred / (std + eps)
    if method == "dr_grpo":
        return centred
    if method == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per group")
        return centred * (n / (n - 1))
    if method == "reinforce_pp":
        flat = centred.flatten()
        std = flat.std() if flat.numel() > 1 else torch.zeros(())
        return (centred - flat.mean()) / (std + eps)
    raise ValueError(f"unknown advantage method {method!r}")


def tokens_from_samples(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per sample [B] onto its response tokens [B, T] (zero where masked)."""
    return per_sample.reshape(-1, 1) * mask
