"""The CPU quick-start's synthetic, verifiable task: "397+8=" -> "405".

Why it is built this way (tuned on the tiny preset, 0.13M parameters, 2 CPU cores):

- Three-digit plus one-digit addition. The model kit's tokenizer splits numbers into single
  digits, so an answer is 1-4 digit tokens + EOS and the reward is plain `exact_match`. The
  tiny model learns it from scratch in ~1000 SFT steps (~25 s); two-digit plus two-digit
  needs a seed-dependent "grokking" jump after 1500-3000 steps, too slow and too erratic.
- SFT data come from a noisy teacher: right `teacher_accuracy` (30%) of the time, otherwise
  off by 1 or 2 (`SLIPS`). A warm-started model then knows how to add but spreads its last
  digit over the teacher's slips: sampled accuracy plateaus near 0.3 x skill (~0.2) however
  long SFT runs, so the starting point does not hinge on under-training by just the right
  amount (an under-trained clean model sits on a steep, seed-dependent part of its curve, and
  one trained to its plateau leaves RL little to gain). The correct answer stays the most
  likely one, so GRPO with the exact-match reward sharpens it: sampled pass@1 gains +0.3-0.6
  in 200-300 steps (recipes/quickstart.yaml holds the tuned settings), the
  reward-over-imitation story of RL post-training.
- RL (train), eval and SFT prompts are disjoint; eval labels are always correct.

Prompts are the bare text ("397+8="), tokenised with no special tokens (streamrl.runtime.rollout's
`encode_prompt`); a chat template would triple the prompt length for no gain in accuracy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SLIPS: tuple[int, ...] = (-2, -1, 1, 2)  # the teacher's mistakes: the answer off by this much


def arithmetic_problem(rng: random.Random, a_max: int = 999, b_max: int = 9, ops: str = "+") -> tuple[str, str]:
    """(prompt, answer) for `a op b` with 0 <= a <= a_max, 0 <= b <= b_max, op drawn from `ops`."""
    a, b, op = rng.randint(0, a_max), rng.randint(0, b_max), rng.choice(ops)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}=", str(value)


def teacher_response(rng: random.Random, answer: str, accuracy: float) -> str:
    """The noisy teacher's answer: `answer` with probability `accuracy`, else a slip
    (answer + one of SLIPS; never negative for a non-negative answer, never equal to it)."""
    if rng.random() < accuracy:
        return answer
    value = int(answer)
    wrong = value + rng.choice(SLIPS)
    if wrong < 0 <= value:
        wrong = value + (value - wrong)
    return str(wrong)


def write_task(out_dir: str | Path, seed: int = 0, n_train: int = 3000, n_eval: int = 128, n_sft: int = 6000,
               teacher_accuracy: float = 0.3, chat: bool = False, chain_turns: int = 1,
               **difficulty: Any) -> dict[str, Path]:
    """Write train.jsonl ({"id", "prompt", "label"}: RL prompts), eval.jsonl (same keys,
    held out) and sft.jsonl ({"id", "prompt", "response"}: noisy-teacher answers) under
    `out_dir`; all prompts distinct, so the three sets are disjoint. Deterministic for a seed.
    `difficulty` goes to `arithmetic_problem` (a_max, b_max, ops). `chat=True` writes each prompt as
    one user message (`[{"role": "user", "content": "397+8="}]`), rendered with the chat template,
    for chat agents (recipes/openai_agent.yaml). `chain_turns > 1` makes SFT rows for the multi-turn
    calculator environment (recipes/envs/calculator.py): row i continues its problem for
    i % chain_turns more turns, each previous answer the teacher's and each next problem the exact
    running total plus a digit, so the warm-started model has seen a problem after earlier turns.
    Returns {"train", "eval", "sft"} paths."""
    want = n_train + n_eval + n_sft
    rng = random.Random(seed)
    answers: dict[str, str] = {}
    for _ in range(50 * want):
        if len(answers) == want:
            break
        prompt, answer = arithmetic_problem(rng, **difficulty)
        answers.setdefault(prompt, answer)
    if len(answers) < want:
        raise ValueError(f"could not draw {want} distinct problems with {difficulty or 'the defaults'}")
    prompts = list(answers)  # insertion order: deterministic
    shown = (lambda p: [{"role": "user", "content": p}]) if chat else (lambda p: p)
    ev, sft, train = prompts[:n_eval], prompts[n_eval:n_eval + n_sft], prompts[n_eval + n_sft:]
    teacher = random.Random(f"teacher-{seed}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "train": _write_jsonl(out / "train.jsonl",
                              [{"id": f"train-{i}", "prompt": shown(p), "label": answers[p]} for i, p in enumerate(train)]),
        "eval": _write_jsonl(out / "eval.jsonl",
                             [{"id": f"eval-{i}", "prompt": shown(p), "label": answers[p]} for i, p in enumerate(ev)]),
        "sft": _write_jsonl(out / "sft.jsonl",
                            [{"id": f"sft-{i}", **_sft_turns(teacher, p, int(answers[p]), i % chain_turns, chat,
                                                             teacher_accuracy)}
                             for i, p in enumerate(sft)]),
    }


def _sft_turns(rng: random.Random, prompt: str, value: int, turns_before: int, chat: bool,
               accuracy: float) -> dict[str, Any]:
    """One SFT row whose problem comes after `turns_before` earlier turns of a calculator chain:
    {"prompt": context, "response": the teacher's answer to the last problem}."""
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
    for _ in range(turns_before):
        d = rng.randint(0, 9)
        messages += [{"role": "assistant", "content": teacher_response(rng, str(value), accuracy)},
                     {"role": "tool", "content": f"{value}+{d}="}]
        value += d
    response = teacher_response(rng, str(value), accuracy)
    if chat:
        return {"prompt": messages, "response": response}
    # Bare text, as the environment builds it: each answer ends with the end-of-turn token.
    text = "".join(m["content"] + ("<|im_end|>" if m["role"] == "assistant" else "") for m in messages)
    return {"prompt": text, "response": response}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
