"""Verifier-located credit (recipe `learner.negative_credit: first_error`).

GRPO spreads a sample's advantage over all its tokens. On a long verifiable chain that goes wrong
once, that pushes down every step the verifier found right (noise that the group's successes must
cancel) and every step written after the mistake, which are often right given the wrong number
before them (so the push teaches wrong arithmetic). When the reward function can say where the
response first goes wrong - a reward component `first_error`, the character offset of the first
wrong character of the response text it was given - a below-average sample can train on that
token alone: the one decision the verifier blames. An above-average sample keeps every token, or,
when the verifier still finds an error in it (a partial-credit reward scores a right prefix), the
tokens before that error: a wrong token is never reinforced and a verified-right one never pushed down.

The rollout worker maps the character to a token (`token_of_char`, a binary search over the
decoded lengths of the response's token prefixes) and stores it as the component `first_error_token`; the learner
masks (`error_mask`). Pure functions: no tokenizer, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

ERROR_CHAR = "first_error"  # reward component: offset of the first wrong character (absent or < 0: none found)
ERROR_TOKEN = "first_error_token"  # stored beside it: the index of the response token holding that character


def token_of_char(end_of: Callable[[int], int], n: int, offset: float) -> int | None:
    """The response token holding character `offset` of the response text, among `n` tokens;
    `end_of(k)` is the length of the text of tokens[:k + 1] (non-decreasing in k, so a binary
    search asks for ~log2(n) of them: each is a decode). An offset at or past the end of the text
    (the chain stopped too early: what is wrong is where it stopped) is the last token. None when
    there are no tokens or no error (offset < 0)."""
    if n <= 0 or offset < 0:
        return None
    return min(bisect.bisect_right(range(n), offset, key=end_of), n - 1)


def error_mask(loss_mask: Sequence[int], advantage: float, error_token: float | None) -> list[int]:
    """The loss mask a sample trains with under `first_error`, given the response token its
    verifier blames (None: no error located): below average (advantage < 0) -> that token alone;
    above average -> its tokens before it (a partial-credit reward rewards the right prefix, not the
    mistake or what follows it); otherwise, or when the blamed token is not one it trains on, its
    own mask."""
    mask = [int(m) for m in loss_mask]
    if advantage == 0 or error_token is None:
        return mask
    k = int(error_token)
    if not 0 <= k < len(mask) or not mask[k]:
        return mask
    if advantage > 0:
        return mask[:k] + [0] * (len(mask) - k)
    out = [0] * len(mask)
    out[k] = 1
    return out
