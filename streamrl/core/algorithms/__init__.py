"""RL algorithms as pure functions on tensors: the RL step from scored samples to the loss
(step.py: advantages, off-policy correction, loss; built-ins and user functions through one
door), with the formulas it uses: advantage estimators, policy losses, KL, entropy, aggregation
and off-policy corrections. No model, no I/O: the learner calls them."""

from streamrl.core.algorithms import offpolicy
from streamrl.core.algorithms.advantages import group_advantages, tokens_from_samples
from streamrl.core.algorithms.losses import (
    aggregate,
    aggregation_units,
    entropy_bonus,
    kl_penalty,
    policy_loss,
)
from streamrl.core.algorithms.objective import LossInputs, RLConfig
from streamrl.core.algorithms.step import loss_inputs, micro_batch_loss, pick, sample_advantages, scored

__all__ = ["LossInputs", "RLConfig", "aggregate", "aggregation_units", "entropy_bonus", "group_advantages",
           "kl_penalty", "loss_inputs", "micro_batch_loss", "offpolicy", "pick", "policy_loss", "sample_advantages",
           "scored", "tokens_from_samples"]
