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
import zlib
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


# ---------------------------------------------------------------- the long-tail countdown task
# "957-7=" -> "950;950-7=943;943-7=936;...;901-7=894": subtract d until the hundreds digit drops,
# writing every step. Each step is the quick-start's skill (a 3-digit number minus a digit) on the
# line before it, and the stop rule is local (the step whose result leaves the hundred), so the
# tiny model learns it; the number of steps n is drawn per prompt with P(n) ~ 1/n (log-uniform), so
# response lengths span 13 to 234 tokens with a long tail (median ~54), the shape of reasoning
# traces that makes lockstep wait for its slowest sample. The verifier recomputes the chain.

# At most 24 steps: with Qwen's digit-by-digit tokens a step is ~10 tokens and a 24-step chain at
# most 234 with EOS, within recipes/longtail.yaml's 240 new tokens (the teacher's one step more,
# 244, within the tiny preset's 256 positions with the 6-token prompt). Up to 2026-11-28 it was 28:
# ~5% of the chains (up to 274 tokens) could not be written in 240 and never earned a reward.
MAX_STEPS = 24


def countdown_chain(a: int, d: int) -> list[int]:
    """The values a-d, a-2d, ... up to and including the first one below a's hundred."""
    floor, out = a // 100 * 100, [a - d]
    while out[-1] >= floor:
        out.append(out[-1] - d)
    return out


def countdown_text(a: int, d: int, values: list[int]) -> str:
    """The response for `values` (the exact chain or a teacher's slipped one): "950;950-7=943;..."."""
    return ";".join([str(values[0])] + [f"{x}-{d}={y}" for x, y in zip(values, values[1:])])


def countdown_problem(rng: random.Random, min_steps: int = 2, max_steps: int = MAX_STEPS) -> tuple[int, int]:
    """(a, d) with 100 <= a <= 999, 1 <= d <= 9 whose chain has n steps, P(n) ~ 1/n on
    [min_steps, max_steps]; d and the remainder are uniform among those that give n steps."""
    if not 1 <= min_steps <= max_steps <= 100:
        raise ValueError(f"need 1 <= min_steps <= max_steps <= 100, got {min_steps}, {max_steps}")
    steps = range(min_steps, max_steps + 1)
    n = rng.choices(steps, weights=[1 / k for k in steps])[0]
    # a = h*100 + (n-1)*d + r with r < d: n-1 subtractions stay in the hundred, the n-th leaves it.
    d = rng.choice([d for d in range(1, 10) if (n - 1) * d <= 99])
    r = rng.randint(0, min(d - 1, 99 - (n - 1) * d))
    return rng.randint(1, 9) * 100 + (n - 1) * d + r, d


def teacher_chain(rng: random.Random, a: int, d: int, slip_rate: float,
                  borrow_slip_rate: float = 0.0) -> list[int]:
    """The noisy teacher's chain: each step's result is off by one of SLIPS with probability
    `slip_rate`, and the chain goes on from the value written (so a long chain is more often wrong).
    With `borrow_slip_rate` p the teacher also has a misconception: where the step borrows (x's units
    digit < d) it forgets to lower the tens with probability p ("952-7=955"; no random slip on top).
    Above 0.5 its most likely step is wrong exactly where a borrow is due. It stops where the exact chain would, or
    after one step more (a slip can keep it in the hundred)."""
    floor, out, steps = a // 100 * 100, [], len(countdown_chain(a, d)) + 1
    x = a
    while (not out or out[-1] >= floor) and len(out) < steps:
        y = x - d
        if borrow_slip_rate and x % 10 < d and rng.random() < borrow_slip_rate:
            y += 10
        elif rng.random() < slip_rate:
            y += rng.choice(SLIPS)
        out.append(y)
        x = y
    return out


def countdown_steps(prompt: str, response: str) -> list[tuple[bool, bool]]:
    """(borrows, right) for each step `response` writes for `prompt` ("957-7="), up to and including
    its first wrong one and up to the exact chain's end. A step borrows when the value it subtracts
    from has a units digit below d (every chain's last step does). A piece that is not a number is a
    wrong step. What benchmarks/longtail_steps.py counts."""
    a, d = (int(x) for x in prompt.strip().rstrip("=").split("-"))
    floor, x, out = a // 100 * 100, a, []
    for piece in response.strip().split(";"):
        written, want = piece.rsplit("=", 1)[-1].strip(), x - d
        out.append((x % 10 < d, written == str(want)))
        if not out[-1][1] or want < floor:
            break
        x = want
    return out


