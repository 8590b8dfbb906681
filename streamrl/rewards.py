"""Built-in reward functions, referenced from recipes as `streamrl.rewards:<name>`."""

from __future__ import annotations


def exact_match(response: str, label: str, **_: object) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0
