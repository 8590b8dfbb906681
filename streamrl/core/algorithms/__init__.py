"""RL algorithms as pure functions on tensors: advantages, policy losses, KL, entropy,
aggregation and off-policy corrections. No model, no I/O: the learner calls them."""

from streamrl.core.algorithms.advantages import group_advantages, tokens_from_samples
from streamrl.core.algorithms.losses import (
    aggregate,
    entropy_bonus,
    importance_weight,
    kl_penalty,
    policy_loss,
)

__all__ = ["aggregate", "entropy_bonus", "group_advantages", "importance_weight", "kl_penalty",
           "policy_loss", "tokens_from_samples"]
