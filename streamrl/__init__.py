"""StreamRL: bounded-off-policy streaming RL post-training for LLMs."""

__version__ = "0.1.0"
