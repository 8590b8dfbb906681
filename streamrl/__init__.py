"""StreamRL: bounded-off-policy streaming RL post-training for LLMs.

Read streamrl/runtime/loop.py first (the whole run in one screen). The packages, by role:
core/ (pure rules and data), runtime/ (the running system), producers/ (agent episodes and
external producers), plugins/ (rewards, filters, data, tasks), tools/ (CLI, replay, report),
connectors/ (sglang/: engines and router; megatron/: the learner), pools/ (the experience pool),
recipes/.
"""

__version__ = "0.1.0"