def countdown_reward(response: str, label: str, partial_credit: float = 0.0, **_: object) -> dict[str, float]:
    """The verifier: 1 when the whole chain is right (every step and where it stops). With
    `partial_credit` w > 0 (reward.args), the reward is (1 - w) * that + w * `prefix`: the share of
    steps right from the start before the first wrong one, over the longer of the two chains (so
    stopping late costs as stopping early does) - still checked against the recomputed chain, and a
    chain is rewarded in full only when exact. Components: `exact`, `prefix`, `final` (its last number
    is the right one), `steps_right` (the label's steps written correctly in place), `first_error`
    (the offset in `response` of its first character that differs from the exact chain, its length
    when it stops short; -1 when exact: what learner.negative_credit first_error blames)."""
    if not 0.0 <= partial_credit <= 1.0:
        raise ValueError(f"reward.args.partial_credit must be within [0, 1], got {partial_credit!r}")
    text, chain = response.strip(), str(label).strip()
    got, want = text.split(";"), chain.split(";")
    wrong = next((i for i, (g, w) in enumerate(zip(text, chain)) if g != w), min(len(text), len(chain)))
    first_error = -1 if text == chain else len(response) - len(response.lstrip()) + wrong
    right = sum(g == w for g, w in zip(got, want))
    lead = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    prefix = lead / max(len(got), len(want))
    exact = float(got == want)
    last = got[-1].rsplit("=", 1)[-1]
    return {"reward": (1 - partial_credit) * exact + partial_credit * prefix, "exact": exact, "prefix": prefix,
            "final": float(last == want[-1].rsplit("=", 1)[-1]), "steps_right": right / len(want),
            "first_error": float(first_error)}


def write_longtail_task(out_dir: str | Path, seed: int = 0, n_train: int = 3000, n_eval: int = 128,
                        n_sft: int = 6000, slip_rate: float = 0.1, min_steps: int = 2,
                        max_steps: int = MAX_STEPS, borrow_slip_rate: float = 0.0) -> dict[str, Path]:
    """Write train/eval/sft.jsonl for the countdown task (same keys as `write_task`; the label is
    the exact chain, scored by `countdown_reward`). The splits are disjoint by prompt (each prompt
    belongs to one split by a hash of its text); within a split prompts are drawn i.i.d., so a
    short-chain prompt may repeat (there are only ~400 two-step problems). SFT responses come from
    the noisy teacher (`teacher_chain`, with `slip_rate` and `borrow_slip_rate`). Deterministic for a seed."""
    rng, teacher = random.Random(f"longtail-{seed}"), random.Random(f"longtail-teacher-{seed}")
    want = {"eval": n_eval, "sft": n_sft, "train": n_train}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in want}
    for _ in range(50 * sum(want.values())):
        if all(len(rows[k]) == n for k, n in want.items()):
            break
        a, d = countdown_problem(rng, min_steps, max_steps)
        prompt = f"{a}-{d}="
        h = zlib.crc32(prompt.encode()) % 16
        split = "eval" if h == 0 else "sft" if h < 9 else "train"
        if len(rows[split]) == want[split]:
            continue
        i = len(rows[split])
        if split == "sft":
            rows[split].append({"id": f"sft-{i}", "prompt": prompt,
                                "response": countdown_text(a, d, teacher_chain(teacher, a, d, slip_rate,
                                                                                   borrow_slip_rate))})
        else:
            rows[split].append({"id": f"{split}-{i}", "prompt": prompt,
                                "label": countdown_text(a, d, countdown_chain(a, d))})
    if any(len(rows[k]) < n for k, n in want.items()):
        raise ValueError(f"could not draw {want} countdown problems with steps {min_steps}..{max_steps}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {k: _write_jsonl(out / f"{k}.jsonl", rows[k]) for k in ("train", "eval", "sft")}
