"""Multi-turn calculator environments for the quick-start task (recipes/calculator_env.yaml,
recipes/openai_agent.yaml).

A task "397+8=" becomes a chain 397+8+d2+d3...: the model adds one number per turn. After each
answer the calculator tool gives back the exact running total with the next number ("405+5="),
so every turn is a fresh quick-start problem even when the previous answer was wrong. The tool's
tokens are context (loss mask 0); only the model's answers are trained. Reward: the fraction of
turns answered exactly, with `right_turns` as a component.

- `solve`: the native handle (llm.observe / llm.generate), on the bare-text prompts the
  quick-start model was trained on.
- `solve_openai`: an unmodified OpenAI-client agent (recipes/agents/calculator_agent.py) gets
  the episode's base URL and API key; the run's proxy records its exact tokens.
- `solve_tools`: a function-calling agent (recipes/agents/tool_agent.py, the SDK's `tools=` loop)
  answers a problem it is expected to hand to its calculator tool (recipes/tool_agent.yaml);
  reward 1 for the right final answer.
"""

from __future__ import annotations

import random
import re
from typing import Any

from streamrl.recipes.agents.calculator_agent import calculator
from streamrl.recipes.agents.calculator_agent import run as run_agent
from streamrl.recipes.agents.tool_agent import run as run_tool_agent


def question(task: dict[str, Any]) -> str:
    """The task's problem text ("397+8="); chat data (tasks.write_task chat=True) holds it as the user's message."""
    prompt = task["prompt"]
    return str(prompt[-1]["content"] if isinstance(prompt, list) else prompt)


def chain(task: dict[str, Any], turns: int) -> list[int]:
    """The numbers of the task's chain: its two operands, then turns - 1 digits drawn from the
    task id (the same for every sample of a group, so GRPO compares like with like)."""
    m = re.fullmatch(r"\s*(\d+)\+(\d+)=\s*", question(task))
    if m is None:
        raise ValueError(f"expected a prompt like '397+8=', got {task['prompt']!r}")
    rng = random.Random(str(task["id"]))
    return [int(m.group(1)), int(m.group(2))] + [rng.randint(0, 9) for _ in range(turns - 1)]


def score(numbers: list[int], answers: list[str]) -> dict[str, float]:
    totals = [sum(numbers[: k + 2]) for k in range(len(numbers) - 1)]
    right = sum(a.strip() == str(t) for a, t in zip(answers, totals))
    return {"reward": right / len(totals), "right_turns": float(right)}


async def solve(task: dict[str, Any], llm: Any, turns: int = 3) -> dict[str, float]:
    numbers = chain(task, turns)
    llm.observe(f"{numbers[0]}+{numbers[1]}=")
    expression, answers = f"{numbers[0]}+{numbers[1]}", []
    for k, nxt in enumerate([*numbers[2:], None]):
        answers.append(await llm.generate())
        if nxt is None:
            break
        expression = f"{calculator(expression)}+{nxt}"  # the tool's answer: exact, whatever the model said
        llm.observe(expression + "=")
    return score(numbers, answers)


async def solve_openai(task: dict[str, Any], llm: Any, turns: int = 3) -> dict[str, float]:
    numbers = chain(task, turns)
    return score(numbers, await run_agent(numbers, base_url=llm.base_url, api_key=llm.api_key))


async def solve_tools(task: dict[str, Any], llm: Any, max_turns: int = 3, stream: bool = False) -> dict[str, float]:
    answer = await run_tool_agent(question(task), base_url=llm.base_url, api_key=llm.api_key,
                                  max_turns=max_turns, max_tokens=llm.max_new_tokens, stream=stream)
    return {"reward": float((answer or "").strip() == str(task["label"]).strip()), "answered": float(answer is not None)}
