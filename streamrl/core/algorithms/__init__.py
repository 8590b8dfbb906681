"""RL algorithms as pure functions on tensors: advantages, policy losses, KL, entropy,
aggregation, off-policy corrections and the per-micro-batch objective. No model, no I/O: the
learner calls them."""

from streamrl.core.algorithms import offpolicy
from streamrl.core.algorithms.advantages import group_advantages, tokens_from_samples
from streamrl.core.algorithms.losses import (
    aggregate,
    aggregation_units,
    entropy_bonus,
    kl_penalty,
    policy_loss,
)
from streamrl.core.algorithms.objective import LossInputs, RLConfig, micro_batch_loss

__all__ = ["LossInputs", "RLConfig", "aggregate", "aggregation_units", "entropy_bonus", "group_advantages",
           "kl_penalty", "micro_batch_loss", "offpolicy", "policy_loss", "tokens_from_samples"]
